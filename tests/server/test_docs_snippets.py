"""The docs' client code runs: every ```python block marked ``<!-- docs-test ... -->`` in
README.md and docs/*.md, against a server on loopback (the FakeEngine, serving the README's
model name; ``localhost:50051`` / ``localhost:8000`` become its ports), and
``examples/openai_client.py`` with its base URL from an argument or ``OPENAI_BASE_URL``."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fake_engine import FakeEngine, ModelInfo

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r"<!-- docs-test[^>]*-->\s*\n```python\n(.*?)```", re.DOTALL)

pytestmark = pytest.mark.timeout(120)


def snippets() -> list[tuple[str, str]]:
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for i, m in enumerate(MARK.finditer(path.read_text())):
            out.append((f"{path.relative_to(ROOT)}#{i}", m.group(1)))
    return out


def test_the_docs_mark_their_client_snippets():
    names = [name for name, _ in snippets()]
    assert "docs/server.md#0" in names and "README.md#0" in names
    assert any("grpc.insecure_channel" in code for _, code in snippets())


@pytest.fixture
def readme_server(make_served):
    return make_served(FakeEngine(ModelInfo(model_name="smollm2-135m-instruct")))


@pytest.mark.parametrize("name, code", snippets(), ids=[n for n, _ in snippets()])
def test_a_docs_snippet_runs_against_a_server(readme_server, name, code):
    s = readme_server
    code = code.replace("localhost:50051", f"127.0.0.1:{s.handle.grpc_port}")
    code = code.replace("localhost:8000", f"127.0.0.1:{s.handle.http_port}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), {"__name__": "__docs__"})
    assert out.getvalue().strip(), f"{name} printed nothing"
    assert s.engine.requests, f"{name} sent no request"


@pytest.mark.parametrize("how", ["argument", "OPENAI_BASE_URL"])
def test_the_openai_example_takes_its_base_url(readme_server, how, tmp_path):
    url = f"http://127.0.0.1:{readme_server.handle.http_port}/v1"
    env = {**os.environ, "OPENAI_BASE_URL": url if how == "OPENAI_BASE_URL" else "http://127.0.0.1:9/v1"}
    argv = [url] if how == "argument" else []
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "openai_client.py"), *argv], env=env,
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("Completion results:\nCompletion(") and "spec_decode" in proc.stdout
