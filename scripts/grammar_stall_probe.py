"""Does a big structured-output request stall the other requests?  Greedy latency while it runs.

Starts the real servers in this process (``LLMEngine`` + ``AsyncEngine`` +
``start_servers``, the embedded SmolLM2, plain decoding; bf16 on the fused CPU
decoder when that decoder builds here) on loopback.  Measures one greedy
completion (temperature 0, fixed length) on the idle server, then again while a
chat completion with ``n=16`` and a legal ``json_schema`` of about 280 KB (an object
with 2000 described properties of varied types, most optional) runs: the greedy request is sent
just after it, so it overlaps the schema's compile.  Counts the grammar compiles
(matchers llguidance built for the schema, and the threads that built them).
Writes JSON: the latencies, their ratio (target: within 2x) and the compile count
(target: 1).

    .venv/bin/python scripts/grammar_stall_probe.py --out docs/benchmarks/grammar-stall/probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

PROMPT = "Write a short poem about the sea."
MARKER = "zq_probe_"  # in every property name: finds the schema's compiles


def big_schema(n: int = 2000) -> dict:
    kinds = [
        {"type": "string", "maxLength": 40},
        {"type": "integer", "minimum": -1000, "maximum": 100000},
        {"type": "boolean"},
        {"type": "number"},
        {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue", "cyan"]}, "maxItems": 5},
        {"type": "string", "pattern": "^[a-z]{2,8}-[0-9]{3}$"},
        {"enum": ["alpha", "beta", "gamma", "delta"]},
        {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}, "required": ["x"],
         "additionalProperties": False},
        {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "integer"}]},
    ]  # fmt: skip
    props = {
        f"{MARKER}{i:04d}": {**kinds[i % len(kinds)], "description": f"generated property {i} of the probe's schema"}
        for i in range(n)
    }
    return {"type": "object", "properties": props, "required": list(props)[:20], "additionalProperties": False}


def post(url: str, body: dict, timeout: float = 900.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def greedy(url: str, max_tokens: int) -> float:
    """Seconds for one greedy completion of exactly ``max_tokens`` tokens."""
    t0 = time.perf_counter()
    out = post(f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                         "ignore_eos": True})  # fmt: skip
    assert out["usage"]["completion_tokens"] == max_tokens, out["usage"]
    return time.perf_counter() - t0


class Spy:
    """Wraps llguidance.LLMatcher: records when and in which thread each matcher was built."""

    def __init__(self):
        import llguidance

        self.real = llguidance.LLMatcher
        self.built: list[dict] = []
        spy = self

        class Recording:
            def __new__(cls, tokenizer, grammar, **kw):
                t0 = time.perf_counter()
                m = spy.real(tokenizer, grammar, **kw)
                spy.built.append({"probe": MARKER in grammar, "thread": threading.current_thread().name,
                                  "start_s": t0, "build_s": time.perf_counter() - t0})  # fmt: skip
                return m

        for name in ("grammar_from_json_schema", "grammar_from_regex", "grammar_from_lark", "validate_grammar"):
            setattr(Recording, name, staticmethod(getattr(self.real, name)))
        llguidance.LLMatcher = Recording


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def fused_available() -> bool:
    from specserve.executor.loader import default_cache_dir
    from specserve.kernels.cpu_decoder import KernelUnavailable, load_library

    try:
        load_library(default_cache_dir())
    except KernelUnavailable as e:
        print(f"fused CPU decoder unavailable ({e}): default dtype", file=sys.stderr)
        return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--schema-tokens", type=int, default=24, help="max_tokens of each of the 16 copies")
    ap.add_argument("--properties", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5, help="unloaded greedy runs (median)")
    args = ap.parse_args()
    os.environ.pop("SPECSERVE_API_KEY", None)

    from specserve.compat import compose
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.engine import LLMEngine
    from specserve.server import start_servers

    fused = fused_available()
    overrides = ["server.host=127.0.0.1", "server.grpc_port=0", "server.http_port=0", "server.max_tokens_cap=512"]
    overrides += ["model.dtype=bfloat16", "engine.cpu_kernel=fused"] if fused else []
    cfg = compose(overrides)
    spy = Spy()
    llm = LLMEngine(cfg)
    handle = start_servers(cfg, AsyncEngine(llm, cfg.server.max_queue))
    url = f"http://127.0.0.1:{handle.http_port}"
    schema = big_schema(args.properties)
    schema_bytes = len(json.dumps(schema))
    try:
        greedy(url, args.greedy_tokens)  # warm-up
        # The grammar backend's tokenizer conversion happens at the first compile: do it now.
        post(f"{url}/v1/completions", {"prompt": "Hi", "max_tokens": 4, "response_format": {"type": "json_object"}})
        unloaded = [greedy(url, args.greedy_tokens) for _ in range(args.repeats)]

        body = {"messages": [{"role": "user", "content": "Fill in the record as JSON."}], "n": 16,
                "max_tokens": args.schema_tokens, "temperature": 0.8, "seed": 1,
                "response_format": {"type": "json_schema", "json_schema": {"name": "probe", "schema": schema}}}  # fmt: skip
        result: dict = {}

        def run_schema() -> None:
            t0 = time.perf_counter()
            try:
                out = post(f"{url}/v1/chat/completions", body)
                result["finish_reasons"] = sorted({c["finish_reason"] for c in out["choices"]})
                result["choices"] = len(out["choices"])
            except Exception as e:  # reported in the JSON
                result["error"] = f"{type(e).__name__}: {e}"
            result["seconds"] = time.perf_counter() - t0
            result["end"] = time.perf_counter()

        big = threading.Thread(target=run_schema)
        t_big = time.perf_counter()
        big.start()
        time.sleep(0.05)  # the schema request is in the server: the greedy one overlaps its compile
        t_greedy = time.perf_counter()
        loaded = greedy(url, args.greedy_tokens)
        big.join()
    finally:
        handle.stop()

    probe = [b for b in spy.built if b["probe"]]
    base = statistics.median(unloaded)
    report = {
        "what": "greedy completion latency, idle vs overlapping a n=16 json_schema chat completion",
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "model": cfg.model.path, "dtype": str(llm.target.dtype).removeprefix("torch."), "device": str(llm.target.device),
        "greedy_tokens": args.greedy_tokens,
        "schema": {"properties": args.properties, "json_bytes": schema_bytes, "n": 16,
                   "max_tokens_per_copy": args.schema_tokens},
        "greedy_unloaded_s": [round(x, 3) for x in unloaded],
        "greedy_unloaded_median_s": round(base, 3),
        "greedy_loaded_s": round(loaded, 3),
        "ratio_loaded_to_unloaded": round(loaded / base, 2),
        "greedy_sent_after_schema_s": round(t_greedy - t_big, 3),
        "schema_request_s": round(result.get("seconds", float("nan")), 3),
        "schema_result": {k: v for k, v in result.items() if k in ("finish_reasons", "choices", "error")},
        "schema_compiles": len(probe),
        "schema_compile_threads": sorted({b["thread"].rsplit("_", 1)[0] for b in probe}),
        "schema_compile_s": [round(b["build_s"], 3) for b in probe],
        "schema_compile_started_after_request_s": [round(b["start_s"] - t_big, 3) for b in probe],
        "targets": {"ratio_at_most": 2.0, "compiles": 1},
        "server": {k: getattr(cfg.server, k) for k in ("grammar_compile_threads", "grammar_compile_timeout_s",
                                                      "grammar_cache_entries", "grammar_max_chars")},  # fmt: skip
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if report["ratio_loaded_to_unloaded"] <= 2.0 and len(probe) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
