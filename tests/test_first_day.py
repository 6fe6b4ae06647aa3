"""The small things a first day trips over:

* the draft-name suggestion of an unknown embedded head names selections that work;
* the README: a supported-models table with exactly the architectures the loader serves, and
  the bench line that skips the transformers baseline (an override that composes);
* the Makefile installs torch from the CPU index when it answers, and says what happens when
  it does not (``make -n``: nothing runs);
* a real engine's start-up line names its method, K, dtype, device and kernels.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from specserve.compose import compose_config
from specserve.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)


def test_an_unknown_embedded_head_suggests_selections_that_work():
    from specserve.executor.eagle_loader import resolve_head_dir

    with pytest.raises(ConfigError) as e:
        resolve_head_dir("embedded:smollm2-eagle3", "draft.path")
    text = str(e.value)
    assert text.startswith("draft.path: unknown embedded head 'smollm2-eagle3'; shipped: ")
    suggestions = re.findall(r"(draft=\S+|method\.model=\S+)", text)
    assert "draft=smollm2-135m-eagle3" in suggestions
    for s in suggestions:  # each one, as typed, composes to the shipped head
        cfg = compose_config(["+method=eagle3", s])
        head = cfg.method.model or cfg.draft.path
        assert head == "embedded:smollm2-135m-instruct-eagle3", s
        assert resolve_head_dir(head).is_dir()


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_the_readme_lists_the_supported_architectures():
    from specserve.executor.models.llama import SUPPORTED_MODEL_TYPES

    section = _readme().split("### Supported models", 1)[1].split("\n### ", 1)[0]
    table = section.split("\n\n", 2)[1]  # the first table: architectures
    listed = re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE)
    assert listed == list(SUPPORTED_MODEL_TYPES)
    for word in ("bfloat16", "float16", "CUDA only", "quantized", "HF_HUB_CACHE", "SPECSERVE_MODELS_DIR"):
        assert word in section, word


def test_the_readme_says_how_to_skip_the_transformers_baseline():
    readme = _readme()
    assert "make bench\nARGS='bench.baselines=[specserve_vanilla]'" in readme or \
        "make bench ARGS='bench.baselines=[specserve_vanilla]'" in readme.replace("\n", " ")
    assert compose_config(["bench.baselines=[specserve_vanilla]"]).bench.baselines == ["specserve_vanilla"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_the_makefile_prefers_the_cpu_torch_index_and_says_when_it_cannot(tmp_path):
    proc = subprocess.run(["make", "-n", "-B", "VENV=" + str(tmp_path / "venv"), str(tmp_path / "venv" /
                           ".specserve-installed")], cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plan = proc.stdout
    assert 'pip install -q "torch==2.13.0" --index-url "https://download.pytorch.org/whl/cpu"' in plan
    assert "is not reachable, so torch==2.13.0 comes from the default index" in plan
    assert "CUDA build" in plan
    assert plan.index("torch==2.13.0") < plan.index('-e ".[dev,data]"')  # torch first: the project's deps then find it


def test_a_real_engines_start_up_line(tiny_llama):
    from engine_utils import tiny_config

    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.engine import LLMEngine
    from specserve.server import start_servers

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("specserve.server")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        cfg = tiny_config(tiny_llama, "ngram", k=3, num_blocks=64, block_size=4)
        cfg.server.host, cfg.server.grpc_port, cfg.server.http_port = "127.0.0.1", 0, 0
        engine = AsyncEngine(LLMEngine(cfg), max_queue=8)
        handle = start_servers(cfg, engine)
        try:
            info = engine.info
            line = next(r for r in records if r.startswith("serving "))
            assert line.startswith(f"serving {info.model_name}: method ngram, K=3, dtype {info.dtype} on {info.device}, "
                                   f"attention {info.attention_backend}, rejection {info.rejection_backend}, "
                                   "tensor parallel 1; ")
            assert f"gRPC on 127.0.0.1:{handle.grpc_port}," in line
            assert f"HTTP on http://127.0.0.1:{handle.http_port}, API key" in line
        finally:
            handle.stop()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
