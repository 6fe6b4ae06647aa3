"""Does a stream of U+FFFD characters stall the server?  /health latency while it runs.

Starts a real server (``python -m specserve``, the embedded SmolLM2, plain decoding)
on loopback: bf16 on the fused CPU decoder when that decoder builds here, else the
default dtype.  Streams one long completion over the HTTP API at temperature 0 with
``logit_bias={24211: 100}`` (every token is then 24211, the real character U+FFFD)
while probing ``GET /health`` every 50 ms, and sends one short request half-way.
Then the same without logit_bias (the control: the model's own text).  Writes JSON:
per run the probes' p50/p99/max latency, the short request's latency and the
stream's tokens/s.

    .venv/bin/python scripts/fffd_health_probe.py --out docs/benchmarks/fffd-health/health-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

FFFD_ID = 24211
PROMPT = "Write a long story about a lighthouse keeper."


def fused_available() -> bool:
    """Whether the fused bf16 CPU decoder builds and loads on this machine."""
    from specserve.executor.loader import default_cache_dir
    from specserve.kernels.cpu_decoder import KernelUnavailable, load_library

    try:
        load_library(default_cache_dir())
    except KernelUnavailable as e:
        print(f"fused CPU decoder unavailable ({e}): default dtype", file=sys.stderr)
        return False
    return True


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def get(url: str, timeout: float = 60.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        resp.read()
        return resp.status


def post(url: str, body: dict, timeout: float = 600.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


class Server:
    def __init__(self, overrides: list[str], log_path: Path):
        grpc_port, self.http_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.http_port}"
        args = [sys.executable, "-m", "specserve", *overrides, "server.host=127.0.0.1",
                f"server.grpc_port={grpc_port}", f"server.http_port={self.http_port}"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "SPECSERVE_API_KEY"}
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before it was healthy")
            try:
                if get(f"{self.url}/health", timeout=2) == 200:
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.url}/health not 200 after {timeout_s} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Stream(threading.Thread):
    """One streamed completion; counts its tokens (from the usage chunk) and text."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.text, self.chunks, self.tokens = "", 0, 0
        self.start_s = self.first_s = self.end_s = 0.0
        self.error: str | None = None

    def run(self) -> None:
        self.start_s = time.perf_counter()
        try:
            with post(f"{self.url}/v1/completions", self.body) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    for c in chunk.get("choices", []):
                        if c.get("text") and not self.first_s:
                            self.first_s = time.perf_counter()
                        self.text += c.get("text", "")
                    self.chunks += 1
                    if chunk.get("usage"):
                        self.tokens = chunk["usage"]["completion_tokens"]
        except Exception as e:  # reported in the JSON, not raised: the probes still count
            self.error = f"{type(e).__name__}: {e}"
        self.end_s = time.perf_counter()


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def probe_run(url: str, max_tokens: int, fffd: bool, interval_s: float) -> dict:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if fffd:
        body["logit_bias"] = {str(FFFD_ID): 100}
    stream = Stream(url, body)
    stream.start()
    latencies: list[float] = []
    short_s: float | None = None
    short_at = None
    next_at = time.perf_counter()
    while stream.is_alive():
        t0 = time.perf_counter()
        get(f"{url}/health")
        latencies.append(time.perf_counter() - t0)
        if short_s is None and stream.chunks >= max_tokens // 2:  # half-way: a second client's request
            short_at = stream.chunks
            t1 = time.perf_counter()
            with post(f"{url}/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0}) as resp:
                resp.read()
            short_s = time.perf_counter() - t1
        next_at += interval_s
        time.sleep(max(0.0, next_at - time.perf_counter()))
    stream.join()
    decode_s = stream.end_s - (stream.first_s or stream.start_s)
    return {
        "logit_bias": body.get("logit_bias"),
        "completion_tokens": stream.tokens,
        "all_fffd": fffd and stream.text == "\ufffd" * stream.tokens,
        "stream_error": stream.error,
        "stream_seconds": round(stream.end_s - stream.start_s, 3),
        "tokens_per_s": round((stream.tokens - 1) / decode_s, 2) if decode_s > 0 and stream.tokens > 1 else None,
        "health_probes": len(latencies),
        "health_p50_ms": round(1000 * statistics.median(latencies), 2) if latencies else None,
        "health_p99_ms": round(1000 * percentile(latencies, 0.99), 2) if latencies else None,
        "health_max_ms": round(1000 * max(latencies), 2) if latencies else None,
        "short_request_ms": round(1000 * short_s, 1) if short_s is not None else None,
        "short_request_sent_after_chunks": short_at,
    }


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--interval-ms", type=float, default=50.0)
    ap.add_argument("--log-dir", default=tempfile.gettempdir(), help="where the servers' logs go")
    args = ap.parse_args()

    fused = fused_available()
    overrides = ["model.dtype=bfloat16", "engine.cpu_kernel=fused"] if fused else []
    overrides.append(f"server.max_tokens_cap={max(args.max_tokens, 16)}")
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": cpu_name(), "cpus": os.cpu_count(), "fused_cpu_decoder": fused,
              "server_overrides": overrides, "prompt": PROMPT, "max_tokens": args.max_tokens,
              "probe_interval_ms": args.interval_ms, "runs": {}}  # fmt: skip
    for name, fffd in (("fffd", True), ("control", False)):
        server = Server(overrides, Path(args.log_dir) / f"fffd-health-server-{name}.log")
        try:
            server.wait_healthy()
            report["runs"][name] = probe_run(server.url, args.max_tokens, fffd, args.interval_ms / 1000)
        finally:
            server.stop()
        print(name, json.dumps(report["runs"][name]), flush=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    p99 = report["runs"]["fffd"]["health_p99_ms"]
    print(f"/health p99 while the U+FFFD request streams: {p99} ms (target < 100 ms) -> {args.out}")
    return 0 if p99 is not None and p99 < 100 else 1


if __name__ == "__main__":
    sys.exit(main())
