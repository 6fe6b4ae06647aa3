"""``specserve-bench -m``: Hydra-style multirun sweeps, run in one process.

``specserve-bench -m '+method=ngram,suffix' 'method.num_speculative_tokens=2,4,8'``

Every override is read with Hydra's own override parser, so ``a,b,c``,
``choice(a,b)`` and ``range(2,9,2)`` sweep as they do under ``hydra -m``; the
combinations are their cartesian product, the first override varying slowest
(Hydra's basic sweeper order).  All combinations are composed and validated
before anything runs; then they run one after another in this process: the
target model is loaded once per distinct model config.  Plain decoding
(``specserve_vanilla`` in ``bench.baselines``, on by default) is measured right
before every combination, on the same prompts, so each speedup divides two
runs made at the same time (a shared machine's load drifts over a sweep); its
engine is built once per distinct model/engine/bench config.  Every run shows a
progress bar on stderr, and a warning repeated by later runs is logged once.
The transformers baselines (``hf``) are not run in sweeps: use
``specserve-bench`` without -m.

Outputs go to the directory named by ``bench.output`` without its suffix
(``bench.output=docs/benchmarks/sweep.json`` -> ``docs/benchmarks/sweep/``):

* ``NN-<swept values>.json``: one report per combination (specserve-bench's layout);
* ``summary.json`` and ``summary.md``: one row per combination (method, K, mean
  acceptance length, acceptance rate, tokens per request step, tokens/s, plain
  decoding's tokens/s measured beside it, the speedup over it, greedy match with it);
* ``sweep.png``: mean acceptance length and tokens/s against the tokens verified
  per step (K + 1 for a chain, ``method.tree.num_draft_tokens`` for a tree), one line
  per method and draft shape, chain or tree (matplotlib, ``pip install 'specserve[plot]'``; skipped with a warning
  when it is missing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from specserve.config import Config

log = logging.getLogger(__name__)

PROG = "specserve-bench"


@dataclass
class Job:
    index: int
    overrides: list[str]  # the Hydra overrides of this combination, sweeps resolved
    params: dict[str, str]  # swept key (as written, e.g. "+method") -> this combination's value

    @property
    def name(self) -> str:
        parts = [f"{k.lstrip('+~').split('.')[-1]}={v}" for k, v in self.params.items()]
        return re.sub(r"[^A-Za-z0-9._=-]", "_", "-".join([f"{self.index:02d}"] + parts))


def expand(overrides: list[str]) -> list[Job]:
    """The cartesian product of the overrides' sweep values (first override slowest)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from specserve.compose import UsageError

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:  # Hydra's parser error: one line is enough
        raise UsageError(str(e).strip().splitlines()[0]) from None
    axes: list[list[tuple[str | None, str]]] = []
    for o in parsed:
        if not o.is_sweep_override():
            axes.append([(None, o.input_line)])
            continue
        key = o.get_key_element()
        try:
            values = list(o.sweep_string_iterator())
        except Exception:
            raise UsageError(f"{key}: cannot sweep {o.input_line!r} here (use a,b,c, choice() or range())") from None
        axes.append([(key, v) for v in values])
    jobs = []
    for i, combo in enumerate(itertools.product(*axes)):
        ovs, params = [], {}
        for key, v in combo:
            if key is None:
                ovs.append(v)
            else:
                ovs.append(f"{key}={v}")
                params[key] = v
        jobs.append(Job(i, ovs, params))
    return jobs


# --------------------------------------------------------------------------- running


Runner = Callable[[Config, Job], dict[str, Any]]


class StepCounter:
    """Tokens emitted per request per engine step, counting every step that emits
    (the prefill step too): comparable across proposers, unlike mean acceptance
    length, which averages over drafting rounds only."""

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0

    def on_step(self, s: Any) -> None:
        for r in s.requests:
            if r.num_new_tokens:
                self.steps += 1
                self.tokens += r.num_new_tokens

    def on_request_finished(self, s: Any) -> None:
        pass

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


def _vanilla_key(cfg: Config) -> str:
    d = dataclasses.asdict(cfg)
    d["method"] = d["draft"] = None
    d["bench"] = {k: v for k, v in d["bench"].items() if k not in ("output", "baselines")}
    d.pop("server", None)
    d.pop("generate", None)
    return json.dumps(d, sort_keys=True, default=str)


class BenchRunner:
    """Runs one combination like specserve-bench (greedy, same prompts, closed
    loop): plain decoding first, then the combination, reusing the loaded target
    and the plain-decoding engine."""

    def __init__(self) -> None:
        self._target_key: tuple | None = None
        self._target: Any = None
        self._plain_key: str | None = None
        self._plain: Any = None  # the plain-decoding LLMEngine for _plain_key

    def _load_target(self, cfg: Config) -> Any:
        from specserve.executor.loader import load_model, resolve_device

        m, e = cfg.model, cfg.engine
        key = (m.path, m.dtype, m.max_model_len, m.cache_dir, e.device, e.cpu_kernel)
        if key != self._target_key:
            self._target = self._plain = self._plain_key = None  # free the previous ones first
            self._target = load_model(m.path, m.dtype, resolve_device(e.device), m.max_model_len, m.cache_dir,
                                      cpu_kernel=e.cpu_kernel)
            self._target_key = key
        return self._target

    def _plain_engine(self, cfg: Config, target: Any, prompts: list[list[int]]) -> Any:
        """The plain-decoding engine of ``cfg``'s model/engine/bench config (built and warmed
        up once)."""
        from specserve.bench import run_engine
        from specserve.engine.engine import LLMEngine

        key = _vanilla_key(cfg)
        if key != self._plain_key:
            self._plain = None
            self._plain = LLMEngine(dataclasses.replace(cfg, method=None, draft=None), target=target)
            self._plain_key = key
            if cfg.bench.warmup:
                run_engine(self._plain, prompts[: cfg.bench.warmup], 8, 1)
        return self._plain

    def __call__(self, cfg: Config, job: Job) -> dict[str, Any]:
        import torch

        from specserve.bench import (AcceptanceCounter, RunResult, compare, greedy_match_line, near_tie_gap,
                                     run_engine, select_prompts, top2_gap)
        from specserve.engine.engine import LLMEngine
        from specserve.executor.loader import default_cache_dir

        b = cfg.bench
        if cfg.engine.num_threads is not None:
            torch.set_num_threads(cfg.engine.num_threads)
        target = self._load_target(cfg)
        cache = Path(cfg.model.cache_dir) if cfg.model.cache_dir else default_cache_dir()
        engine = LLMEngine(cfg, target=target)
        prompts = select_prompts(engine, b, cache)
        method = cfg.method.method if cfg.method else "none"
        log.info("sweep run %s: %d prompts x %d tokens, method=%s K=%d", job.name, len(prompts), b.max_tokens,
                 method, engine.num_spec_tokens)
        counter = AcceptanceCounter(max(engine.num_spec_tokens, 1))
        steps = StepCounter()
        engine.listeners.append(counter)
        if b.warmup:
            run_engine(engine, prompts[: b.warmup], 8, 1)
        counter.__init__(max(engine.num_spec_tokens, 1))
        engine.listeners.append(steps)
        runs: dict[str, RunResult] = {}
        plain = None
        if "specserve_vanilla" in b.baselines:  # right before the combination: a same-time ratio
            plain = self._plain_engine(cfg, target, prompts)
            runs["specserve_vanilla"] = run_engine(plain, prompts, b.max_tokens, b.concurrency,
                                                   desc=f"{job.name} plain decoding")
            runs["specserve_vanilla"].extra.update({"concurrency": b.concurrency, "measured_in_run": job.name})
        runs["specserve"] = run_engine(engine, prompts, b.max_tokens, b.concurrency, desc=job.name)
        runs["specserve"].extra.update(counter.summary())
        runs["specserve"].extra["tokens_per_step"] = steps.tokens_per_step
        runs["specserve"].extra["concurrency"] = b.concurrency
        report: dict[str, Any] = {
            "config": {
                "method": method, "num_speculative_tokens": engine.num_spec_tokens, "dtype": str(target.dtype).removeprefix("torch."),
                "device": str(target.device), "model": cfg.model.name, "num_prompts": len(prompts),
                "max_tokens": b.max_tokens, "concurrency": b.concurrency, "seed": b.seed,
                "threads": torch.get_num_threads(),
                "method_config": dataclasses.asdict(cfg.method) if cfg.method else None,
            },
            "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__},
            "sweep": {"run": job.name, "overrides": job.overrides, "params": job.params},
            "runs": {n: runs[n].to_json() for n in ("specserve", "specserve_vanilla") if n in runs},
            "greedy_match": {},
            "greedy_divergences": {},
            "ratios": {},
        }
        compare("specserve_vs_specserve_vanilla", runs, "specserve", "specserve_vanilla", prompts,
                lambda ids: top2_gap(plain or engine, ids), report, near_tie_gap(target.dtype))
        report["greedy_match_summary"] = greedy_match_line(report)
        if "specserve_vanilla" in runs:
            report["ratios"]["specserve_over_specserve_vanilla"] = (
                runs["specserve"].tokens_per_second / runs["specserve_vanilla"].tokens_per_second)
        return report


# --------------------------------------------------------------------------- summary


def summary_row(job: Job, report: dict[str, Any]) -> dict[str, Any]:
    spec = report["runs"]["specserve"]
    van = report["runs"].get("specserve_vanilla")
    return {
        "run": job.name,
        "params": job.params,
        "method": report["config"]["method"],
        "K": report["config"]["num_speculative_tokens"],
        # tokens verified per request and step: K + 1 for a chain, num_draft_tokens for a tree
        "verified_tokens": report["config"]["num_speculative_tokens"] + 1,
        "shape": draft_shape(report["config"].get("method_config")),
        "mean_acceptance_length": spec.get("mean_acceptance_length", 1.0),
        "acceptance_rate": spec.get("acceptance_rate", 0.0),
        "tokens_per_step": spec.get("tokens_per_step"),
        "tokens_per_second": spec["tokens_per_second"],
        "output_tokens": spec["output_tokens"],
        "vanilla_tokens_per_second": van["tokens_per_second"] if van else None,
        "speedup_vs_vanilla": spec["tokens_per_second"] / van["tokens_per_second"] if van else None,
        "greedy_match_vs_vanilla": report.get("greedy_match", {}).get("specserve_vs_specserve_vanilla"),
    }


def draft_shape(method_config: dict[str, Any] | None) -> str:
    """"chain", or "tree topk=T depth=D" for a run with ``method.tree``."""
    tree = (method_config or {}).get("tree") or {}
    if not any(tree.get(k) is not None for k in ("topk", "num_draft_tokens", "depth")):
        return "chain"
    return f"tree topk={tree.get('topk')} depth={tree.get('depth')}"


# swept keys that are the plot's x axis or its series' shape, not a series of their own
_AXIS_KEYS = ("method", "method.method", "method.num_speculative_tokens", "method.tree.num_draft_tokens",
              "method.tree.topk", "method.tree.depth")


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | method | K | mean AL | acceptance rate | tokens/step | tokens/s | plain tokens/s "
             "| x plain decoding | greedy match | drafts | verified/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['method']} | {r['K']} | {_fmt(r['mean_acceptance_length'], '.2f')} | "
            f"{_fmt(r['acceptance_rate'], '.3f')} | {_fmt(r.get('tokens_per_step'), '.2f')} | "
            f"{_fmt(r['tokens_per_second'], '.1f')} | {_fmt(r['vanilla_tokens_per_second'], '.1f')} | "
            f"{_fmt(r['speedup_vs_vanilla'], '.2f')} | {_fmt(r['greedy_match_vs_vanilla'], '.2f')} | "
            f"{r.get('shape', 'chain')} | {r.get('verified_tokens', r['K'] + 1)} |"
        )
    if any(r["vanilla_tokens_per_second"] for r in rows):
        lines.append("")
        lines.append("Plain decoding is measured right before each run, on the same prompts: each ratio divides "
                     "two runs made at the same time.")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str = "") -> bool:
    """Mean AL and tokens/s against the tokens verified per step (K + 1 for a chain,
    num_draft_tokens for a tree), one line per method and draft shape (chain, or a tree's
    topk and depth) and value of every other swept key."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("sweep: matplotlib is not installed (pip install 'specserve[plot]'); no plot written")
        return False
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:  # one line per method and value of every other swept key
        others = [f"{k.lstrip('+~').split('.')[-1]}={v}" for k, v in r["params"].items()
                  if k.lstrip("+~") not in _AXIS_KEYS]
        series.setdefault(" ".join([r["method"], r.get("shape", "chain")] + others), []).append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r["verified_tokens"])
        ks = [r["verified_tokens"] for r in rs]
        ax1.plot(ks, [r["mean_acceptance_length"] for r in rs], marker="o", label=label)
        ax2.plot(ks, [r["tokens_per_second"] for r in rs], marker="o", label=label)
    van = [r["vanilla_tokens_per_second"] for r in rows if r["vanilla_tokens_per_second"]]
    if van:
        ax2.axhline(sum(van) / len(van), color="grey", linestyle="--", label="plain decoding")
    axis = "tokens verified per step (K + 1, or a tree's num_draft_tokens)"
    ax1.set(xlabel=axis, ylabel="mean acceptance length", title="acceptance length")
    ax2.set(xlabel=axis, ylabel="output tokens/s", title="throughput")
    for ax in (ax1, ax2):
        ax.set_xticks(sorted({r["verified_tokens"] for r in rows}))
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- entry point


class SayOnce(logging.Filter):
    """A handler filter for the length of a sweep: the first of identical warnings (same
    logger, level and text) goes through, later runs' repeats are counted instead."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()
        self.repeats = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        verdict = getattr(record, "_say_once", None)
        if verdict is not None and verdict[0] is self:
            return verdict[1]  # the same record at another handler
        key = (record.name, record.levelno, record.getMessage())
        keep = key not in self.seen
        if keep:
            self.seen.add(key)
        else:
            self.repeats += 1
        record._say_once = (self, keep)
        return keep


@contextlib.contextmanager
def say_once() -> Iterator[SayOnce]:
    """Install a SayOnce filter on the root logger's handlers for the block."""
    once = SayOnce()
    handlers = list(logging.getLogger().handlers)
    for h in handlers:
        h.addFilter(once)
    try:
        yield once
    finally:
        for h in handlers:
            h.removeFilter(once)


def run_sweep(argv: list[str], runner: Runner | None = None) -> int:
    """argv: specserve-bench's arguments without -m. Returns the exit code."""
    from specserve.compose import _cap_onednn_isa, _parse_argv, compose_config

    extra_dir, name, show, help_, overrides = _parse_argv(argv)
    flags = [f"--config-dir={extra_dir}"] if extra_dir else []
    if name != "config":
        flags.append(f"--config-name={name}")
    if show:
        flags.append("--cfg")
    if help_:
        from specserve.compose import help_text

        print(help_text(PROG))
        return 0
    jobs = expand(overrides)
    cfgs = []
    for job in jobs:  # compose and validate everything before the first run
        cfg = compose_config(flags + job.overrides)
        if cfg is not None:
            cfgs.append((job, cfg))
    if not cfgs:
        return 0  # --cfg printed each combination
    out_dir = Path(cfgs[0][1].bench.output).with_suffix("")
    out_dir.mkdir(parents=True, exist_ok=True)
    _cap_onednn_isa(cfgs[0][1])
    if any("hf" in cfg.bench.baselines for _, cfg in cfgs):
        log.info("sweep: the hf baselines are not run in sweeps (run specserve-bench without -m for them)")
    runner = runner or BenchRunner()
    rows = []
    with say_once() as once:
        for job, cfg in cfgs:
            report = runner(cfg, job)
            (out_dir / f"{job.name}.json").write_text(json.dumps(report, indent=2))
            rows.append(summary_row(job, report))
            r = rows[-1]
            speed = f", {r['speedup_vs_vanilla']:.2f}x plain decoding" if r["speedup_vs_vanilla"] else ""
            print(f"[{job.index + 1}/{len(cfgs)}] {job.name}: AL {r['mean_acceptance_length']:.2f}, "
                  f"{r['tokens_per_second']:.1f} tokens/s{speed}", flush=True)
            if (r["greedy_match_vs_vanilla"] or 1.0) < 1.0 and report.get("greedy_match_summary"):
                print(f"    {report['greedy_match_summary']}", flush=True)
    if once.repeats:
        log.info("sweep: %d repeats of warnings shown above were not shown again", once.repeats)
    first = cfgs[0][1]
    info = {"argv": argv, "overrides": overrides, "runs": [j.name for j, _ in cfgs],
            "model": first.model.name, "dtype": first.model.dtype, "num_prompts": first.bench.num_prompts,
            "max_tokens": first.bench.max_tokens, "concurrency": first.bench.concurrency}
    (out_dir / "summary.json").write_text(json.dumps({"sweep": info, "rows": rows}, indent=2))
    table = summary_markdown(rows)
    (out_dir / "summary.md").write_text(table)
    title = f"{first.model.name}, {first.bench.num_prompts} prompts x {first.bench.max_tokens} tokens"
    plotted = plot(rows, out_dir / "sweep.png", title)
    print(table)
    print(f"wrote {len(rows)} runs, summary.json, summary.md{', sweep.png' if plotted else ''} to {out_dir}")
    return 0


def main(argv: list[str]) -> int:
    """specserve-bench -m ...: the same one-line errors and exit code 2 as the other entry points."""
    from specserve.compose import run_entry_point

    return run_entry_point(PROG, lambda: run_sweep(argv))
