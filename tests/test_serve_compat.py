"""``specserve serve MODEL [vLLM flags]``: a thin translation into Hydra overrides.

The seed's serve command translates to the expected overrides (``--dry-run``
prints them and the validated config); removed vLLM flags and unknown flags
fail in one line; the real console script, started with the seed's command
(model replaced, ports free), serves the seed's OpenAI client code unchanged
and exits 0 on SIGTERM.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tiny_models import make_tiny_model

from specserve.cli import serve_main
from specserve.serve_compat import translate

pytestmark = pytest.mark.timeout(120)

SEED_SPEC = '{"model": "DRAFT", "num_speculative_tokens": 5, "method": "draft_model"}'


def seed_flags(draft: str, host: str = "0.0.0.0", port: str = "8000") -> list[str]:
    """The seed's `vllm serve` flags (000_*.txt), draft model replaced."""
    return ["--host", host, "--port", port, "--seed", "42", "-tp", "1", "--max_model_len", "2048",
            "--gpu_memory_utilization", "0.8", "--speculative_config", SEED_SPEC.replace("DRAFT", draft)]  # fmt: skip


def run_serve(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = serve_main(["serve", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_seed_command_translates_to_hydra_overrides():
    overrides, notes, dry = translate(["/m/target", *seed_flags("/m/draft")])
    assert overrides == [
        "model.path=/m/target", "model.name=/m/target", "+method=draft_model", "method.model=/m/draft",
        "method.num_speculative_tokens=5", "model.max_model_len=2048", "engine.seed=42",
        "engine.gpu_memory_utilization=0.8", "server.host=0.0.0.0", "server.http_port=8000", "server.grpc_port=0",
    ]  # fmt: skip
    assert not dry and len(notes) == 1 and notes[0].startswith("--port without --grpc-port: gRPC listens on a free port")


def test_spellings_short_flags_and_passthrough_agree():
    a, _, _ = translate(["--model", "embedded:smollm2-135m-instruct", "--max-model-len=512", "--tensor-parallel-size", "1",
                         "--grpc-port", "0", "--max-num-seqs", "4", "--dtype", "half", "engine.num_threads=2"])  # fmt: skip
    b, _, _ = translate(["smollm2-135m-instruct", "--max_model_len", "512", "-tp=1", "--grpc_port=0",
                         "--max_num_seqs=4", "--dtype=float16", "engine.num_threads=2"])  # fmt: skip
    assert a == b == [
        "model.path=embedded:smollm2-135m-instruct", "model.name=smollm2-135m-instruct", "model.dtype=float16",
        "model.max_model_len=512", "engine.max_num_seqs=4", "server.grpc_port=0", "engine.num_threads=2",
    ]  # fmt: skip
    assert translate(["smollm2-135m", "--speculative-config", '{"method": "ngram"}'])[0] == [
        "model=smollm2-135m", "server.served_model_aliases=[smollm2-135m]", "+method=ngram"]  # fmt: skip


def test_dry_run_prints_the_translation_and_the_validated_config(tiny_llama, tiny_draft):
    rc, out, err = run_serve([str(tiny_llama), *seed_flags(str(tiny_draft)), "--max_model_len", "512", "--dry-run"])
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("#") and lines[1].startswith(f"specserve model.path={tiny_llama} ")
    assert "+method=draft_model" in lines[1] and "server.http_port=8000" in lines[1]
    cfg = yaml.safe_load("\n".join(lines[3:]))
    assert cfg["method"]["model"] == str(tiny_draft) and cfg["method"]["num_speculative_tokens"] == 5
    assert cfg["model"]["max_model_len"] == 512 and cfg["engine"]["seed"] == 42
    assert cfg["server"]["http_port"] == 8000 and cfg["server"]["host"] == "0.0.0.0"
    assert cfg["engine"]["gpu_memory_utilization"] == 0.8


@pytest.mark.parametrize("flag", ["--speculative-model", "--speculative_model", "--num-speculative-tokens",
                                  "--num_speculative_tokens", "--ngram-prompt-lookup-max"])  # fmt: skip
def test_removed_vllm_flags_say_what_to_use_instead(flag):
    rc, out, err = run_serve(["embedded:smollm2-135m-instruct", flag, "4", "--dry-run"])
    assert rc == 2 and out == ""
    line = err.strip()
    assert "\n" not in line and line.startswith(f"specserve serve: error: {flag.replace('_', '-')} was removed from vLLM")
    assert line.endswith(
        "use --speculative-config '{\"method\": \"draft_model\", \"model\": \"<draft>\", \"num_speculative_tokens\": N}'"
    )


@pytest.mark.parametrize("argv, expected", [
    (["--block-allocator", "4"], "unknown option '--block-allocator'"),
    (["--port", "http"], "--port must be an integer, got 'http'"),
    (["--speculative-config", "{method: ngram}"], "--speculative-config: not valid JSON"),
    (["--speculative-config", '{"method": "ngram", "bogus": 1}'], "method.bogus: no such key; method has: method, model, num_speculative_tokens,"),
    (["--speculative-config", '{"method": "ngram", "temperature": 0.7}'], "method.temperature: is not a valid key here"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "method.num_speculative_tokens: must be >= 1"),
    (["-tp", "0"], "parallelism.tensor_parallel_size: must be >= 1"),
    (["--max-model-len"], "--max-model-len needs a value"),
    (["--dry-run=yes"], "--dry-run takes no value"),
    (["other-model"], "one model only"),
])  # fmt: skip
def test_bad_serve_arguments_are_one_line(argv, expected):
    rc, _, err = run_serve(["embedded:smollm2-135m-instruct", *argv, "--dry-run"])
    line = err.strip()
    assert rc == 2 and "\n" not in line and line.startswith("specserve serve: error: ") and expected in line, line


def test_dry_run_makes_start_up_device_checks():
    rc, out, err = run_serve(["embedded:smollm2-135m-instruct", "--dtype", "half", "--device", "cpu", "--dry-run"])
    assert rc == 2 and "# the composed" not in out
    assert err.strip() == ("specserve serve: error: model.dtype=float16 is only supported on CUDA; "
                           "use bfloat16 or float32 on CPU")  # fmt: skip


def _dry_config(argv: list[str]) -> tuple[dict, str]:
    rc, out, err = run_serve(["embedded:smollm2-135m-instruct", *argv, "--dry-run"])
    assert rc == 0, err
    return yaml.safe_load("\n".join(out.splitlines()[3:])), err


def test_port_without_grpc_port_puts_grpc_on_a_free_port():
    cfg, err = _dry_config(["--port", "8001"])
    assert (cfg["server"]["http_port"], cfg["server"]["grpc_port"]) == (8001, 0)
    assert "note: --port without --grpc-port: gRPC listens on a free port" in err
    for argv in (["--port", "8001", "--grpc-port", "9001"], ["--port", "8001", "server.grpc_port=9001"]):
        cfg, err = _dry_config(argv)
        assert cfg["server"]["grpc_port"] == 9001 and "free port" not in err
    assert _dry_config([])[0]["server"]["grpc_port"] == 50051  # no --port: the defaults, 8000 and 50051


def test_served_model_names_and_the_model_as_given():
    cfg, _ = _dry_config(["--served-model-name", "gpt-x", "gpt-y", "--port", "8001"])
    assert cfg["model"]["name"] == "gpt-x" and cfg["server"]["http_port"] == 8001
    assert cfg["server"]["served_model_aliases"] == ["gpt-y", "embedded:smollm2-135m-instruct"]
    cfg, _ = _dry_config([])
    assert cfg["model"]["name"] == "smollm2-135m-instruct"
    assert cfg["server"]["served_model_aliases"] == ["embedded:smollm2-135m-instruct"]
    overrides, _, _ = translate(["smollm2-135m", "--served-model-name=mine"])
    assert overrides == ["model=smollm2-135m", "model.name=mine", "server.served_model_aliases=[smollm2-135m]"]


def test_help_and_the_hydra_form_unchanged(capsys):
    assert serve_main(["serve", "--help"]) == 0
    assert "--speculative-config JSON" in capsys.readouterr().out
    assert serve_main(["+method=ngram", "--cfg"]) == 0  # Hydra stays the primary interface
    assert "method: ngram" in capsys.readouterr().out


# --------------------------------------------------------------------------- the real console script

SEED_CLIENT = '''
from openai import OpenAI

# Modify OpenAI's API key and API base to use vLLM's API server.
openai_api_key = "EMPTY"
openai_api_base = "http://localhost:8000/v1"

client = OpenAI(
    # defaults to os.environ.get("OPENAI_API_KEY")
    api_key=openai_api_key,
    base_url=openai_api_base,
)

models = client.models.list()
model = models.data[0].id

# Completion API
stream = False
completion = client.completions.create(
    model=model,
    prompt="The future of AI is",
    echo=False,
    n=1,
    stream=stream,
)

print("Completion results:")
if stream:
    for c in completion:
        print(c)
else:
    print(completion)
'''


@pytest.fixture(scope="module")
def long_models(tmp_path_factory) -> tuple[Path, Path]:
    """Tiny target and draft with 2048 positions, so the seed's --max_model_len 2048 fits."""
    root = tmp_path_factory.mktemp("tiny-2048")
    target = make_tiny_model(root / "target", "llama", max_position_embeddings=2048)
    draft = make_tiny_model(root / "draft", "llama", seed=7, num_hidden_layers=1, max_position_embeddings=2048)
    return target, draft


def _console_script() -> list[str]:
    exe = Path(sys.executable).parent / "specserve"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "specserve"]


def _serve_seed_client(target: str, draft: str, tmp_path: Path) -> str:
    """Start the console script with the seed's flags (free ports), run the seed's
    client code against it, SIGTERM it; return what the client printed."""
    flags = seed_flags(draft, host="127.0.0.1", port="0") + ["--grpc-port", "0"]
    log = tmp_path / "serve.log"
    env = {**os.environ, "SPECSERVE_API_KEY": "", "SPECSERVE_LOG_LEVEL": "INFO"}
    with log.open("w") as f:
        proc = subprocess.Popen([*_console_script(), "serve", target, *flags], stdout=f, stderr=subprocess.STDOUT,
                                env=env)  # fmt: skip
    try:
        port = None
        deadline = time.monotonic() + 240
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            m = re.search(r"HTTP on http://127\.0\.0\.1:(\d+)", log.read_text())
            port = m and int(m.group(1))
            time.sleep(0.2)
        assert port, log.read_text()[-2000:]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(SEED_CLIENT.replace("localhost:8000", f"localhost:{port}"), {})
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    text = log.read_text()
    assert rc == 0, text[-2000:]
    assert "specserve serve: running as: specserve model.path=" in text and "servers stopped" in text
    printed = out.getvalue()
    assert printed.startswith("Completion results:\nCompletion(") and "spec_decode" in printed, printed
    return printed


def test_seed_serve_command_serves_the_seed_client(long_models, tmp_path):
    target, draft = long_models
    printed = _serve_seed_client(str(target), str(draft), tmp_path)
    assert f"model='{target}'" in printed and "text='" in printed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_seed_serve_command_on_the_embedded_model(tmp_path):
    printed = _serve_seed_client("embedded:smollm2-135m-instruct", "embedded:smollm2-135m-instruct", tmp_path)
    assert "model='smollm2-135m-instruct'" in printed
    # The seed's request samples at temperature 1 and the draft proposes its argmax: some drafts are accepted.
    m = re.search(r"'mean_acceptance_length': ([0-9.]+)", printed)
    assert m and float(m.group(1)) > 1.0, printed


def test_python_dash_m_specserve_serve_dry_run(tiny_llama):
    r = subprocess.run([sys.executable, "-m", "specserve", "serve", str(tiny_llama), "--speculative-config",
                        json.dumps({"method": "ngram", "num_speculative_tokens": 3}), "--dry-run"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "+method=ngram method.num_speculative_tokens=3" in r.stdout


def test_a_nested_tree_in_the_speculative_config_is_its_dotted_keys():
    """vLLM writes the tree as an object; it becomes method.tree.* (as flat keys already did)."""
    nested = '{"method": "eagle3", "num_speculative_tokens": 4, "tree": {"topk": 2, "num_draft_tokens": 6, "depth": 3}}'
    rc, out, err = run_serve(["embedded:smollm2-135m-instruct", "--speculative-config", nested, "--dry-run"])
    assert rc == 0, err
    tree = yaml.safe_load(out.split("# the composed, validated config:", 1)[1])["method"]["tree"]
    assert (tree["topk"], tree["num_draft_tokens"], tree["depth"]) == (2, 6, 3)
    rc, _, err = run_serve(["embedded:smollm2-135m-instruct", "--speculative-config",
                            '{"method": "eagle3", "tree": {"topkk": 2}}', "--dry-run"])  # fmt: skip
    assert rc == 2 and err.strip() == "specserve serve: error: method.tree.topkk: no such key; did you mean method.tree.topk?"


def test_dry_run_checks_that_the_model_exists(tmp_path):
    rc, out, err = run_serve([str(tmp_path / "missing"), "--dry-run"])
    assert rc == 2 and "# the composed" not in out
    assert err.strip().startswith("specserve serve: error: model.path: model path not found: ")
    rc, _, err = run_serve([str(tmp_path / "gone.gguf"), "--dry-run"])
    assert rc == 2 and "model.path: model file not found" in err
