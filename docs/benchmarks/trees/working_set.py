"""What a draft head's weights cost plain decoding on a host whose last-level cache about
holds the target: two plain-decoding engines on one target run the same prompts in turns
(``specserve.bench.run_interleaved``); after every step one of them also reads a buffer of
EXTRA_MB megabytes (the size of the shipped EAGLE-3 head's weights), as a head would.
Writes both engines' tokens/s and ms per token, and what reading the buffer alone takes
when it is hot.

    python docs/benchmarks/trees/working_set.py [EXTRA_MB] [NUM_PROMPTS] [OUT.json]

The embedded SmolLM2-135M-Instruct in bf16 on the fused CPU decoder (269 MB of weights read
per step), ``specserve-bench``'s prompt selection, 128 tokens, greedy, two torch threads."""

from __future__ import annotations

import json
import sys
import time

import torch

import specserve.bench as B
from specserve.compose import compose_config
from specserve.engine.engine import LLMEngine
from specserve.executor.loader import load_model


def main() -> None:
    extra_mb = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    out = sys.argv[3] if len(sys.argv) > 3 else "working-set.json"
    torch.set_num_threads(2)
    cfg = compose_config(["model.dtype=bfloat16", f"bench.num_prompts={n}", "bench.max_tokens=128"])
    m = cfg.model
    target = load_model(m.path, m.dtype, torch.device("cpu"), m.max_model_len, m.cache_dir,
                        cpu_kernel=cfg.engine.cpu_kernel)
    plain, extra = LLMEngine(cfg, target=target), LLMEngine(cfg, target=target)
    prompts = B.select_prompts(plain, cfg.bench, None)
    buf = torch.ones(int(extra_mb * 2**20 / 2), dtype=torch.bfloat16)
    step = extra.step

    def step_and_read():
        outputs = step()
        buf.sum()  # the head's weights, read once per step
        return outputs

    extra.step = step_and_read
    for e in (plain, extra):
        B.run_engine(e, prompts[:2], 8, 1)
    res = B.run_interleaved({"plain": plain, "plain + extra read": extra}, prompts, 128, 1)
    t0 = time.perf_counter()
    for _ in range(50):
        buf.sum()
    hot_ms = (time.perf_counter() - t0) / 50 * 1e3
    report = {"extra_mb": extra_mb, "num_prompts": len(prompts), "hot_read_ms": hot_ms, "runs": {
        name: {"tokens_per_second": r.tokens_per_second, "ms_per_token": 1e3 / r.tokens_per_second}
        for name, r in res.items()}}
    report["extra_ms_per_token"] = (report["runs"]["plain + extra read"]["ms_per_token"]
                                    - report["runs"]["plain"]["ms_per_token"])
    print(json.dumps(report, indent=1))
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
