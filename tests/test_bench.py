"""specserve-bench: a progress bar per run, and greedy-match differences explained (near-ties)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.bench import RunResult, compare, greedy_match_line, near_tie_gap, run_bench
from specserve.cli import compose_config


def _runs(**outputs: list[list[int]]) -> dict[str, RunResult]:
    return {name: RunResult(1.0, sum(map(len, outs)), 1.0, outs) for name, outs in outputs.items()}


def _report() -> dict:
    return {"config": {"dtype": "bfloat16"}, "greedy_match": {}, "greedy_divergences": {}}


def test_differences_at_near_ties_are_counted_and_said_in_one_line():
    prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]
    ours = [[10, 11, 12], [20, 21, 22], [30, 31], [40, 41, 42]]
    # transformers flips prompt 1 at position 1 and prompt 3 at position 2 (and stops there)
    hf = [[10, 11, 12], [20, 99, 98], [30, 31], [40, 41]]
    gaps = {(3, 4, 20): 0.0625, (7, 8, 40, 41): 0.03125}  # the target's top-2 gap after each common prefix
    asked: list[list[int]] = []

    def gap(ids: list[int]) -> float:
        asked.append(ids)
        return gaps[tuple(ids)]

    runs = _runs(specserve=ours, specserve_vanilla=ours, hf_generate=hf)
    report = _report()
    tie = near_tie_gap(torch.bfloat16)
    compare("specserve_vs_hf_generate", runs, "specserve", "hf_generate", prompts, gap, report, tie)
    compare("specserve_vs_specserve_vanilla", runs, "specserve", "specserve_vanilla", prompts, gap, report, tie)

    assert asked == [[3, 4, 20], [7, 8, 40, 41]]  # where each differing prompt first diverged
    assert report["greedy_match"] == {"specserve_vs_hf_generate": 0.5, "specserve_vs_specserve_vanilla": 1.0}
    assert [(d["prompt_index"], d["position"]) for d in report["greedy_divergences"]["specserve_vs_hf_generate"]] \
        == [(1, 1), (3, 2)]
    assert report["greedy_match_explained"]["specserve_vs_hf_generate"] == {
        "num_prompts": 4, "num_differ": 2, "num_near_ties": 2, "near_tie_gap": 0.5, "max_gap": 0.0625,
        "max_near_tie_gap": 0.0625}
    assert greedy_match_line(report) == (
        "greedy_match 0.5 vs hf_generate: 2 of 4 differ, all at near-ties (top-2 logit gap <= 0.062); "
        "vs specserve_vanilla 1.0 (a flip at a near-tie is bfloat16 rounding, which differs between implementations)")


def test_a_difference_that_is_no_near_tie_is_called_out():
    runs = _runs(specserve=[[1, 2], [3, 4]], hf_generate=[[1, 5], [3, 6]])
    report = _report()
    gaps = iter([0.25, 3.5])
    compare("specserve_vs_hf_generate", runs, "specserve", "hf_generate", [[0], [0]], lambda ids: next(gaps), report,
            near_tie_gap(torch.bfloat16))
    assert greedy_match_line(report).startswith(
        "greedy_match 0.0 vs hf_generate: 2 of 2 differ, 1 at near-ties (top-2 logit gap <= 0.5), "
        "1 not (largest gap 3.5): see greedy_divergences")
    assert near_tie_gap(torch.float32) == 1e-3 and near_tie_gap(torch.float16) == 0.0625


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("bench") / "llama", "llama")


def _ngram_bench(tiny, tmp_path, *extra: str):
    """(config, output path) of a small n-gram benchmark of the tiny model on three prompts."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["w1 w2 w3 w1 w2", "w5 w6 w7", "w9 w9 w9 w9"]))
    out = tmp_path / "bench.json"
    cfg = compose_config([f"model.path={tiny}", "model.name=tiny", "model.dtype=float32", "engine.num_kv_blocks=256",
                          "engine.block_size=4", "engine.num_threads=1", "+method=ngram",
                          "method.num_speculative_tokens=2", f"bench.prompts_file={prompts}", "bench.num_prompts=3",
                          "bench.max_tokens=6", "bench.chat=false", f"bench.output={out}", *extra])  # fmt: skip
    return cfg, out


def test_bench_shows_a_bar_per_run_and_writes_the_greedy_match_line(tiny, tmp_path, capsys):
    cfg, out = _ngram_bench(tiny, tmp_path)
    assert run_bench(cfg) == 0
    stdout, stderr = capsys.readouterr()
    bars = [line for line in stderr.replace("\r", "\n").splitlines() if "3/3" in line]
    for name in ("specserve", "specserve_vanilla", "hf_generate", "hf_prompt_lookup"):
        assert any(line.startswith(f"{name}: 100%") for line in bars), (name, bars)
    report = json.loads(out.read_text())
    line = report["greedy_match_summary"]
    assert line.startswith("greedy_match ") and "vs hf_generate" in line and "vs specserve_vanilla" in line
    assert line in stdout.splitlines()
    assert set(report["greedy_match_explained"]) == set(report["greedy_match"])


class _Recorder:
    """An engine stand-in for ``run_interleaved``: records which prompts it ran, in order."""

    def __init__(self, name: str, log: list):
        self.name, self.log, self.pending = name, log, []

    def add_request(self, rid, prompt, params):
        self.pending.append((rid, prompt))
        self.log.append((self.name, prompt[0]))

    def step(self):
        from types import SimpleNamespace

        done, self.pending = self.pending, []
        return [SimpleNamespace(request_id=rid, finished=True, token_ids=list(p)) for rid, p in done]


def test_interleaved_runs_take_turns_in_rotating_order():
    """Each round of ``concurrency`` prompts is run by every engine, the first of the
    round rotating, so drift in the machine's speed lands on both runs alike."""
    from specserve.bench import run_interleaved

    log: list = []
    engines = {"a": _Recorder("a", log), "b": _Recorder("b", log)}
    prompts = [[i, i] for i in range(5)]
    res = run_interleaved(engines, prompts, max_tokens=4, concurrency=2)
    assert [name for name, _ in log] == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "b"]
    assert [p for name, p in log if name == "a"] == [0, 1, 2, 3, 4] == [p for name, p in log if name == "b"]
    for name in engines:
        assert res[name].outputs == prompts and res[name].output_tokens == 10 and res[name].wall_s > 0


def test_bench_interleaves_the_method_with_plain_decoding(tiny, tmp_path):
    cfg, out = _ngram_bench(tiny, tmp_path, "bench.interleave=true", "bench.baselines=[specserve_vanilla]")
    assert run_bench(cfg) == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert runs["specserve"]["interleaved"] and runs["specserve_vanilla"]["interleaved"]
    assert runs["specserve"]["output_tokens"] == runs["specserve_vanilla"]["output_tokens"] > 0
    assert "mean_acceptance_length" in runs["specserve"] and "mean_acceptance_length" not in runs["specserve_vanilla"]
    assert report["greedy_match"]["specserve_vs_specserve_vanilla"] == 1.0
    assert "specserve_over_specserve_vanilla" in report["ratios"]


def test_bench_interleave_must_be_a_boolean(tiny):
    from specserve.compose import UsageError
    from specserve.config import validate_config
    from specserve.errors import ConfigError

    with pytest.raises(UsageError, match="bench.interleave"):  # the command line
        compose_config([f"model.path={tiny}", "bench.interleave=sometimes"])
    cfg = compose_config([f"model.path={tiny}"])
    cfg.bench.interleave = "yes"  # a config built in code
    with pytest.raises(ConfigError, match="bench.interleave"):
        validate_config(cfg)
