"""vLLM's everyday flags and offline options, as a vLLM user types them:

* each ``vllm serve`` flag maps to its key, is accepted with one note, or fails in one line
  naming what is supported (the table of ``specserve.vllm_flags``; ``--dry-run`` composes);
* ``--generation-config``: the model's generation_config.json gives the defaults of what a
  request leaves out (``LLM.generate`` without SamplingParams too); ``vllm`` turns that off;
* ``--tokenizer`` loads another directory's tokenizer;
* offline ``SamplingParams(n=..., best_of=...)`` as vLLM's ``LLM.generate`` has them: choice i
  of a seeded request is the single request with seed + i; best_of keeps the n most likely.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import yaml

from specserve import LLM, SamplingParams
from specserve.cli import serve_main
from specserve.compat import UnsupportedArgumentError
from specserve.errors import ConfigError
from specserve.serve_compat import translate
from specserve.vllm_flags import FLAGS, VLLM_SWITCHES, VLLM_VALUED

pytestmark = pytest.mark.timeout(120)

SMALL = dict(dtype="float32", num_kv_blocks=128, block_size=4)


@pytest.mark.parametrize("argv, overrides", [
    (["--enable-prefix-caching"], ["engine.enable_prefix_caching=true"]),
    (["--enable-prefix-caching", "false"], ["engine.enable_prefix_caching=false"]),
    (["--enable-prefix-caching=False"], ["engine.enable_prefix_caching=false"]),
    (["--no-enable-prefix-caching"], ["engine.enable_prefix_caching=false"]),
    (["--tokenizer", "/t/tok"], ["model.tokenizer=/t/tok"]),
    (["--max-logprobs", "5"], ["server.max_logprobs=5"]),
    (["--max_logprobs=0"], ["server.max_logprobs=0"]),
    (["--uvicorn-log-level", "warning"], ["server.log_level=WARNING"]),
    (["--uvicorn-log-level", "trace"], ["server.log_level=DEBUG"]),
    (["--generation-config", "vllm"], ["model.generation_config=vllm"]),
    (["--generation-config", "/g/dir"], ["model.generation_config=/g/dir"]),
    (["--disable-log-stats"], ["server.log_stats_interval_s=0"]),
    (["--disable-log-requests"], ["server.log_requests=false"]),
    (["--disable-uvicorn-access-log"], ["server.log_requests=false"]),
    (["--enable-log-requests"], ["server.log_requests=true"]),
    (["--kv-cache-dtype", "auto"], []),
    (["--quantization", "None"], []),
])  # fmt: skip
def test_everyday_flags_map_to_their_keys(argv, overrides):
    got, notes, _ = translate(["/m/x", *argv])
    assert got == ["model.path=/m/x", "model.name=/m/x", *overrides] and notes == []


@pytest.mark.parametrize("argv, note", [
    (["--enable-chunked-prefill"], "--enable-chunked-prefill is accepted for vLLM compatibility and has no effect: "
                                   "long prompts are always prefilled in chunks"),
    (["--enable-chunked-prefill", "true"], "--enable-chunked-prefill is accepted"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is accepted"),
    (["--swap-space", "4"], "--swap-space is accepted for vLLM compatibility and has no effect: specserve keeps no CPU"),
])  # fmt: skip
def test_flags_that_change_nothing_say_so_in_one_note(argv, note):
    got, notes, _ = translate(["/m/x", *argv])
    assert got == ["model.path=/m/x", "model.name=/m/x"] and len(notes) == 1 and notes[0].startswith(note)


@pytest.mark.parametrize("argv, message", [
    (["--quantization", "awq"], "quantization: --quantization awq: not supported; specserve serves unquantized "
                                "weights in float32, bfloat16 or float16 (--dtype)"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype: --kv-cache-dtype fp8: only auto is supported"),
    (["--max-logprobs", "50"], "max_logprobs: --max-logprobs must be in [0, 20]"),
    (["--uvicorn-log-level", "loud"], "uvicorn_log_level: --uvicorn-log-level must be one of critical, error"),
    (["--enable-prefix-caching", "--x"], "unknown option '--x'"),
    (["--disable-log-stats=1"], "disable_log_stats: --disable-log-stats takes no value"),
    (["--swap-space", "lots"], "swap_space: --swap-space takes a size in GiB"),
    (["--tokenizer"], "--tokenizer needs a value"),
    (["--revision", "v1"], "--revision pins a Hugging Face id given as MODEL"),
])  # fmt: skip
def test_flags_specserve_cannot_honour_fail_in_one_line(argv, message):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = serve_main(["serve", "/m/x", *argv, "--dry-run"])
    line = err.getvalue().strip()
    assert rc == 2 and "\n" not in line and line.startswith("specserve serve: error: ") and message in line, line


def test_every_flag_is_in_help_and_in_the_docs():
    from pathlib import Path

    from specserve.serve_compat import USAGE

    docs = (Path(__file__).resolve().parents[1] / "docs" / "vllm-compat.md").read_text()
    assert set(FLAGS) == set(VLLM_SWITCHES) | set(VLLM_VALUED)
    for flag in FLAGS:
        assert f"--{flag} " in USAGE and f"`--{flag}" in docs, flag


def test_dry_run_composes_the_everyday_flags(tiny_llama):
    out, err = io.StringIO(), io.StringIO()
    argv = ["serve", str(tiny_llama), "--enable-prefix-caching", "--enable-chunked-prefill", "--swap-space", "4",
            "--tokenizer", str(tiny_llama), "--max-logprobs", "7", "--uvicorn-log-level", "debug",
            "--generation-config", "vllm", "--disable-log-stats", "--disable-log-requests", "--kv-cache-dtype", "auto",
            "--dry-run"]  # fmt: skip
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert serve_main(argv) == 0, err.getvalue()
    cfg = yaml.safe_load("\n".join(out.getvalue().splitlines()[3:]))
    assert cfg["model"]["tokenizer"] == str(tiny_llama) and cfg["model"]["generation_config"] == "vllm"
    assert cfg["engine"]["enable_prefix_caching"] is True
    assert (cfg["server"]["max_logprobs"], cfg["server"]["log_level"], cfg["server"]["log_stats_interval_s"],
            cfg["server"]["log_requests"]) == (7, "DEBUG", 0.0, False)  # fmt: skip
    assert err.getvalue().count("note:") == 2  # chunked prefill and swap space: accepted, no effect


# --------------------------------------------------------------------------- generation config


@pytest.fixture(scope="module")
def with_generation_config(tmp_path_factory, tiny_llama):
    d = tmp_path_factory.mktemp("gc") / "model"
    shutil.copytree(tiny_llama, d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update({"temperature": 0.0, "top_p": 0.9, "top_k": 5, "max_new_tokens": 5, "do_sample": False})
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def test_generation_config_gives_the_defaults_of_llm_generate(with_generation_config, tiny_llama):
    llm = LLM(model=str(with_generation_config), **SMALL)
    assert llm.info.sampling_defaults == {"temperature": 0.0, "top_p": 0.9, "top_k": 5, "max_tokens": 5}
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.max_tokens) == (0.0, 0.9, 5, 5)
    out = llm.generate(["w3 w4 w5"], use_tqdm=False)[0].outputs[0]
    greedy = llm.generate(["w3 w4 w5"], SamplingParams(temperature=0, top_p=0.9, top_k=5, max_tokens=5),
                          use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert len(out.token_ids) == 5 and out.token_ids == greedy.token_ids
    plain = LLM(model=str(with_generation_config), hydra_overrides=["model.generation_config=vllm"], **SMALL)
    assert plain.info.sampling_defaults == {} and plain.get_default_sampling_params().max_tokens == 16
    from_dir = LLM(model=str(tiny_llama), hydra_overrides=[f"model.generation_config={with_generation_config}"],
                   **SMALL)  # fmt: skip
    assert from_dir.info.sampling_defaults["max_tokens"] == 5


def test_a_generation_config_directory_without_the_file_is_one_line(tmp_path):
    from specserve.compose import compose_config

    with pytest.raises(ConfigError) as e:
        compose_config([f"model.generation_config={tmp_path}"])
    assert str(e.value).startswith("model.generation_config: must be \"auto\", \"vllm\" or a directory holding")


def test_tokenizer_comes_from_its_own_directory(tiny_llama, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    for f in tiny_llama.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tok / f.name)
    llm = LLM(model=str(tiny_llama), hydra_overrides=[f"model.tokenizer={tok}"], **SMALL)
    assert llm.get_tokenizer().name_or_path == str(tok)
    with pytest.raises(Exception) as e:
        LLM(model=str(tiny_llama), hydra_overrides=[f"model.tokenizer={tmp_path / 'absent'}"], **SMALL)
    assert "model path not found" in str(e.value)


# --------------------------------------------------------------------------- n and best_of


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), **SMALL)


def test_n_returns_n_completions_each_the_single_request_with_its_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6)
    out = llm.generate(["w3 w4 w5", "w9"], params, use_tqdm=False)
    assert [len(o.outputs) for o in out] == [3, 3]
    for o, prompt in zip(out, ["w3 w4 w5", "w9"]):
        assert [c.index for c in o.outputs] == [0, 1, 2]
        singles = [llm.generate([prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6),
                                use_tqdm=False)[0].outputs[0].token_ids for i in range(3)]  # fmt: skip
        assert [c.token_ids for c in o.outputs] == singles
        assert o.finished and o.num_drafts == 0


def test_best_of_keeps_the_n_most_likely(llm):
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=3, max_tokens=6)
    out = llm.generate(["w3 w4 w5"], params, use_tqdm=False)[0]
    candidates = [llm.generate(["w3 w4 w5"], SamplingParams(temperature=1.0, seed=3 + i, max_tokens=6, logprobs=0),
                               use_tqdm=False)[0].outputs[0] for i in range(4)]  # fmt: skip
    best = sorted(candidates, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in out.outputs)  # not asked for


@pytest.mark.parametrize("kw, key", [({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": True}, "n"),
                                     ({"n": 3, "best_of": 2}, "best_of")])  # fmt: skip
def test_bad_n_and_best_of_are_one_line(kw, key):
    with pytest.raises(UnsupportedArgumentError) as e:
        SamplingParams(**kw)
    assert e.value.key == key and "\n" not in str(e.value)
