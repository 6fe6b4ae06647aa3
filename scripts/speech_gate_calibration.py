"""Choose relaxed mode's entropy gate (``method.ctc_entropy_threshold``) for a speech model on
held-out recordings that are not the benchmark's: the validation recordings of a
``specserve-train`` run (the last ``num_train..`` entries of its ``data.npz`` /
``data_gen.npz``).

For every recording: plain decoding's transcript (the model's LLM, greedy; ctc exact gives
it, faster), the CTC greedy text and the text relaxed mode answers with when its gate
settles (the ctc proposer's own hypothesis: normalised and spelt as ``method.ctc_spelling:
auto`` does for this model), and the largest per-frame CTC entropy.  Both sides of every
WER are normalised (``audio.text.normalize_transcript``).  For each candidate threshold,
relaxed mode's transcript is approximated as the spelt CTC text where the gate settles the
recording and plain decoding's elsewhere; the JSON lists the curve and the largest
threshold whose WER stays within ``--within`` (relative) of plain decoding's.  ``--write``
stores that threshold in the model's ``config.json`` (``specserve.ctc_entropy_threshold``,
with how it was chosen): relaxed mode uses it when ``method.ctc_entropy_threshold`` is left
null.  The recordings are read as ``specserve-train`` reads them (``train.speech``).

  python scripts/speech_gate_calibration.py --model specserve/assets/smollm2-135m-speech \\
      --out calibration.json outputs/speech-smollm2-135m/data.npz outputs/speech-smollm2-135m/data_gen.npz
  (--exclude-json: a JSON list of sentences to leave out, e.g. an earlier run's training text)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import jiwer
import numpy as np
import torch

from specserve.audio.text import normalize_transcript
from specserve.executor.models.granite_speech import ctc_greedy_labels, ctc_max_entropy, ctc_text
from specserve.llm import LLM
from specserve.request import SamplingParams
from specserve.train.speech import load_recordings, recording


def validation_recordings(paths: list[str], exclude: set[str]) -> list[tuple[str, np.ndarray]]:
    out = []
    for p in paths:
        d = load_recordings(Path(p))
        out += [(t, recording(d, i)) for i, t in enumerate(d["texts"]) if i >= d["num_train"] and t not in exclude]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--within", type=float, default=0.12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--exclude-json")
    ap.add_argument("--write", action="store_true", help="store the threshold in the model's config.json")
    ap.add_argument("data", nargs="+")
    a = ap.parse_args(argv)
    if a.write and not (Path(a.model) / "config.json").is_file():
        ap.error(f"--write needs --model to be a model directory (config.json); got {a.model!r}")
    torch.set_num_threads(a.threads)
    exclude = set(json.loads(Path(a.exclude_json).read_text())) if a.exclude_json else set()
    recs = validation_recordings(a.data, exclude)
    # ctc exact: plain decoding's transcripts (lossless), and the proposer relaxed mode would use
    llm = LLM(a.model, num_threads=a.threads, speculative_config={"method": "ctc", "num_speculative_tokens": 32})
    runner = llm.engine.speech.runner  # the engine's own encoder pass (log-mel, encoder, CTC head)
    proposer = llm.engine.proposer
    greedy_seq = SimpleNamespace(params=SamplingParams(temperature=0.0))
    outs = llm.transcribe([(x, 16000) for _, x in recs])
    rows = []
    for (ref, x), o in zip(recs, outs):
        logp = runner.encode(x).ctc_log_probs
        rows.append({"ref": normalize_transcript(ref), "plain": normalize_transcript(o.text),
                     "ctc": normalize_transcript(ctc_text(ctc_greedy_labels(logp))),
                     "spelt": normalize_transcript(proposer.hypothesis(greedy_seq, logp).text),
                     "max_entropy": round(ctc_max_entropy(logp), 4)})
    refs = [r["ref"] for r in rows]
    plain = jiwer.wer(refs, [r["plain"] for r in rows])
    curve, chosen = [], None
    for t in sorted({0.7, *(r["max_entropy"] for r in rows)}):
        hyp = [r["spelt"] if r["max_entropy"] <= t else r["plain"] for r in rows]
        w = jiwer.wer(refs, hyp)
        curve.append({"threshold": t, "settled": sum(r["max_entropy"] <= t for r in rows), "wer": round(w, 4)})
        if w <= plain * (1 + a.within):
            chosen = curve[-1]
    best = chosen["threshold"] if chosen else None
    res = {"model": a.model, "recordings": len(rows), "plain_wer": round(plain, 4),
           "ctc_wer": round(jiwer.wer(refs, [r["ctc"] for r in rows]), 4),
           "spelt_wer": round(jiwer.wer(refs, [r["spelt"] for r in rows]), 4),
           "within": a.within, "largest_threshold_within": best, "curve": curve, "rows": rows}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    if a.write and best is not None:
        path = Path(a.model) / "config.json"
        cfg = json.loads(path.read_text())
        extra = cfg.setdefault("specserve", {})
        extra["ctc_entropy_threshold"] = best
        extra["ctc_entropy_threshold_calibration"] = {
            "recordings": len(rows), "within": a.within, "plain_wer": res["plain_wer"],
            "relaxed_wer": chosen["wer"], "settled": chosen["settled"],
            "script": "scripts/speech_gate_calibration.py"}
        path.write_text(json.dumps(cfg, indent=2) + "\n")
        print(f"wrote specserve.ctc_entropy_threshold={best} to {path}")
    print(json.dumps({k: v for k, v in res.items() if k not in ("curve", "rows")}))


if __name__ == "__main__":
    main()
