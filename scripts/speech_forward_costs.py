"""Where a transcription's time goes on this machine: the forwards of the text model by size,
and the encoder passes, for plain decoding and ``+method=ctc`` exact on the same recordings.

Each recording is transcribed once per mode (the modes taking turns, recording by recording,
after one warm-up each); every text-model forward (``CpuDecoder.run``, the LM head's
``CpuDecoder.logits``) and every encoder pass (``AudioEncoderRunner.encode``) is timed and
grouped by its number of tokens (1; 2-8; 9-32; more: the prompt's prefill).  The JSON gives
per group the calls, the tokens, the milliseconds per call and per token, and from them what
bounds ``ctc`` exact's speed-up on this CPU: a perfect draft (the whole transcript verified
in the prefill's forward) saves the decode steps but pays a longer prefill.

  python scripts/speech_forward_costs.py --out docs/benchmarks/speech/forward-costs.json

Needs the fused CPU decoder (the CPU default); one thread unless ``--threads``.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import time
from pathlib import Path

import torch


def _group(n: int) -> str:
    return "1" if n == 1 else "2-8" if n <= 8 else "9-32" if n <= 32 else "prefill (>32)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-speech")
    ap.add_argument("--audio-dir", default=None, help="wav + txt pairs (default: the held-out fixtures)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from specserve.bench_audio import load_dataset
    from specserve.executor import audio_runner
    from specserve.kernels import cpu_decoder
    from specserve.llm import LLM

    records: list[tuple[str, int, float]] = []

    def timed(kind: str, fn, size):
        def wrapper(self, x, *args, **kw):
            t = time.perf_counter()
            out = fn(self, x, *args, **kw)
            records.append((kind, size(x), time.perf_counter() - t))
            return out
        return wrapper

    cpu_decoder.CpuDecoder.run = timed("forward", cpu_decoder.CpuDecoder.run, len)
    cpu_decoder.CpuDecoder.logits = timed("lm_head", cpu_decoder.CpuDecoder.logits, lambda h: int(h.shape[0]))
    audio_runner.AudioEncoderRunner.encode = timed("encoder", audio_runner.AudioEncoderRunner.encode,
                                                   lambda x: len(x))
    llms = {"plain": LLM(a.model, num_threads=a.threads),
            "ctc_exact": LLM(a.model, num_threads=a.threads,
                             speculative_config={"method": "ctc", "num_speculative_tokens": 32})}
    if not getattr(llms["plain"].engine.runner, "fused", None):
        raise SystemExit("the fused CPU decoder is not in use (engine.cpu_kernel); nothing to time")
    data = load_dataset(a.audio_dir, 0)
    for llm in llms.values():
        llm.transcribe([(data[0][1].samples, 16000)])
    per_mode: dict[str, list] = {m: [] for m in llms}
    wall = dict.fromkeys(llms, 0.0)
    for i, (_, audio, _) in enumerate(data):
        order = list(llms) if i % 2 == 0 else list(reversed(llms))
        for m in order:
            records.clear()
            t = time.perf_counter()
            llms[m].transcribe([(audio.samples, 16000)])
            wall[m] += time.perf_counter() - t
            per_mode[m].extend(records)
    report = {"config": {"model": a.model, "threads": a.threads, "recordings": len(data),
                         "audio_seconds": round(sum(x.duration_s for _, x, _ in data), 3),
                         "platform": platform.platform(), "processor": platform.processor()},
              "modes": {}}
    for m, recs in per_mode.items():
        groups: dict[tuple[str, str], list] = collections.defaultdict(lambda: [0, 0, 0.0])
        for kind, n, s in recs:
            g = groups[(kind, "" if kind == "encoder" else _group(n))]
            g[0] += 1
            g[1] += n
            g[2] += s
        rows = {}
        for (kind, size), (calls, tokens, s) in sorted(groups.items()):
            row = {"calls": calls, "total_ms": round(s * 1000, 1), "ms_per_call": round(s * 1000 / calls, 2)}
            if kind != "encoder":
                row.update(tokens=tokens, ms_per_token=round(s * 1000 / tokens, 2))
            rows[f"{kind} {size}".strip()] = row
        timed_s = sum(s for _, _, s in recs)
        report["modes"][m] = {"wall_s": round(wall[m], 3), "timed_share": round(timed_s / wall[m], 3), "groups": rows}
    p = report["modes"]["plain"]["groups"]
    if "forward 1" in p and "forward prefill (>32)" in p:
        step = p["forward 1"]["ms_per_call"] + p.get("lm_head 1", {}).get("ms_per_call", 0.0)
        report["bound"] = {
            "decode_step_ms": round(step, 2),
            "prefill_ms_per_token": p["forward prefill (>32)"]["ms_per_token"],
            "note": "a perfect draft replaces a decode step (decode_step_ms) by prefilling its token "
                    "(prefill_ms_per_token); encoder and prompt are paid in both modes",
        }
    report["rtfx_vs_plain"] = round(wall["plain"] / wall["ctc_exact"], 3)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({m: {k: v["ms_per_call"] for k, v in r["groups"].items()} for m, r in report["modes"].items()},
                     indent=1))
    print("bound", report.get("bound"), "ctc exact vs plain", report["rtfx_vs_plain"])


if __name__ == "__main__":
    main()
