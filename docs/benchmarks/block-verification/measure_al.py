"""Mean acceptance length of strict, probabilistic and block verification at temperature 1.

``specserve-bench`` decodes greedily; this measures sampled decoding the same way (its prompt
selection and acceptance counter) with one seed per prompt, the same for every method, and
writes one JSON per method next to this file.  Acceptance does not depend on timing: no
tokens/s are reported.

    python docs/benchmarks/block-verification/measure_al.py [extra Hydra overrides]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from specserve.bench import AcceptanceCounter, select_prompts
from specserve.compose import compose_config
from specserve.engine.engine import LLMEngine
from specserve.executor.loader import default_cache_dir
from specserve.request import SamplingParams

OUT = Path(__file__).parent
BASE = ["+method=eagle3", "draft=smollm2-135m-eagle3", "model.dtype=bfloat16", "engine.speculation=fixed",
        "method.num_speculative_tokens=4", "bench.num_prompts=32", "bench.max_tokens=128", "bench.seed=0"]
TEMPERATURE = 1.0


def measure(method: str, extra: list[str]) -> dict:
    cfg = compose_config(BASE + [f"method.rejection_sample_method={method}"] + extra, "measure_al")
    engine = LLMEngine(cfg)
    b = cfg.bench
    prompts = select_prompts(engine, b, Path(cfg.model.cache_dir) if cfg.model.cache_dir else default_cache_dir())
    counter = AcceptanceCounter(engine.num_spec_tokens)
    engine.listeners.append(counter)
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=b.max_tokens, seed=1000 + i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return {
        "config": {"method": cfg.method.method, "rejection_sample_method": method,
                   "num_speculative_tokens": engine.num_spec_tokens, "speculation": cfg.engine.speculation,
                   "dtype": str(engine.target.dtype).removeprefix("torch."), "device": str(engine.target.device),
                   "model": cfg.model.name, "num_prompts": len(prompts), "max_tokens": b.max_tokens,
                   "prompt_seed": b.seed, "request_seeds": "1000 + prompt index", "temperature": TEMPERATURE,
                   "threads": torch.get_num_threads(), "overrides": BASE + extra},
        "acceptance": counter.summary(),
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "wall_s_not_a_speed_figure": time.perf_counter() - t0,
    }


def main(argv: list[str]) -> None:
    for method in ("strict", "probabilistic", "block"):
        report = measure(method, argv)
        (OUT / f"eagle3-bf16-t1-k4-{method}.json").write_text(json.dumps(report, indent=2) + "\n")
        print(method, "AL", round(report["acceptance"]["mean_acceptance_length"], 4), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
