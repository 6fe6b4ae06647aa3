"""Config composition and validation: every bad key yields one clear line and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specserve.cli import UsageError, compose_config
from specserve.config import Config
from specserve.errors import ConfigError

BAD = [
    (["+method=ngram", "method.num_speculative_tokens=0"], "method.num_speculative_tokens"),
    (["+method=ngram", "method.num_speculative_tokens=-2"], "method.num_speculative_tokens"),
    (["+method=ngram", "method.num_speculative_tokens=129"], "method.num_speculative_tokens"),
    (["+method=ngram", "method.num_speculative_tokens=null"], "method.num_speculative_tokens"),
    (["+method=ngram", "method.tensor_parallel_size=2"], "method.draft_tensor_parallel_size"),
    (["+method=ngram", "method.prompt_lookup_min=6", "method.prompt_lookup_max=3"], "method.prompt_lookup_min"),
    (["+method=ngram", "method.synthetic_acceptance_rate=0.5"], "method.synthetic_acceptance_rate"),
    (["+method=ngram", "method.rejection_sample_method=synthetic", "method.synthetic_acceptance_rate=1.5"],
     "method.synthetic_acceptance_rate"),
    (["+method=ngram", "method.rejection_sample_method=synthetic"], "method.synthetic_acceptance_rate"),
    (["+method=ngram", "method.rejection_sample_method=typical"], "method.rejection_sample_method"),
    (["+method=ngram", "method.temperature=0.7"], "method.temperature"),
    (["+method=ngram", "method.top_p=0.9"], "method.top_p"),
    (["+method=ngram", "method.parallel_drafting=true"], "method.parallel_drafting"),
    (["+method=ngram", "method.bogus_key=1"], "method.bogus_key"),
    (["+method=draft_model"], "method.model"),
    (["+method=draft_model", "draft=smollm2-135m", "method.draft_tensor_parallel_size=3"],
     "method.draft_tensor_parallel_size"),
    (["+method=nope"], "method: unknown preset 'nope'"),
    (["+method=ngram", "method.method=medusa"], "method.method"),
    (["model=nope"], "model: unknown preset"),
    (["model.dtype=float8"], "model.dtype"),
    (["model.max_model_len=0"], "model.max_model_len"),
    (["engine.device=tpu"], "engine.device"),
    (["engine.block_size=abc"], "engine.block_size"),
    (["engine.max_num_seqs=0"], "engine.max_num_seqs"),
    (["engine.cpu_kernel=avx"], "engine.cpu_kernel"),
    (["engine.cpu_fused_max_tokens=0"], "engine.cpu_fused_max_tokens"),
    (["server.grpc_port=70000"], "server.grpc_port"),
    (["server.tls_cert_file=/x.pem"], "server.tls_cert_file"),
    (["parallelism.tensor_parallel_size=0"], "parallelism.tensor_parallel_size"),
    (["parallelism.pipeline_parallel_size=2"], "parallelism.pipeline_parallel_size"),
    (["parallelism=tp2", "engine.cpu_kernel=fused"], "engine.cpu_kernel"),
    (["parallelism.timeout_s=0"], "parallelism.timeout_s"),
    (["bench.dataset=alpaca"], "bench.dataset"),
    (["nonsense_key=1"], "nonsense_key"),
]


@pytest.mark.parametrize("overrides, key", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises((ConfigError, UsageError)) as e:
        compose_config(overrides)
    msg = str(e.value)
    assert key in msg and "\n" not in msg


def test_defaults_compose_to_plain_decoding_on_the_embedded_model():
    cfg = compose_config([])
    assert isinstance(cfg, Config) and cfg.method is None
    assert cfg.model.path == "embedded:smollm2-135m-instruct" and cfg.parallelism.tensor_parallel_size == 1


def test_ngram_preset_and_override():
    cfg = compose_config(["+method=ngram", "method.num_speculative_tokens=3"])
    assert cfg.method.method == "ngram" and cfg.method.num_speculative_tokens == 3
    assert (cfg.method.prompt_lookup_min, cfg.method.prompt_lookup_max) == (2, 5)


def test_prompt_lookup_one_key_mirrors_the_other():
    cfg = compose_config(["+method=ngram", "method.prompt_lookup_min=null", "method.prompt_lookup_max=null"])
    assert (cfg.method.prompt_lookup_min, cfg.method.prompt_lookup_max) == (5, 5)
    cfg = compose_config(["+method=ngram", "method.prompt_lookup_min=null", "method.prompt_lookup_max=4"])
    assert (cfg.method.prompt_lookup_min, cfg.method.prompt_lookup_max) == (4, 4)


def test_draft_group_selects_the_draft():
    cfg = compose_config(["+method=draft_model", "draft=smollm2-135m"])
    assert cfg.draft is not None and cfg.draft.path == "embedded:smollm2-135m-instruct"


def test_extra_config_dir_adds_presets(tmp_path):
    (tmp_path / "method").mkdir()
    (tmp_path / "method" / "mine.yaml").write_text("method: ngram\nnum_speculative_tokens: 2\n")
    cfg = compose_config(["--config-dir", str(tmp_path), "+method=mine"])
    assert cfg.method.num_speculative_tokens == 2


@pytest.mark.parametrize("args", [["+method=ngram", "method.num_speculative_tokens=0"], ["+method=nope"],
                                  ["--bogus-flag"]])
def test_cli_prints_one_line_and_exits_2(args):
    exe = Path(sys.executable).parent / "specserve"  # the installed console script
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specserve") and "error:" in lines[0]
    assert "Traceback" not in r.stderr
