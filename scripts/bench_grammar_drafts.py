"""Grammar-forced drafts on a json_schema workload: tokens/s with them against without, in one run.

The workload: 32 chat requests (``PEOPLE`` below: "describe <person> as a JSON record")
answered at temperature 0 under one JSON schema (``SCHEMA``: seven required keys, strings
of bounded length, an integer, a boolean, an enum and a short array), as
``response_format: json_schema`` makes them.  One engine on the embedded SmolLM2 in the
given dtype (bfloat16 by default: the fused CPU decoder where it runs), with the given
method or none.  The two settings differ only in ``engine.grammar_drafts``, flipped
between rounds on the same engine: each round runs ``--concurrency`` requests with
grammar drafts and the same requests without, the order alternating from round to round,
so both see the same machine (a shared host's drift slows both alike).  Each setting's
tokens/s is its completion tokens over its summed round times; the answers of the two
settings must be token for token identical (the script fails otherwise).

    .venv/bin/python scripts/bench_grammar_drafts.py \\
        --out docs/benchmarks/grammar-drafts/json-schema-bf16-c1.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 30},
        "is_married": {"type": "boolean"},
        "favorite_color": {"enum": ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "occupation", "city", "is_married", "favorite_color", "hobbies"],
    "additionalProperties": False,
}

PEOPLE = [
    "a retired fisherman from Lisbon", "a young software engineer in Berlin", "a jazz pianist in New Orleans",
    "a nurse working night shifts in Toronto", "a beekeeper in rural Provence", "a high-school chemistry teacher",
    "a marathon runner from Nairobi", "a pastry chef in Vienna", "an astronaut in training", "a librarian in Oslo",
    "a street photographer in Tokyo", "a vineyard owner in Napa", "a wildlife biologist in Alaska",
    "a taxi driver in Mumbai", "a violin maker in Cremona", "a data scientist in Sydney", "a lighthouse keeper",
    "a kindergarten teacher in Madrid", "a mountain guide in Chamonix", "an architect in Copenhagen",
    "a farmer growing rice in Vietnam", "a comic book artist in Montreal", "a pilot flying cargo planes",
    "a museum curator in Cairo", "a carpenter in rural Maine", "a flamenco dancer in Seville",
    "a marine engineer in Rotterdam", "a tea farmer in Darjeeling", "a radio host in Chicago",
    "a glassblower in Murano", "a veterinarian in Buenos Aires", "a chess coach in Yerevan",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--method", default=None, help="a speculative method besides the grammar drafts (e.g. ngram)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--num-requests", type=int, default=len(PEOPLE))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from specserve.compat import compose
    from specserve.engine.engine import LLMEngine
    from specserve.request import SamplingParams, StructuredOutputsParams

    overrides = [f"model.dtype={args.dtype}", "engine.num_kv_blocks=1024"]
    if args.method:
        overrides += [f"+method={args.method}", f"method.num_speculative_tokens={args.num_speculative_tokens}",
                      "engine.speculation=fixed"]  # fmt: skip
    cfg = compose(overrides)
    engine = LLMEngine(cfg)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([
        {"role": "system", "content": "You answer with one JSON object and nothing else."},
        {"role": "user", "content": f"Invent {p} and describe them as a JSON record with their name, age, "
                                    "occupation, city, whether they are married, favorite color and hobbies."},
    ]) for p in (PEOPLE * 4)[: args.num_requests]]  # fmt: skip
    so = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=so)

    def run(batch: list[list[int]], forced: bool):
        engine.cfg.engine.grammar_drafts = forced
        t = time.perf_counter()
        outs = engine.generate(batch, [params] * len(batch))
        return time.perf_counter() - t, outs

    run(prompts[:1], True)  # warm-up: the grammar's compile, kernels, caches
    run(prompts[:1], False)
    totals = {True: [0.0, 0], False: [0.0, 0]}
    spec = {True: [0, 0, 0], False: [0, 0, 0]}
    answers: dict[bool, list] = {True: [], False: []}
    rounds = []
    for r, start in enumerate(range(0, len(prompts), args.concurrency)):
        batch = prompts[start : start + args.concurrency]
        order = (True, False) if r % 2 == 0 else (False, True)
        row = {}
        for forced in order:
            wall, outs = run(batch, forced)
            n = sum(len(o.token_ids) for o in outs)
            totals[forced][0] += wall
            totals[forced][1] += n
            for o in outs:
                spec[forced][0] += o.spec.num_drafts
                spec[forced][1] += o.spec.num_draft_tokens
                spec[forced][2] += o.spec.num_accepted_tokens
                assert o.failure is None, o.failure
            answers[forced] += [o.token_ids for o in outs]
            row["with" if forced else "without"] = {"seconds": round(wall, 4), "tokens": n}
        rounds.append(row)
        print(f"round {r}: with {row['with']['tokens'] / row['with']['seconds']:.1f} tok/s, "
              f"without {row['without']['tokens'] / row['without']['seconds']:.1f} tok/s", file=sys.stderr)
    identical = answers[True] == answers[False]
    tps = {k: totals[k][1] / totals[k][0] for k in totals}
    result = {
        "benchmark": "grammar-forced drafts, json_schema workload (scripts/bench_grammar_drafts.py)",
        "model": cfg.model.name, "dtype": str(engine.target.dtype).removeprefix("torch."),
        "device": str(engine.target.device), "cpu_kernel": engine.info.attention_backend,
        "method": args.method or "none", "num_speculative_tokens_engine": engine.num_spec_tokens,
        "num_requests": len(prompts), "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "temperature": 0.0, "schema": SCHEMA,
        "with_grammar_drafts": {"tokens_per_s": round(tps[True], 2), "seconds": round(totals[True][0], 3),
                                "completion_tokens": totals[True][1], "num_drafts": spec[True][0],
                                "num_draft_tokens": spec[True][1], "num_accepted_tokens": spec[True][2]},
        "without_grammar_drafts": {"tokens_per_s": round(tps[False], 2), "seconds": round(totals[False][0], 3),
                                   "completion_tokens": totals[False][1], "num_drafts": spec[False][0],
                                   "num_draft_tokens": spec[False][1], "num_accepted_tokens": spec[False][2]},
        "speedup": round(tps[True] / tps[False], 3),
        "identical_outputs": identical,
        "interleaved_rounds": rounds,
        "host": {"machine": platform.machine(), "python": platform.python_version()},
        "example_answer": tok.decode(answers[True][0]),
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"with {tps[True]:.1f} tok/s, without {tps[False]:.1f} tok/s: {result['speedup']}x; "
          f"identical outputs: {identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
