"""Automatic prefix caching benchmark (issue #13): 32 requests sharing a ~400-token system
prompt, all arriving at once, with engine.enable_prefix_caching off and on, in one process
(the target is loaded once).  Reports TTFT p50/p90, output tokens/s, wall time, prefix-cache
hit tokens, and whether the greedy outputs are identical.

    .venv/bin/python scripts/bench_prefix_cache.py --output docs/benchmarks/prefix-cache-fp32.json
    .venv/bin/python scripts/bench_prefix_cache.py --override +method=ngram   # any Hydra override
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from specserve.cli import compose_config
from specserve.engine.engine import LLMEngine
from specserve.request import SamplingParams

SYSTEM = (
    "You are a careful assistant for a small bookshop. The shop opens at nine and closes at six, "
    "sells new and second-hand books, orders any title in print within three days, and buys back "
    "books in good condition for store credit. Staff recommend books by asking what the reader "
    "enjoyed recently. Answer briefly, politely and only about the shop. "
)
QUESTIONS = [
    "When do you open?", "Do you sell used books?", "Can you order a book for me?", "Do you buy books?",
    "What do you recommend?", "Are you open on Sunday?", "How long does an order take?", "Do you sell maps?",
    "Can I pay by card?", "Do you have a children's section?", "Can I reserve a book?", "Do you ship abroad?",
    "Is there parking?", "Do you host readings?", "Can I return a gift?", "Do you sell e-books?",
    "What is store credit?", "Do you buy textbooks?", "How do I get a recommendation?", "Are staff friendly?",
    "Do you sell comics?", "Can I sell a damaged book?", "When do you close?", "Do you have poetry?",
    "Is there a loyalty card?", "Can I order a rare book?", "Do you wrap gifts?", "Do you sell magazines?",
    "Do you have a cafe?", "Can I browse without buying?", "Do you sell audiobooks?", "Who owns the shop?",
]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts]
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    first: dict[str, float] = {}
    outs: dict[str, list[int]] = {}
    q0, h0 = engine.blocks.num_queried_tokens, engine.blocks.num_hit_tokens
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            if o.finished:
                outs[o.request_id] = list(o.token_ids)
    wall = time.perf_counter() - t0
    ttft = sorted(first.values())
    gen = sum(len(v) for v in outs.values())
    return {
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
        "ttft_mean_s": statistics.fmean(ttft),
        "wall_s": wall,
        "output_tokens_per_s": gen / wall,
        "requests_per_s": len(prompts) / wall,
        "generated_tokens": gen,
        "prefix_cache_queried_tokens": engine.blocks.num_queried_tokens - q0,
        "prefix_cache_hit_tokens": engine.blocks.num_hit_tokens - h0,
        "outputs": [outs[f"r{i}"] for i in range(len(prompts))],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default="results/prefix-cache.json")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--override", action="append", default=[], help="Hydra override (repeatable)")
    args = ap.parse_args()
    cfg = compose_config(["model.dtype=float32", *args.override])
    cfg.engine.enable_prefix_caching = False
    off = LLMEngine(cfg)
    tok = off.tokenizer
    system = tok.encode(SYSTEM)
    while len(system) < args.system_tokens:
        system = system + tok.encode(SYSTEM)[1 if tok.encode(SYSTEM)[0] in (tok.hf.bos_token_id,) else 0:]
    system = system[: args.system_tokens]
    prompts = [system + tok.hf(q, add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    # warm-up (allocator, kernels) on a short prompt, not counted
    off.generate([prompts[0][:16]], [SamplingParams(temperature=0.0, max_tokens=2)])
    r_off = run(off, prompts, args.max_tokens)
    target = off.target
    del off
    cfg.engine.enable_prefix_caching = True
    on = LLMEngine(cfg, target=target)
    on.generate([prompts[0][:16]], [SamplingParams(temperature=0.0, max_tokens=2)])
    on.blocks.num_queried_tokens = on.blocks.num_hit_tokens = 0
    r_on = run(on, prompts, args.max_tokens)
    same = r_off.pop("outputs") == r_on.pop("outputs")
    report = {
        "workload": {"requests": len(prompts), "system_prompt_tokens": len(system),
                     "prompt_tokens_each": [len(p) for p in prompts][:3] + ["..."],
                     "max_tokens": args.max_tokens, "arrival": "all at once", "greedy": True},
        "model": cfg.model.name, "dtype": str(target.dtype), "device": str(target.device),
        "method": cfg.method.method if cfg.method is not None else "none",
        "block_size": cfg.engine.block_size, "max_num_batched_tokens": cfg.engine.max_num_batched_tokens,
        "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "caching_off": r_off, "caching_on": r_on,
        "ttft_p50_speedup": r_off["ttft_p50_s"] / r_on["ttft_p50_s"],
        "throughput_speedup": r_on["output_tokens_per_s"] / r_off["output_tokens_per_s"],
        "greedy_outputs_identical": same,
    }  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    import pathlib

    pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
