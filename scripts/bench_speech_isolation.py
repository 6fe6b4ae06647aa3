"""A long recording beside a short text request: does the text request keep its latency?

Starts the server in this process on loopback (the speech model, +method=ctc by default),
then measures, over HTTP, a short greedy chat request's latency:

1. unloaded: ``--repeats`` times, one after another;
2. loaded: the same requests, one after another, while a transcription of a recording of
   ``--minutes`` minutes (the held-out fixtures concatenated with short pauses, repeated)
   runs on ``/v1/audio/transcriptions``; the transcription is split into 30 s segments that
   the engine encodes under its per-step encoder budget and decodes beside the text request.

The ratio of the medians (loaded / unloaded) is measured in one run, on one server; the
JSON (``--out``) holds every latency, the transcription's wall time, segments and RTFx.

    python scripts/bench_speech_isolation.py --out docs/benchmarks/speech/isolation.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specserve.audio.decode import decode_audio, encode_wav  # noqa: E402

PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def long_recording(minutes: float) -> np.ndarray:
    d = ROOT / "tests" / "fixtures" / "speech"
    clips = [decode_audio(p.read_bytes()).samples for p in sorted(d.glob("*.wav"))]
    pause = np.zeros(int(0.3 * 16000), np.float32)
    out, n = [], 0
    while n < minutes * 60 * 16000:
        for c in clips:
            out += [c, pause]
            n += len(c) + len(pause)
    return np.concatenate(out)[: int(minutes * 60 * 16000)]


async def chat_latency(session, url: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    async with session.post(f"{url}/v1/chat/completions", json={
            "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0}) as r:
        body = await r.json()
        assert r.status == 200, body
    return time.perf_counter() - t0


async def measure(url: str, wav: bytes, repeats: int, max_tokens: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        await chat_latency(s, url, max_tokens)  # warm-up
        unloaded = [await chat_latency(s, url, max_tokens) for _ in range(repeats)]

        async def transcribe() -> tuple[float, dict]:
            form = aiohttp.FormData()
            form.add_field("file", wav, filename="long.wav", content_type="audio/wav")
            form.add_field("response_format", "verbose_json")
            t0 = time.perf_counter()
            async with s.post(f"{url}/v1/audio/transcriptions", data=form) as r:
                body = await r.json()
                assert r.status == 200, body
            return time.perf_counter() - t0, body

        task = asyncio.create_task(transcribe())
        await asyncio.sleep(3.0)  # the transcription is under way (its first segment encoded)
        loaded = []
        while len(loaded) < repeats and not task.done():
            loaded.append(await chat_latency(s, url, max_tokens))
        wall, body = await task
    return {"unloaded_s": unloaded, "loaded_s": loaded, "transcription_wall_s": wall, "transcription": body}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-speech", help="a model preset, or a model directory")
    p.add_argument("--method", default="ctc")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="results/speech-isolation.json")
    p.add_argument("overrides", nargs="*", help="more Hydra overrides (engine.long_prefill_token_threshold=64 ...)")
    args = p.parse_args()

    from specserve.compose import compose_config
    from specserve.engine.async_engine import build_async_engine
    from specserve.server import start_servers

    model = [f"model.path={args.model}", "model.name=speech", "model.dtype=float32"] if "/" in args.model \
        else [f"model={args.model}"]  # a directory, or a model preset
    overrides = [*model, "server.host=127.0.0.1", "server.grpc_port=0", "server.http_port=0",
                 f"engine.num_threads={args.threads}"]
    if args.method != "none":
        overrides.append(f"+method={args.method}")
    overrides += args.overrides
    cfg = compose_config(overrides)
    engine = build_async_engine(cfg)
    handle = start_servers(cfg.server, engine)
    try:
        wav = encode_wav(long_recording(args.minutes))
        res = asyncio.run(measure(f"http://127.0.0.1:{handle.http_port}", wav, args.repeats, args.max_tokens))
    finally:
        handle.stop()
    u, lo = statistics.median(res["unloaded_s"]), statistics.median(res["loaded_s"])
    seconds = args.minutes * 60
    report = {
        "config": {"model": args.model, "method": args.method, "overrides": args.overrides, "minutes": args.minutes, "repeats": args.repeats,
                   "max_tokens": args.max_tokens, "threads": args.threads,
                   "encoder_frames_per_step": cfg.audio.encoder_frames_per_step,
                   "yielding (encoder_frames_beside_text, tokens_beside_text, tokens_per_step)":
                       list(cfg.audio.yielding(False)), "yield_period": cfg.audio.yield_period,
                   "max_clip_s": cfg.audio.max_clip_s},
        "text_latency_unloaded_median_s": round(u, 4), "text_latency_loaded_median_s": round(lo, 4),
        "ratio_loaded_over_unloaded": round(lo / u, 3), "text_latencies_unloaded_s": res["unloaded_s"],
        "text_latencies_loaded_s": res["loaded_s"], "transcription_wall_s": round(res["transcription_wall_s"], 2),
        "transcription_rtfx": round(seconds / res["transcription_wall_s"], 3),
        "transcription_segments": len(res["transcription"].get("segments", [])),
        "transcription_chars": len(res["transcription"].get("text", "")),
        "transcription_spec_decode": res["transcription"].get("spec_decode"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"text request median latency: unloaded {u:.3f} s, beside a {args.minutes:g}-minute transcription "
          f"{lo:.3f} s: x{lo / u:.2f}; transcription {report['transcription_wall_s']} s "
          f"(RTFx {report['transcription_rtfx']}), {report['transcription_segments']} segments -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
