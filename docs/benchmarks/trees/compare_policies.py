"""Speculation policies side by side on one target: plain decoding and several eagle3
engines (adaptive, with and without the derived draft confidence cut, fixed K) run the same prompts in
turns, a prompt each, the order rotating (``specserve.bench.run_interleaved``), so a shared
host's drifting speed lands on all of them alike.  Writes each one's tokens/s, its ratio to
plain decoding and its greedy match.

    python docs/benchmarks/trees/compare_policies.py [NUM_PROMPTS] [OUT.json]

The embedded SmolLM2-135M-Instruct in bf16 on the fused CPU decoder, its shipped EAGLE-3
head, ``specserve-bench``'s prompt selection (ShareGPT first turns, seed 0), 128 tokens,
greedy, concurrency 1, two torch threads."""

from __future__ import annotations

import json
import sys

import torch

import specserve.bench as B
from specserve.compose import compose_config
from specserve.config import Config
from specserve.engine.engine import LLMEngine
from specserve.executor.loader import load_model

BASE = ["+method=eagle3", "draft=smollm2-135m-eagle3", "model.dtype=bfloat16", "bench.max_tokens=128"]
POLICIES = {
    "adaptive (default)": [],
    "adaptive, derived cut": ["engine.draft_confidence_threshold=auto"],
    "fixed K=2": ["engine.speculation=fixed", "method.num_speculative_tokens=2"],
    "fixed K=3, cut 0.2": ["engine.speculation=fixed", "method.num_speculative_tokens=3",
                           "engine.draft_confidence_threshold=0.2"],
}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    out = sys.argv[2] if len(sys.argv) > 2 else "compare-policies.json"
    torch.set_num_threads(2)
    base = BASE + [f"bench.num_prompts={n}"]
    cfg = compose_config(base)
    m = cfg.model
    target = load_model(m.path, m.dtype, torch.device("cpu"), m.max_model_len, m.cache_dir,
                        cpu_kernel=cfg.engine.cpu_kernel)
    engines = {"plain": LLMEngine(Config(**{**cfg.__dict__, "method": None}), target=target)}
    for name, extra in POLICIES.items():
        engines[name] = LLMEngine(compose_config(base + extra), target=target)
    prompts = B.select_prompts(engines["plain"], cfg.bench, None)
    for e in engines.values():  # warm-up, as specserve-bench does
        B.run_engine(e, prompts[:2], 8, 1)
    res = B.run_interleaved(engines, prompts, 128, 1)
    ref = res["plain"]
    report = {"config": {"overrides": base, "policies": POLICIES, "num_prompts": len(prompts), "concurrency": 1,
                         "threads": 2, "interleaved": True}, "runs": {}}
    for name, r in res.items():
        match = sum(a == b for a, b in zip(r.outputs, ref.outputs)) / len(prompts)
        report["runs"][name] = {"tokens_per_second": r.tokens_per_second, "output_tokens": r.output_tokens,
                                "wall_s": r.wall_s, "ratio_to_plain": r.tokens_per_second / ref.tokens_per_second,
                                "greedy_match": match}
        print(f"{name:28s} {r.tokens_per_second:6.1f} tokens/s  x{r.tokens_per_second / ref.tokens_per_second:.3f}"
              f"  greedy match {match:.2f}")
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
