"""Config composition and validation: every bad key yields one clear line and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specserve.cli import UsageError, compose_config, serve_main
from specserve.config import Config
from specserve.errors import ConfigError
from specserve.methods import method_names

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
    (["+method=ngram", "method.method=lookahead"], "method.method"),
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
                                  ["--bogus-flag"], ["--cfg", "+engine.max_num_seq=64"]])
def test_cli_prints_one_line_and_exits_2(args):
    exe = Path(sys.executable).parent / "specserve"  # the installed console script
    r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specserve") and "error:" in lines[0]
    assert "Traceback" not in r.stderr


# --------------------------------------------------------------------------- every door validates


@pytest.mark.parametrize("args, line", [
    (["+method=ngram", "method.num_speculative_tokens=0"], "method.num_speculative_tokens: must be >= 1, got 0"),
    (["model.dtype=float16", "engine.device=cpu"],
     "model.dtype=float16 is only supported on CUDA; use bfloat16 or float32 on CPU"),
    (["+engine.max_num_seq=64"], "engine.max_num_seq: no such key; did you mean engine.max_num_seqs?"),
])  # fmt: skip
def test_cfg_prints_a_config_only_once_it_passes_start_up_checks(args, line, capsys):
    assert serve_main(["--cfg", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == f"specserve: error: {line}"


def test_cfg_prints_the_validated_config(capsys):
    assert serve_main(["--cfg", "+method=ngram", "method.prompt_lookup_min=null", "method.prompt_lookup_max=4"]) == 0
    out = capsys.readouterr().out
    assert "prompt_lookup_min: 4" in out and "served_model_aliases:\n  - embedded:smollm2-135m-instruct" in out


@pytest.mark.parametrize("overrides, line", [
    (["+engine.max_num_seq=64"], "engine.max_num_seq: no such key; did you mean engine.max_num_seqs?"),
    (["engine.max_num_seq=64"], "engine.max_num_seq: no such key; did you mean engine.max_num_seqs?"),
    (["+method=ngram", "method.num_speculative_tokenz=4"],
     "method.num_speculative_tokenz: no such key; did you mean method.num_speculative_tokens?"),
    (["+method=ngram", "+method.prompt_lookup_mn=2"],
     "method.prompt_lookup_mn: no such key; did you mean method.prompt_lookup_min?"),
    (["+max_num_seqs=8"], "max_num_seqs: no such key; did you mean engine.max_num_seqs?"),
    (["+model.max_num_seqs=8"], "model.max_num_seqs: no such key; did you mean engine.max_num_seqs?"),
    (["+foo=bar"], "foo: no such key; the top-level keys are: model, draft, method, parallelism, engine, server, "
                   "bench, generate, audio"),
    (["+parallelism.zzz=1"], "parallelism.zzz: no such key; parallelism has: tensor_parallel_size, "
                             "pipeline_parallel_size, master_port, timeout_s"),
    (["+method.temperature=0.5", "+method=ngram"],
     "method.temperature: is not a valid key here; sampling keys belong to each request (SamplingParams), "
     "not the speculative config"),
])  # fmt: skip
def test_unknown_keys_fail_naming_the_closest_key(overrides, line):
    with pytest.raises(UsageError) as e:
        compose_config(overrides)
    assert str(e.value) == line


@pytest.mark.parametrize("overrides, line", [
    (["method.num_speculative_tokens=4"],
     "method.num_speculative_tokens: no speculative method is selected; add one first: +method=<name> "
     f"method.num_speculative_tokens=4 (methods: {', '.join(method_names())})"),
    (["method=ngram"], "method: not in the defaults, so it is added with +: write +method=ngram"),
    (["+method=ngram", "+method=suffix"],
     "method: selected twice (+method=ngram and +method=suffix); give +method=<name> once"),
    (["+draft=smollm2-135m"], "draft: is in the defaults already, so it is selected without +: write draft=smollm2-135m"),
    (["+method=ngram", "+method.num_speculative_tokens=4"],
     "method.num_speculative_tokens: is set already (by its preset or the schema), so it is changed without +: "
     "write method.num_speculative_tokens=4"),
    (["draft.dtype=float32"], "draft.dtype: no draft is selected; add draft=<preset> first (qwen3-tiny, smollm2-135m, "
                              "smollm2-135m-eagle3), or set method.model=<path>"),
    (["engine.max_num_seqs"], "engine.max_num_seqs: an override needs a value: engine.max_num_seqs=<value>"),
])  # fmt: skip
def test_hydra_slips_say_what_to_type(overrides, line):
    with pytest.raises(UsageError) as e:
        compose_config(overrides)
    assert str(e.value) == line


def test_the_model_path_as_given_is_a_served_name():
    assert compose_config([]).server.served_model_aliases == ["embedded:smollm2-135m-instruct"]
    cfg = compose_config(["model.name=x", "server.served_model_aliases=[a,x,a]"])
    assert cfg.model.name == "x" and cfg.server.served_model_aliases == ["a", "embedded:smollm2-135m-instruct"]
    with pytest.raises(ConfigError, match=r"^server\.served_model_aliases: names must be non-empty"):
        compose_config(["server.served_model_aliases=['']"])


# --------------------------------------------------------------------------- each tool's own --help


@pytest.mark.parametrize("tool, own, foreign", [
    ("specserve-generate", ["generate.prompts=[]", "generate.max_tokens=128", "generate.messages=[]"],
     ["server.grpc_port", "bench."]),
    ("specserve-bench", ["bench.num_prompts=16", "bench.baselines=[specserve_vanilla,hf]", "bench.prompts_file=null",
                         "-m, --multirun"], ["server.grpc_port", "generate."]),
    ("specserve-train", ["data.num_conversations=800", "optim.epochs=2", "output_dir=outputs/eagle3-head",
                         "head.draft_vocab_size=8192"], ["server.grpc_port", "bench.", "``"]),
    ("specserve-loadgen", ["--clients", "--duration-s", "--expect-shutdown"], ["OVERRIDE"]),
    ("specserve", ["Overrides are Hydra overrides", "server.grpc_port", "specserve serve MODEL"], ["bench.", "generate."]),
])  # fmt: skip
def test_each_tool_prints_its_own_usage_and_keys(tool, own, foreign, capsys):
    from specserve import cli, loadgen
    from specserve.train import cli as train_cli

    main = {"specserve-generate": cli.generate_main, "specserve-bench": cli.bench_main, "specserve": cli.serve_main,
            "specserve-train": train_cli.main, "specserve-loadgen": loadgen.main}[tool]
    try:
        rc = main(["--help"])
    except SystemExit as e:  # argparse
        rc = e.code
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith(f"usage: {tool} "), out[:200]
    assert all(k in out for k in own), [k for k in own if k not in out]
    assert not any(k in out for k in foreign), [k for k in foreign if k in out]


def test_the_installed_bench_script_and_a_sweep_print_the_bench_help():
    exe = Path(sys.executable).parent / "specserve-bench"
    for args in (["--help"], ["-m", "+method=ngram", "-h"]):
        r = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("usage: specserve-bench "), (args, r.stdout[:300], r.stderr)
        assert "bench.max_tokens=128" in r.stdout and "server.grpc_port" not in r.stdout


# --------------------------------------------------------------------------- values Hydra's grammar reads otherwise


def test_api_keys_as_the_readme_writes_them():
    """server.api_key=k1,k2 (the README's form) is a list of keys, not a Hydra sweep."""
    assert compose_config(["server.api_key=k1,k2"]).server.api_key == "k1,k2"
    with pytest.raises(ConfigError) as e:  # one metrics key: said as such, not as a Hydra sweep
        compose_config(["server.metrics_key=m1,m2"])
    assert e.value.key == "server.metrics_key" and "no commas" in str(e.value)
    assert compose_config(["server.api_key='k1,k2'"]).server.api_key == "k1,k2"  # quoted as before


@pytest.mark.parametrize("override, line", [
    ("engine.max_num_seqs=1,2", "engine.max_num_seqs: Hydra reads the commas in '1,2' as a sweep over several "
                                "runs; quote the value: engine.max_num_seqs='1,2'"),
    ("server.served_model_aliases=[modèle]", "server.served_model_aliases: Hydra cannot read '[modèle]' unquoted "
     "(non-ASCII letters, spaces and some symbols need quotes); write server.served_model_aliases=['modèle']"),
])  # fmt: skip
def test_unreadable_values_name_the_key_and_the_quoting(override, line):
    with pytest.raises(UsageError) as e:
        compose_config([override])
    assert str(e.value) == line
    assert compose_config(["server.served_model_aliases=['modèle']"]).server.served_model_aliases[0] == "modèle"


def test_bench_with_no_prompt_allowed_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        compose_config(["bench.max_prompt_tokens=0"], "specserve-bench")
    assert e.value.key == "bench.max_prompt_tokens"
