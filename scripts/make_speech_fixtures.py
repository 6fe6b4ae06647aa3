"""Write the held-out speech fixtures: tests/fixtures/speech/NN.wav (16 kHz mono 16-bit)
spoken by espeak-ng (voice en-us, 175 words per minute, pitch 50) from
tests/fixtures/speech/sentences.txt, and transcripts.jsonl ({"file", "text"} per line).

The sentences were written for these fixtures; the embedded speech model's training
sentences exclude them (``specserve.train.speech_data.training_sentences``).  Needs
espeak-ng (apt-get install -y espeak-ng); tests only read the committed files.

    python scripts/make_speech_fixtures.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import soundfile as sf

from specserve.train.speech_data import espeak_ng

HERE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "speech"


def main() -> None:
    sentences = [s.strip() for s in (HERE / "sentences.txt").read_text().splitlines() if s.strip()]
    rows = []
    for i, text in enumerate(sentences):
        samples = espeak_ng(text)
        name = f"{i:02d}.wav"
        sf.write(str(HERE / name), np.clip(samples, -1, 1), 16000, subtype="PCM_16")
        rows.append({"file": name, "text": text, "duration_s": round(len(samples) / 16000, 3)})
    (HERE / "transcripts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    total = sum(r["duration_s"] for r in rows)
    print(f"{len(rows)} recordings, {total:.1f} s in all, in {HERE}")


if __name__ == "__main__":
    main()
