"""Seeded sampling on the embedded model: speculative tokens against plain decoding's.

For each method (ngram, suffix, eagle3 with the shipped head, draft_model with the
model drafting for itself) and each way of running it -- every request alone at fixed
K, and all requests together in a busy batch with adaptive speculation -- the seeded
sampled outputs are compared token for token with plain decoding's outputs for the
same seeds.  On the fused CPU decoder (bf16, batch-invariant) they must be identical;
on the torch path (fp32) a request that differs is reported with the near-tie that
explains it: at the first differing position, the distance between the position's
keyed uniform and the CDF boundary that separates the two tokens, under plain
decoding's distribution there.

    python scripts/seeded_repro.py --dtype bfloat16 --out docs/benchmarks/seeded/bf16.json
    python scripts/seeded_repro.py --dtype float32 --out docs/benchmarks/seeded/fp32.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from specserve.cli import compose_config
from specserve.data import bench_prompts
from specserve.engine.engine import LLMEngine
from specserve.request import SamplingParams
from specserve.sampling.philox import SAMPLE, keyed_uniforms, seed_to_int64
from specserve.sampling.filters import SamplingTensors, logits_to_probs

METHODS = {
    "ngram": ["+method=ngram"],
    "suffix": ["+method=suffix"],
    "eagle3": ["+method=eagle3"],
    "draft_model": ["+method=draft_model", "draft=smollm2-135m"],
}


def engine(overrides: list[str], dtype: str, speculation: str, target=None) -> LLMEngine:
    cfg = compose_config([f"model.dtype={dtype}", f"engine.speculation={speculation}", "engine.num_threads=1",
                          "engine.num_prediction_tokens=0", "engine.max_num_seqs=32",
                          "method.num_speculative_tokens=4" if overrides else "engine.seed=0", *overrides])
    if dtype == "bfloat16":
        cfg.engine.cpu_kernel = "fused"
        cfg.engine.cpu_fused_max_tokens = 1 << 16  # every step on the batch-invariant decoder
    return LLMEngine(cfg, target=target)


def near_tie(eng: LLMEngine, prompt: list[int], out: list[int], m: int, params: SamplingParams) -> dict:
    """At output position m (the first difference): plain decoding's distribution there, the
    keyed uniform, and how far it lies from the CDF boundary between the two tokens."""
    seq = prompt + out[:m]
    from specserve.executor.batch import SeqInput

    runner = eng.runner
    blocks = list(range(-(-len(seq) // eng.kv.block_size)))
    fwd = runner.forward([SeqInput(seq, 0, blocks, [len(seq) - 1])])
    st = SamplingTensors.build([params.temperature], [params.top_k], [params.top_p], [params.min_p])
    p = logits_to_probs(fwd.logits.float(), st)[0].double()
    u = float(keyed_uniforms(torch.tensor([seed_to_int64(params.seed)]), torch.tensor([m]), 1, SAMPLE)[0, 0])
    cdf = p.cumsum(0)
    return {"position": m, "uniform": u, "cdf_distance": float((cdf - u).abs().min()),
            "p_top2": [float(x) for x in p.topk(2).values]}


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    base = engine([], args.dtype, "fixed")
    tok = base.tokenizer
    texts = bench_prompts(args.num_prompts, seed=0)[: args.num_prompts]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}])[:256] for t in texts]
    params = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=args.max_tokens, seed=1000 + i, ignore_eos=True)
              for i in range(len(prompts))]
    t0 = time.perf_counter()
    plain = [o.token_ids for o in base.generate(prompts, params)]
    report = {"dtype": args.dtype, "fused": base.runner.fused is not None, "num_prompts": len(prompts),
              "max_tokens": args.max_tokens, "temperature": 0.7, "top_p": 0.95, "machine": _cpu_name(),
              "plain_seconds": time.perf_counter() - t0, "runs": []}
    for name in args.methods.split(","):
        for how, speculation in (("alone, fixed K=4", "fixed"), ("busy batch, adaptive", "adaptive")):
            eng = engine(METHODS[name], args.dtype, speculation, target=base.target)
            t0 = time.perf_counter()
            if how.startswith("alone"):
                outs = [eng.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
            else:
                outs = eng.generate(prompts, params)
            same = [o.token_ids == ref for o, ref in zip(outs, plain)]
            run = {"method": name, "how": how, "identical": sum(same), "of": len(same),
                   "seconds": time.perf_counter() - t0,
                   "drafted": sum(o.spec.num_draft_tokens for o in outs),
                   "accepted": sum(o.spec.num_accepted_tokens for o in outs), "differences": []}
            for i, (o, ok) in enumerate(zip(outs, same)):
                if not ok:
                    m = next(j for j, (a, b) in enumerate(zip(o.token_ids, plain[i])) if a != b)
                    run["differences"].append({"request": i, **near_tie(base, prompts[i], plain[i], m, params[i])})
            report["runs"].append(run)
            print(f"{name:12s} {how:24s} identical {run['identical']}/{run['of']}  accepted {run['accepted']}"
                  f"/{run['drafted']}  {run['seconds']:.1f} s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
