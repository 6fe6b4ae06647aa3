"""``specserve-bench``: the configured engine against its baselines, in ONE
process, on the same ShareGPT prompts, greedy.

Runs: ``specserve`` (the configured method), ``specserve_vanilla`` (same
engine, no method), ``hf_generate`` (transformers ``generate`` on the same
weights and dtype) and ``hf_prompt_lookup`` (ngram) or ``hf_assisted``
(draft_model), each with a progress bar on stderr.  Writes JSON with tokens/s,
acceptance figures, greedy-match fractions and, for each differing prompt, where
it diverged and the target's top-2 logit gap there.  A greedy flip where that gap
is at most ``near_tie_gap`` (0.5 in bf16, 0.001 in fp32) is numerics: bf16 rounds
differently in another implementation or batch shape.  One
line (``greedy_match_summary``) says how many prompts differ and whether every
difference is such a near-tie.  Read the speed ratios, measured in the same run.
"""

from __future__ import annotations

import json
import logging
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from specserve.config import BenchConfig, Config
from specserve.errors import ConfigError
from specserve.data import bench_prompts
from specserve.engine.engine import LLMEngine
from specserve.engine.stats import RequestFinishedStats, StepStats
from specserve.executor.loader import LoadedModel, default_cache_dir, load_model, resolve_device
from specserve.executor.batch import SeqInput
from specserve.request import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    tokens_per_second: float
    output_tokens: int
    wall_s: float
    outputs: list[list[int]] = field(repr=False, default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = {"tokens_per_second": self.tokens_per_second, "output_tokens": self.output_tokens, "wall_s": self.wall_s}
        d.update(self.extra)
        return d


class AcceptanceCounter:
    """StatsListener that accumulates acceptance per draft position."""

    def __init__(self, k: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.accepted = 0
        self.per_pos_drafted = [0] * k
        self.per_pos_accepted = [0] * k

    def on_step(self, s: StepStats) -> None:
        for r in s.requests:
            if r.num_draft_tokens == 0:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += r.num_draft_tokens
            self.accepted += r.num_accepted_tokens
            for i, ok in enumerate(r.accepted_per_position):
                self.per_pos_drafted[i] += 1
                self.per_pos_accepted[i] += int(ok)

    def on_request_finished(self, s: RequestFinishedStats) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {
            "mean_acceptance_length": 1 + self.accepted / self.num_drafts if self.num_drafts else 1.0,
            "acceptance_rate": self.accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            # P(draft at position i accepted) over all draft rounds (vLLM's per_pos / drafts).
            "acceptance_rate_per_position": [a / self.num_drafts if self.num_drafts else 0.0 for a in self.per_pos_accepted],
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.accepted,
        }


def progress(desc: str | None, total: int) -> tqdm:
    """One bar on stderr per measured run (none for warm-ups: ``desc`` None)."""
    return tqdm(total=total, desc=desc, unit="prompt", file=sys.stderr, disable=desc is None, dynamic_ncols=True)


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, concurrency: int,
               desc: str | None = None) -> RunResult:
    """Closed loop: keep `concurrency` requests in flight until all prompts are done; a
    progress bar named ``desc`` counts finished prompts."""
    outputs: dict[int, list[int]] = {}
    pending = list(range(len(prompts)))
    in_flight: dict[str, int] = {}
    tag = time.monotonic_ns()
    bar = progress(desc, len(prompts))
    t0 = time.perf_counter()
    with bar:
        while pending or in_flight:
            while pending and len(in_flight) < concurrency:
                i = pending.pop(0)
                rid = f"bench-{tag}-{i}"
                engine.add_request(rid, prompts[i], SamplingParams(temperature=0.0, max_tokens=max_tokens))
                in_flight[rid] = i
            for out in engine.step():
                if out.finished:
                    outputs[in_flight.pop(out.request_id)] = out.token_ids
                    bar.update(1)
        wall = time.perf_counter() - t0
    toks = [outputs[i] for i in range(len(prompts))]
    n = sum(len(t) for t in toks)
    return RunResult(n / wall, n, wall, toks)


def run_interleaved(engines: dict[str, LLMEngine], prompts: list[list[int]], max_tokens: int, concurrency: int,
                    ) -> dict[str, RunResult]:
    """``run_engine`` for each of ``engines`` in turns: rounds of ``concurrency`` prompts, each
    round run by every engine, the order rotating from round to round, so drift in the
    machine's speed lands on every engine alike.  Each result's tokens/s is its tokens over
    the sum of its own rounds' wall times."""
    names = list(engines)
    walls = dict.fromkeys(names, 0.0)
    outs: dict[str, list[list[int]]] = {n: [] for n in names}
    rounds = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
    with progress("interleaved: " + " / ".join(names), len(prompts)) as bar:
        for r, group in enumerate(rounds):
            for n in names[r % len(names):] + names[: r % len(names)]:
                res = run_engine(engines[n], group, max_tokens, concurrency)
                walls[n] += res.wall_s
                outs[n].extend(res.outputs)
            bar.update(len(group))
    results = {}
    for n in names:
        total = sum(len(t) for t in outs[n])
        results[n] = RunResult(total / walls[n], total, walls[n], outs[n])
    return results


def run_hf(model: Any, prompts: list[list[int]], max_tokens: int, eos: tuple[int, ...], desc: str | None = None,
           **kw: Any) -> RunResult:
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    with torch.inference_mode(), progress(desc, len(prompts)) as bar:
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                eos_token_id=list(eos), pad_token_id=eos[0], **kw,
            )
            outs.append(gen[0, len(p):].tolist())
            bar.update(1)
        wall = time.perf_counter() - t0
    n = sum(len(o) for o in outs)
    return RunResult(n / wall, n, wall, outs)


def top2_gap(engine: LLMEngine, ids: list[int]) -> float:
    """Top-2 logit gap of the engine's model at the end of `ids` (fresh cache blocks)."""
    table: list[int] = []
    if not engine.blocks.ensure(table, len(ids)):
        return float("nan")
    try:
        out = engine.runner.forward([SeqInput(ids, 0, table, [len(ids) - 1])])
        top = out.logits[0].topk(2).values
        return float(top[0] - top[1])
    finally:
        engine.blocks.free(table)


def near_tie_gap(dtype: torch.dtype) -> float:
    """The top-2 logit gap at or below which a greedy flip is rounding, not a bug: 64
    units in the last place of 1.0 in ``dtype`` (bf16 0.5, fp16 0.0625), at least 0.001
    (fp32 logits still differ with the order of a sum)."""
    return max(64 * torch.finfo(dtype).eps, 1e-3)


def compare(
    name: str, runs: dict[str, RunResult], a: str, b: str, prompts: list[list[int]], gap: Callable[[list[int]], float],
    report: dict[str, Any], near_tie: float = 1e-3,
) -> None:
    """Greedy match of runs ``a`` and ``b``: the fraction of prompts with equal outputs, where
    each differing prompt first diverged, the target's top-2 logit gap there (``gap`` of the
    common prefix) and whether every divergence is a near-tie (gap <= ``near_tie``)."""
    if a not in runs or b not in runs:
        return
    same = 0
    divergences = []
    for i, (x, y) in enumerate(zip(runs[a].outputs, runs[b].outputs)):
        if x == y:
            same += 1
            continue
        pos = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        divergences.append(
            {"prompt_index": i, "position": pos, "reference_top2_logit_gap": gap(prompts[i] + y[:pos]),
             "len_a": len(x), "len_b": len(y)}
        )
    report["greedy_match"][name] = same / len(prompts)
    report["greedy_divergences"][name] = divergences
    gaps = [d["reference_top2_logit_gap"] for d in divergences]
    ties = sum(1 for g in gaps if g <= near_tie)  # a NaN gap (no cache blocks) is not a tie
    report.setdefault("greedy_match_explained", {})[name] = {
        "num_prompts": len(prompts), "num_differ": len(divergences), "num_near_ties": ties,
        "near_tie_gap": near_tie, "max_gap": max(gaps) if gaps else None,
        "max_near_tie_gap": max((g for g in gaps if g <= near_tie), default=None),
    }


def greedy_match_line(report: dict[str, Any], run: str = "specserve",
                      others: tuple[str, ...] = ("hf_generate", "hf_prompt_lookup", "hf_assisted",
                                                 "specserve_vanilla")) -> str:
    """One line on how ``run``'s greedy outputs match each other run, e.g.
    ``greedy_match 0.5 vs hf_generate: 16 of 32 differ, all at near-ties (top-2 logit gap
    <= 0.06); vs specserve_vanilla 1.0``; empty when nothing was compared."""
    parts = []
    for other in others:
        name = f"{run}_vs_{other}"
        match = report["greedy_match"].get(name)
        if match is None:
            continue
        m = round(match, 3)
        part = f"{m} vs {other}" if not parts else f"vs {other} {m}"
        ex = report.get("greedy_match_explained", {}).get(name)
        if ex and ex["num_differ"]:
            part += f": {ex['num_differ']} of {ex['num_prompts']} differ, "
            if ex["num_near_ties"] == ex["num_differ"]:
                part += f"all at near-ties (top-2 logit gap <= {ex['max_near_tie_gap']:.2g})"
            else:
                part += (f"{ex['num_near_ties']} at near-ties (top-2 logit gap <= {ex['near_tie_gap']:.2g}), "
                         f"{ex['num_differ'] - ex['num_near_ties']} not (largest gap {ex['max_gap']:.3g}): "
                         "see greedy_divergences")
        parts.append(part)
    if not parts:
        return ""
    line = "greedy_match " + "; ".join(parts)
    if any(ex["num_near_ties"] for ex in report.get("greedy_match_explained", {}).values()):
        dtype = report.get("config", {}).get("dtype", "the serving dtype")
        line += f" (a flip at a near-tie is {dtype} rounding, which differs between implementations)"
    return line


def measure_bandwidth_gbs(device: torch.device) -> dict[str, float]:
    """Streaming bandwidth over 256 MiB (beyond the caches): ``read`` (a sum, the
    access pattern of a GEMV: what the decode floor is made of) and ``copy``
    (read + write bytes).  Best of 5."""
    x = torch.ones(64 << 20, dtype=torch.float32, device=device)  # 256 MiB
    y = torch.empty_like(x)

    def best(fn) -> float:
        fn()
        t_best = float("inf")
        for _ in range(5):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_best = min(t_best, time.perf_counter() - t)
        return t_best

    nbytes = x.numel() * x.element_size()
    return {"read": nbytes / best(lambda: x.sum()) / 1e9, "copy": 2 * nbytes / best(lambda: y.copy_(x)) / 1e9}


def _weight_bytes(m: LoadedModel) -> int:
    """Bytes one decode step must stream: every projection, the norms and the LM
    head once (the embedding table is only gathered, except when tied to the head)."""
    from specserve.executor.models.llama import PackedLinear

    total = 0
    for name, mod in m.model.named_modules():
        if isinstance(mod, PackedLinear):
            total += mod.weight_bytes
        elif name != "embed_tokens" or (m.arch.tie_word_embeddings and not isinstance(m.model.lm_head, PackedLinear)):
            total += sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
    return total


def profile_steps(engine: LLMEngine, prompt: list[int], steps: int = 8) -> dict[str, Any]:
    """Time single-request steps after the prefill: wall time per step and, on CUDA, the
    device time and kernel launches per step (torch.profiler), so host overhead = wall -
    device.  With a method the steps verify drafts (when the proposer has any)."""
    k = engine.num_spec_tokens
    rid = f"profile-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=(steps + 4) * (k + 1) + 8, ignore_eos=True))
    drafted: list[int] = []

    class _Drafts:
        def on_step(self, s: StepStats) -> None:
            drafted.extend(r.num_draft_tokens for r in s.requests)

        def on_request_finished(self, s: RequestFinishedStats) -> None:
            pass

    listener = _Drafts()
    try:
        while rid in engine.requests and not engine.requests[rid].seq.output_token_ids:
            engine.step()  # prefill
        for _ in range(2):
            engine.step()  # warm up (graph replays, allocator)
        engine.listeners.append(listener)
        cuda = engine.target.device.type == "cuda"
        prof = None
        if cuda:
            torch.cuda.synchronize()
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            )
            prof.__enter__()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
        out: dict[str, Any] = {
            "steps": steps, "wall_ms_per_step": wall * 1e3,
            "mean_drafts_per_step": sum(drafted) / max(len(drafted), 1),
        }
        if prof is not None:
            prof.__exit__(None, None, None)
            kernels = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
            device_us = sum(e.time_range.elapsed_us() for e in kernels)
            launches = sum(1 for e in prof.events() if e.name in ("cudaLaunchKernel", "cudaGraphLaunch",
                                                                  "cuLaunchKernel", "cuLaunchKernelEx"))
            graph = sum(1 for e in prof.events() if e.name == "cudaGraphLaunch")
            out.update({
                "device_ms_per_step": device_us / 1e3 / steps,
                "host_ms_per_step": max(wall * 1e3 - device_us / 1e3 / steps, 0.0),
                "kernels_per_step": len(kernels) / steps,
                "host_launch_calls_per_step": launches / steps,
                "graph_launches_per_step": graph / steps,
            })
            static = engine.runner.static
            if static is not None and static.graphs:
                out["graph_replay_ms"] = {f"b{b}_q{q}": t * 1e3 for (b, q), t in static.time_graphs(3).items()
                                          if b == 1}
        return out
    finally:
        if listener in engine.listeners:
            engine.listeners.remove(listener)
        engine.abort_request(rid)


def load_prompts_file(path: str) -> list[str]:
    """A JSON list of strings, or JSONL with a "prompt" field per line."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, list):
        if not all(isinstance(x, str) for x in data):
            raise ConfigError("bench.prompts_file", "a JSON list must hold strings only")
        return data
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ConfigError("bench.prompts_file", f"line {n}: not JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ConfigError("bench.prompts_file", f'line {n}: expected an object with a "prompt" string')
        out.append(obj["prompt"])
    if not out:
        raise ConfigError("bench.prompts_file", "holds no prompts")
    return out


def select_prompts(engine: LLMEngine, b: BenchConfig, cache: Path | None) -> list[list[int]]:
    """The benchmark's prompts (seeded ShareGPT first turns, or bench.prompts_file),
    chat-templated unless bench.chat is false, that fit."""
    prompts: list[list[int]] = []
    texts = load_prompts_file(b.prompts_file) if b.prompts_file else bench_prompts(b.num_prompts, b.seed, cache)
    for t in texts:
        tok = engine.tokenizer
        ids = tok.apply_chat_template([{"role": "user", "content": t}]) if b.chat else tok.encode(t)
        if len(ids) <= b.max_prompt_tokens and len(ids) + b.max_tokens < engine.max_model_len:
            prompts.append(ids)
        if len(prompts) == b.num_prompts:
            break
    if not prompts:  # a benchmark of nothing would report nothing and pass
        raise ConfigError("bench.max_prompt_tokens", f"no prompt fits: each must be <= {b.max_prompt_tokens} tokens "
                          f"and leave room for bench.max_tokens ({b.max_tokens}) within max_model_len "
                          f"({engine.max_model_len})")  # fmt: skip
    return prompts


def run_bench(cfg: Config) -> int:
    b = cfg.bench
    if b.dataset == "audio":  # speech models: WER and RTFx (specserve.bench_audio)
        from specserve.bench_audio import run_audio_bench

        return run_audio_bench(cfg)
    device = resolve_device(cfg.engine.device)
    if cfg.engine.num_threads is not None:
        torch.set_num_threads(cfg.engine.num_threads)
    m = cfg.model
    target = load_model(m.path, m.dtype, device, m.max_model_len, m.cache_dir, cpu_kernel=cfg.engine.cpu_kernel)
    cache = Path(m.cache_dir) if m.cache_dir else default_cache_dir()
    engine = LLMEngine(cfg, target=target)
    prompts = select_prompts(engine, b, cache)
    method = cfg.method.method if cfg.method else "none"
    k = engine.num_spec_tokens
    log.info("bench: %d prompts, max_tokens=%d, concurrency=%d, method=%s K=%d dtype=%s", len(prompts), b.max_tokens,
             b.concurrency, method, k, target.dtype)
    runs: dict[str, RunResult] = {}
    warm = prompts[: b.warmup]

    counter = AcceptanceCounter(max(k, 1))
    engine.listeners.append(counter)
    if warm:
        run_engine(engine, warm, 8, 1)
    counter.__init__(max(k, 1))

    def plain_engine() -> LLMEngine:  # the same engine without the method, warmed up
        plain = LLMEngine(Config(**{**cfg.__dict__, "method": None}), target=target) if cfg.method is not None else engine
        if warm:
            run_engine(plain, warm, 8, 1)
        return plain

    vanilla = None
    if b.interleave and "specserve_vanilla" in b.baselines and cfg.method is not None:
        vanilla = plain_engine()  # the method and plain decoding in turns (bench.interleave)
        runs.update(run_interleaved({"specserve": engine, "specserve_vanilla": vanilla}, prompts, b.max_tokens,
                                    b.concurrency))
        runs["specserve"].extra["interleaved"] = runs["specserve_vanilla"].extra["interleaved"] = True
    else:
        runs["specserve"] = run_engine(engine, prompts, b.max_tokens, b.concurrency, desc="specserve")
        if "specserve_vanilla" in b.baselines:
            vanilla = plain_engine()
            runs["specserve_vanilla"] = run_engine(vanilla, prompts, b.max_tokens, b.concurrency,
                                                   desc="specserve_vanilla")
    runs["specserve"].extra.update(counter.summary())
    runs["specserve"].extra["concurrency"] = b.concurrency
    if vanilla is not None:
        runs["specserve_vanilla"].extra["concurrency"] = b.concurrency
        if b.concurrency > 1:
            runs["specserve_vanilla_concurrency1"] = run_engine(vanilla, prompts, b.max_tokens, 1,
                                                                desc="specserve_vanilla_concurrency1")

    if "hf" in b.baselines:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(target.hf_dir), dtype=target.dtype, local_files_only=True)
        hf = hf.to(device).eval()
        eos = target.eos_token_ids
        if warm:
            run_hf(hf, warm, 8, eos)
        runs["hf_generate"] = run_hf(hf, prompts, b.max_tokens, eos, desc="hf_generate")
        if method == "ngram":
            kw = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": cfg.method.prompt_lookup_max}
            runs["hf_prompt_lookup"] = run_hf(hf, prompts, b.max_tokens, eos, desc="hf_prompt_lookup", **kw)
        elif method == "draft_model":
            dpath = cfg.method.model or cfg.draft.path
            dm = load_model(dpath, str(target.dtype).removeprefix("torch."), device, None,
                            cfg.draft.cache_dir if cfg.draft else None)
            assistant = AutoModelForCausalLM.from_pretrained(str(dm.hf_dir), dtype=target.dtype, local_files_only=True)
            assistant = assistant.to(device).eval()
            assistant.generation_config.num_assistant_tokens = k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = 0.0
            runs["hf_assisted"] = run_hf(hf, prompts, b.max_tokens, eos, desc="hf_assisted",
                                         assistant_model=assistant)

    report: dict[str, Any] = {
        "config": {
            "method": method, "num_speculative_tokens": k, "dtype": str(target.dtype).removeprefix("torch."),
            "device": str(device), "model": cfg.model.name, "num_prompts": len(prompts), "max_tokens": b.max_tokens,
            "concurrency": b.concurrency, "seed": b.seed, "threads": torch.get_num_threads(),
            "method_config": asdict(cfg.method) if cfg.method else None,
        },
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__},
        "runs": {n: r.to_json() for n, r in runs.items()},
        "greedy_match": {},
        "greedy_divergences": {},
    }
    gap_engine = vanilla or engine
    gap = lambda ids: top2_gap(gap_engine, ids)  # noqa: E731
    tie = near_tie_gap(target.dtype)
    compare("specserve_vs_specserve_vanilla", runs, "specserve", "specserve_vanilla", prompts, gap, report, tie)
    compare("specserve_vs_hf_generate", runs, "specserve", "hf_generate", prompts, gap, report, tie)
    compare("specserve_vanilla_vs_hf_generate", runs, "specserve_vanilla", "hf_generate", prompts, gap, report, tie)
    report["greedy_match_summary"] = greedy_match_line(report)
    ratios = {}
    for a_, b_ in [("specserve", "specserve_vanilla"), ("specserve", "hf_generate"), ("specserve_vanilla", "hf_generate"),
                   ("specserve", "hf_prompt_lookup"), ("specserve", "hf_assisted"),
                   ("specserve_vanilla", "specserve_vanilla_concurrency1")]:
        if a_ in runs and b_ in runs:
            ratios[f"{a_}_over_{b_}"] = runs[a_].tokens_per_second / runs[b_].tokens_per_second
    report["ratios"] = ratios
    if b.profile_steps == "on" or (b.profile_steps == "auto" and device.type == "cuda"):
        report["step_profile"] = {"decode": profile_steps(vanilla or engine, prompts[0])}
        if cfg.method is not None:
            report["step_profile"]["verification"] = profile_steps(engine, prompts[0])
    bw = measure_bandwidth_gbs(device)
    wb = _weight_bytes(target)
    floor_ms = wb / (bw["read"] * 1e9) * 1e3
    report["memory_bandwidth_floor"] = {
        "measured_bandwidth_gbs": bw["read"], "measured_copy_bandwidth_gbs": bw["copy"], "weight_bytes": wb,
        "floor_ms_per_token_batch1": floor_ms,
    }
    c1 = runs.get("specserve_vanilla_concurrency1") or (runs.get("specserve_vanilla") if b.concurrency == 1 else None)
    if c1 is not None:
        report["memory_bandwidth_floor"]["vanilla_c1_ms_per_token"] = 1e3 / c1.tokens_per_second
        report["memory_bandwidth_floor"]["vanilla_c1_over_floor"] = (1e3 / c1.tokens_per_second) / floor_ms
    out = Path(b.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({"runs": report["runs"], "ratios": ratios, "greedy_match": report["greedy_match"],
                      "memory_bandwidth_floor": report["memory_bandwidth_floor"]}, indent=2))
    if report["greedy_match_summary"]:
        print(report["greedy_match_summary"])
    print(f"wrote {out}")
    return 0
