"""A port in use fails the server at once: exit 2 with one line naming the key, before any
model file is opened (the loader's calls are counted), and without gRPC C-core's own lines."""

from __future__ import annotations

import contextlib
import io
import socket
import subprocess
import sys

import pytest

import specserve.engine.engine as engine_module
import specserve.executor.loader as loader
from specserve.cli import serve_main

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def busy_port():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("0.0.0.0", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


@pytest.fixture
def loader_calls(monkeypatch):
    calls: list[str] = []

    def counting(name, real):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(loader, "resolve_hf_dir", counting("resolve_hf_dir", loader.resolve_hf_dir))
    monkeypatch.setattr(loader, "load_model", counting("load_model", loader.load_model))
    monkeypatch.setattr(engine_module, "load_model", counting("load_model", engine_module.load_model))
    return calls


def serve(argv: list[str]) -> tuple[int, list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = serve_main(argv)
    return rc, [line for line in err.getvalue().splitlines() if line.strip()]


@pytest.mark.parametrize("key", ["http_port", "grpc_port"])
def test_a_port_in_use_exits_2_before_the_model_loads(busy_port, loader_calls, tiny_llama, key):
    other = "grpc_port" if key == "http_port" else "http_port"
    rc, lines = serve([f"model.path={tiny_llama}", "model.dtype=float32", f"server.{key}={busy_port}", f"server.{other}=0"])
    assert rc == 2 and loader_calls == []
    assert lines == [f"specserve: error: server.{key}: cannot listen on 0.0.0.0:{busy_port}: Address already in use "
                     f"(set server.{key} to a free port, or 0 for any)"]


def test_the_vllm_form_fails_the_same_way(busy_port, loader_calls, tiny_llama):
    rc, lines = serve(["serve", str(tiny_llama), "--port", str(busy_port), "--dtype", "float32"])
    errors = [line for line in lines if "error" in line]
    assert rc == 2 and loader_calls == [] and len(errors) == 1
    assert errors[0].startswith(f"specserve: error: server.http_port: cannot listen on 0.0.0.0:{busy_port}")


def test_the_same_port_twice_is_one_line(loader_calls, tiny_llama):
    rc, lines = serve([f"model.path={tiny_llama}", "server.http_port=18123", "server.grpc_port=18123"])
    assert rc == 2 and loader_calls == []
    assert lines == ["specserve: error: server.grpc_port: is 18123, the same as server.http_port; give them "
                     "different ports"]


def test_no_grpc_core_noise_in_the_real_process(busy_port, tiny_llama, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "specserve", f"model.path={tiny_llama}", f"server.grpc_port={busy_port}",
         "server.http_port=0"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip() and " INFO " not in line]
    assert proc.returncode == 2 and proc.stdout == ""
    assert lines == [f"specserve: error: server.grpc_port: cannot listen on 0.0.0.0:{busy_port}: Address already in "
                     "use (set server.grpc_port to a free port, or 0 for any)"], proc.stderr
