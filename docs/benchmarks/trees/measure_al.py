"""Mean acceptance length of EAGLE-3 chains and draft trees on the embedded SmolLM2.

``specserve-bench``'s prompt selection and acceptance counter, greedy decoding, fixed
speculation, the shipped EAGLE-3 head: chains of K = 3, 5, 7 drafts and trees of 4, 6, 8
verified tokens (the same 3, 5, 7 drafts per step, spent on a tree).  Plain decoding runs
first on the same prompts and every configuration's output is compared with it token for
token.  Acceptance does not depend on timing: no tokens/s are reported.  One JSON per
configuration is written next to this file.

    python docs/benchmarks/trees/measure_al.py [--only NAME,NAME] [extra Hydra overrides, e.g. model.dtype=float32]
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
BASE = ["model.dtype=bfloat16", "engine.speculation=fixed", "bench.num_prompts=32", "bench.max_tokens=128",
        "bench.seed=0"]
METHOD = ["+method=eagle3", "draft=smollm2-135m-eagle3"]
CONFIGS = {
    **{f"chain-k{k}": [f"method.num_speculative_tokens={k}"] for k in (3, 5, 7)},
    **{f"tree-n{n}-topk2": ["method.tree.topk=2", f"method.tree.depth={n - 1}", f"method.tree.num_draft_tokens={n}"]
       for n in (4, 6, 8)},
    # wider and shallower: the shapes that did best in a float32 search over (topk, depth)
    **{f"tree-n{n}-topk{t}-d{d}": [f"method.tree.topk={t}", f"method.tree.depth={d}", f"method.tree.num_draft_tokens={n}"]
       for n, t, d in ((4, 3, 2), (6, 3, 3), (8, 4, 3), (8, 4, 5))},
}


def run(overrides: list[str], prompts=None) -> tuple[dict, list[list[int]], list]:
    cfg = compose_config(overrides, "measure_al")
    engine = LLMEngine(cfg)
    b = cfg.bench
    if prompts is None:
        prompts = select_prompts(engine, b, Path(cfg.model.cache_dir) if cfg.model.cache_dir else default_cache_dir())
    counter = AcceptanceCounter(max(engine.num_spec_tokens, 1))
    engine.listeners.append(counter)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=b.max_tokens) for _ in prompts])
    spec = cfg.method
    report = {
        "config": {"method": spec.method if spec else "none", "num_speculative_tokens": engine.num_spec_tokens,
                   "tree": vars(spec.tree) if spec is not None and spec.tree.enabled else None,
                   "speculation": cfg.engine.speculation, "dtype": str(engine.target.dtype).removeprefix("torch."),
                   "device": str(engine.target.device), "attention_backend": engine.info.attention_backend,
                   "model": cfg.model.name, "num_prompts": len(prompts), "max_tokens": b.max_tokens,
                   "prompt_seed": b.seed, "temperature": 0.0, "threads": torch.get_num_threads(),
                   "overrides": overrides},
        "acceptance": counter.summary(),
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "wall_s_not_a_speed_figure": time.perf_counter() - t0,
    }
    return report, [o.token_ids for o in outs], prompts


def main(argv: list[str]) -> None:
    only = None
    if argv[:1] == ["--only"]:
        only, argv = set(argv[1].split(",")), argv[2:]
    plain_report, plain, prompts = run(BASE + argv)
    for name, keys in CONFIGS.items():
        if only is not None and name not in only:
            continue
        report, toks, _ = run(BASE + METHOD + keys + argv, prompts)
        differ = [i for i, (a, b) in enumerate(zip(toks, plain)) if a != b]
        report["greedy_match_vs_plain"] = 1 - len(differ) / len(plain)
        report["prompts_differing_from_plain"] = differ
        dtype = report["config"]["dtype"].replace("bfloat16", "bf16").replace("float32", "fp32")
        (OUT / f"eagle3-{dtype}-{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        print(name, "AL", round(report["acceptance"]["mean_acceptance_length"], 4), "greedy_match",
              report["greedy_match_vs_plain"], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
