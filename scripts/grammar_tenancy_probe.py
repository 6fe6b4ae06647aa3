"""Does a grammar another tenant compiled answer faster?  The grammar cache's timing across API keys.

Starts the real servers in this process (the embedded SmolLM2, plain decoding, bf16 on
the fused CPU decoder when it builds here; ``server.api_key=alice,bob``) on loopback.
Per round, a fresh JSON schema of ``--properties`` described properties (3000: the size
of the report) is sent with ``max_tokens: 1`` as: Alice's first request (a fresh
compile), Bob's same schema (the probe: before, a hit on Alice's entry answered ~14x
faster), then Alice's and Bob's repeats (each a hit on their own entry).  Writes JSON: the
seconds of each, their medians over the rounds, the ratios to the fresh compile and the
compiles each request caused (``GrammarCache.num_compiles``).  Target: Bob's first
request within noise of a fresh compile (ratio ~1), the repeats far below it.

    .venv/bin/python scripts/grammar_tenancy_probe.py --out docs/benchmarks/tenancy/grammar-cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from grammar_stall_probe import cpu_name, fused_available  # noqa: E402


def schema(n: int, tag: str) -> dict:
    kinds = [{"type": "string", "maxLength": 40}, {"type": "integer"}, {"type": "boolean"},
             {"enum": ["alpha", "beta", "gamma"]}, {"type": "number"}]  # fmt: skip
    props = {f"{tag}_{i:04d}": {**kinds[i % len(kinds)], "description": f"property {i}"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)[:10], "additionalProperties": False}


def timed(url: str, key: str, body: dict) -> float:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        out = json.loads(resp.read())
    assert out["usage"]["completion_tokens"] == 1, out
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--properties", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from specserve.compat import compose
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.engine import LLMEngine
    from specserve.server import start_servers

    fused = fused_available()
    overrides = ["server.host=127.0.0.1", "server.grpc_port=0", "server.http_port=0", "server.api_key=alice,bob",
                 "server.grammar_compile_timeout_s=600"]  # fmt: skip
    overrides += ["model.dtype=bfloat16", "engine.cpu_kernel=fused"] if fused else []
    cfg = compose(overrides)
    llm = LLMEngine(cfg)
    handle = start_servers(cfg, AsyncEngine(llm, cfg.server.max_queue))
    url = f"http://127.0.0.1:{handle.http_port}"
    steps = ("alice_fresh", "bob_same_schema", "alice_repeat", "bob_repeat")
    who = {"alice_fresh": "alice", "bob_same_schema": "bob", "alice_repeat": "alice", "bob_repeat": "bob"}
    seconds: dict[str, list[float]] = {s: [] for s in steps}
    compiles: dict[str, list[int]] = {s: [] for s in steps}
    try:
        warm = {"prompt": "Hi", "max_tokens": 1, "response_format": {"type": "json_object"}}
        timed(url, "alice", warm)  # the tokenizer conversion happens at the first compile
        for r in range(args.rounds):
            fmt = {"type": "json_schema", "json_schema": {"name": "probe", "schema": schema(args.properties, f"r{r}")}}
            body = {"prompt": "Fill in the record as JSON.", "max_tokens": 1, "temperature": 0, "response_format": fmt}
            for step in steps:
                before = llm.grammar_backend.cache.num_compiles
                seconds[step].append(timed(url, who[step], body))
                compiles[step].append(llm.grammar_backend.cache.num_compiles - before)
    finally:
        handle.stop()
    med = {s: statistics.median(v) for s, v in seconds.items()}
    fresh = med["alice_fresh"]
    report = {
        "what": "seconds of a max_tokens=1 completion with a json_schema: fresh, another key's, own repeat",
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "model": cfg.model.path, "dtype": str(llm.target.dtype).removeprefix("torch."),
        "schema_properties": args.properties, "rounds": args.rounds,
        "seconds": {s: [round(x, 4) for x in v] for s, v in seconds.items()},
        "median_s": {s: round(v, 4) for s, v in med.items()},
        "ratio_to_fresh": {s: round(v / fresh, 3) for s, v in med.items()},
        "compiles": compiles,
        "targets": {"bob_same_schema_ratio": "~1 (a compile of its own)", "repeats": "a cache hit (0 compiles)"},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    ok = all(c == 1 for c in compiles["bob_same_schema"]) and not any(compiles["alice_repeat"] + compiles["bob_repeat"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
