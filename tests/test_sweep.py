"""specserve-bench -m: sweep expansion, validation before running, per-run JSON, summary and plot (fake
runner); plain decoding measured beside every combination and warnings said once (tiny model)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from specserve import cli, sweep
from specserve.cli import UsageError
from specserve.sweep import Job, expand, run_sweep, summary_markdown


def test_expand_is_the_cartesian_product_first_override_slowest():
    jobs = expand(["+method=ngram,suffix", "method.num_speculative_tokens=2,4,8", "bench.num_prompts=2"])
    assert [j.overrides for j in jobs[:4]] == [
        ["+method=ngram", "method.num_speculative_tokens=2", "bench.num_prompts=2"],
        ["+method=ngram", "method.num_speculative_tokens=4", "bench.num_prompts=2"],
        ["+method=ngram", "method.num_speculative_tokens=8", "bench.num_prompts=2"],
        ["+method=suffix", "method.num_speculative_tokens=2", "bench.num_prompts=2"],
    ]
    assert len(jobs) == 6 and [j.index for j in jobs] == list(range(6))
    assert jobs[5].params == {"+method": "suffix", "method.num_speculative_tokens": "8"}
    assert jobs[5].name == "05-method=suffix-num_speculative_tokens=8"


def test_expand_hydra_sweep_forms_and_plain_overrides():
    jobs = expand(["method.num_speculative_tokens=range(2,7,2)", "bench.baselines=[specserve_vanilla]", "~x"])
    assert [j.params["method.num_speculative_tokens"] for j in jobs] == ["2", "4", "6"]
    assert all(j.overrides[1:] == ["bench.baselines=[specserve_vanilla]", "~x"] for j in jobs)
    assert [j.overrides for j in expand(["model.dtype=choice(float32,bfloat16)"])] == [
        ["model.dtype=float32"], ["model.dtype=bfloat16"]]
    assert [j.overrides for j in expand(["+method=ngram"])] == [["+method=ngram"]]  # no sweep: one run
    with pytest.raises(UsageError, match="cannot sweep"):
        expand(["model=glob(*)"])
    with pytest.raises(UsageError):
        expand(["bad=[unclosed"])


def _fake_report(cfg, job: Job) -> dict:
    k = cfg.method.num_speculative_tokens
    al = 1 + (0.5 if cfg.method.method == "ngram" else 0.7) * k / (1 + 0.2 * k)
    return {
        "config": {"method": cfg.method.method, "num_speculative_tokens": k},
        "runs": {"specserve": {"tokens_per_second": 10.0 * al, "output_tokens": 100, "mean_acceptance_length": al,
                               "acceptance_rate": (al - 1) / k},
                 "specserve_vanilla": {"tokens_per_second": 10.0, "output_tokens": 100}},
        "greedy_match": {"specserve_vs_specserve_vanilla": 1.0},
    }


class FakeRunner:
    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def __call__(self, cfg, job):
        self.calls.append((cfg.method.method, cfg.method.num_speculative_tokens))
        return _fake_report(cfg, job)


def test_sweep_writes_one_json_per_run_a_summary_and_a_plot(tmp_path):
    runner = FakeRunner()
    out = tmp_path / "sweeps" / "k.json"
    rc = run_sweep(["+method=ngram,suffix", "method.num_speculative_tokens=2,4,8", f"bench.output={out}"], runner)
    assert rc == 0
    assert runner.calls == [("ngram", 2), ("ngram", 4), ("ngram", 8), ("suffix", 2), ("suffix", 4), ("suffix", 8)]
    d = tmp_path / "sweeps" / "k"
    runs = sorted(p.name for p in d.glob("0*.json"))
    assert runs == [f"{i:02d}-method={m}-num_speculative_tokens={k}.json"
                    for i, (m, k) in enumerate(runner.calls)]
    summary = json.loads((d / "summary.json").read_text())
    rows = summary["rows"]
    assert [(r["method"], r["K"]) for r in rows] == runner.calls
    assert rows[0]["speedup_vs_vanilla"] == pytest.approx(rows[0]["mean_acceptance_length"])
    assert summary["sweep"]["overrides"][0] == "+method=ngram,suffix"
    md = (d / "summary.md").read_text()
    assert md.count("\n| ") == 6 and "| 05-method=suffix-num_speculative_tokens=8 | suffix | 8 |" in md
    assert "Plain decoding" in md
    png = (d / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_a_bad_combination_fails_before_anything_runs(tmp_path):
    runner = FakeRunner()
    with pytest.raises(Exception, match="num_speculative_tokens"):
        run_sweep(["+method=ngram", "method.num_speculative_tokens=4,0", f"bench.output={tmp_path}/x.json"], runner)
    assert runner.calls == []


def test_bench_main_dispatches_multirun_and_reports_errors_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "BenchRunner", FakeRunner)
    argv = ["-m", "+method=suffix", "method.num_speculative_tokens=1,3", f"bench.output={tmp_path}/s.json"]
    rc = cli.bench_main(argv)
    assert rc == 0 and (tmp_path / "s" / "summary.md").is_file()
    rc = cli.bench_main(["--multirun", "+method=suffix,nope"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("specserve-bench: error: method: unknown preset 'nope'")
    assert len(err.strip().splitlines()) == 1


def test_summary_markdown_without_a_vanilla_reference():
    row = {"run": "00-x", "params": {}, "method": "suffix", "K": 4, "mean_acceptance_length": 2.5,
           "acceptance_rate": 0.375, "tokens_per_second": 20.0, "output_tokens": 1, "vanilla_tokens_per_second": None,
           "speedup_vs_vanilla": None, "greedy_match_vs_vanilla": None}
    md = summary_markdown([row])
    assert "| 00-x | suffix | 4 | 2.50 | 0.375 | - | 20.0 | - | - | - |" in md and "Plain decoding" not in md


def test_a_warning_repeated_by_every_run_is_logged_once(tmp_path, caplog):
    class Warns(FakeRunner):
        def __call__(self, cfg, job):
            logging.getLogger("specserve.some.module").warning("the same thing, again")
            logging.getLogger("specserve.some.module").warning("run %d of the sweep", job.index)
            return super().__call__(cfg, job)

    caplog.set_level(logging.INFO)
    rc = run_sweep(["+method=ngram", "method.num_speculative_tokens=1,2,3", f"bench.output={tmp_path}/w.json"],
                   Warns())
    assert rc == 0
    said = [r.getMessage() for r in caplog.records]
    assert said.count("the same thing, again") == 1
    assert [m for m in said if m.startswith("run ")] == [f"run {i} of the sweep" for i in range(3)]
    assert "sweep: 2 repeats of warnings shown above were not shown again" in said
    # the default baselines include hf, which sweeps do not run: said once, not once per run
    assert sum("hf baselines are not run in sweeps" in m for m in said) == 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("sweep") / "llama", "llama")


def test_plain_decoding_is_measured_right_before_every_combination(tiny, tmp_path, monkeypatch, capsys):
    from specserve import bench

    calls: list[tuple[str | None, int]] = []  # (progress bar name, number of prompts) of every run_engine call
    real = bench.run_engine

    def recorded(engine, prompts, max_tokens, concurrency, desc=None):
        calls.append((desc, len(prompts)))
        return real(engine, prompts, max_tokens, concurrency, desc=desc)

    monkeypatch.setattr(bench, "run_engine", recorded)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["w1 w2 w3 w1 w2", "w5 w6 w7"]))
    out = tmp_path / "s.json"
    rc = run_sweep([f"model.path={tiny}", "model.name=tiny", "model.dtype=float32", "engine.num_kv_blocks=256",
                    "engine.block_size=4", "engine.num_threads=1", "+method=ngram",
                    "method.num_speculative_tokens=1,2", f"bench.prompts_file={prompts}", "bench.num_prompts=2",
                    "bench.max_tokens=4", "bench.chat=false", "bench.baselines=[specserve_vanilla]",
                    f"bench.output={out}"])  # fmt: skip
    assert rc == 0
    measured = [desc for desc, n in calls if desc is not None]
    assert measured == ["00-num_speculative_tokens=1 plain decoding", "00-num_speculative_tokens=1",
                        "01-num_speculative_tokens=2 plain decoding", "01-num_speculative_tokens=2"]
    assert all(n == 1 for desc, n in calls if desc is None)  # warm-ups: no bar
    for name in ("00-num_speculative_tokens=1", "01-num_speculative_tokens=2"):
        report = json.loads((tmp_path / "s" / f"{name}.json").read_text())
        plain = report["runs"]["specserve_vanilla"]
        assert plain["measured_in_run"] == name
        assert report["ratios"]["specserve_over_specserve_vanilla"] == pytest.approx(
            report["runs"]["specserve"]["tokens_per_second"] / plain["tokens_per_second"])
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "01-num_speculative_tokens=2 plain decoding: 100%" in err and "01-num_speculative_tokens=2: 100%" in err
    md = (tmp_path / "s" / "summary.md").read_text()
    assert "measured right before each run" in md


def _tree_report(cfg, job: Job) -> dict:
    report = _fake_report(cfg, job)
    tree = cfg.method.tree
    report["config"]["method_config"] = {"tree": {"topk": tree.topk, "num_draft_tokens": tree.num_draft_tokens,
                                                  "depth": tree.depth}}
    return report


def test_a_sweep_of_chains_and_trees_is_plotted_against_verified_tokens(tmp_path, monkeypatch):
    """Chains of K drafts and trees of num_draft_tokens verified tokens meet on one axis, the
    tokens verified per step: a chain of K verifies K + 1, a tree num_draft_tokens."""
    plotted = {}

    def fake_plot(rows, path, title=""):
        from collections import defaultdict

        lines = defaultdict(list)
        for r in rows:
            lines[r["shape"]].append(r["verified_tokens"])
        plotted.update(lines)
        return False

    monkeypatch.setattr(sweep, "plot", fake_plot)
    chains = run_sweep(["+method=eagle3", "draft=smollm2-135m-eagle3", "method.num_speculative_tokens=3,5",
                        f"bench.output={tmp_path}/c.json"], _tree_report)
    assert chains == 0 and plotted == {"chain": [4, 6]}
    plotted.clear()
    trees = run_sweep(["+method=eagle3", "draft=smollm2-135m-eagle3", "method.tree.topk=2",
                       "method.tree.depth=3", "method.tree.num_draft_tokens=4,6",
                       f"bench.output={tmp_path}/t.json"], _tree_report)
    assert trees == 0 and plotted == {"tree topk=2 depth=3": [4, 6]}
    md = (tmp_path / "t" / "summary.md").read_text()
    assert "| tree topk=2 depth=3 | 6 |" in md and "| tree topk=2 depth=3 | 4 |" in md
