"""Speech for training the embedded speech model: English sentences spoken by espeak-ng.

``espeak_ng`` speaks one sentence (voice, words per minute, pitch) and returns 16 kHz
float32 samples; the synthesizer is the Debian package ``espeak-ng``, needed by the
trainer and the fixture script only (serving and tests never call it).  A missing
synthesizer is one line saying how to install it.

``training_sentences`` draws sentences from the ShareGPT training pool (``specserve.data``:
first human turns, disjoint from the benchmark pool), cut at sentence ends, kept when
they are plain English words only (no digits, no code, 3 to 14 words), normalised as
transcripts are (``audio.text``), and never one of the excluded (held-out test) sentences
nor a sentence containing one.  No torch.
"""

from __future__ import annotations

import io
import random
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from specserve.audio.decode import to_mono_16k
from specserve.audio.text import normalize_transcript

VOICE = "en-us"


def espeak_binary() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("espeak-ng is needed to synthesize training speech: apt-get install -y espeak-ng")
    return exe


def espeak_ng(text: str, voice: str = VOICE, wpm: int = 175, pitch: int = 50) -> np.ndarray:
    """``text`` spoken by espeak-ng, as 16 kHz mono float32 samples."""
    import soundfile as sf

    out = subprocess.run([espeak_binary(), "-v", voice, "-s", str(wpm), "-p", str(pitch), "--stdout", text],
                         capture_output=True, check=True, timeout=60)
    samples, rate = sf.read(io.BytesIO(out.stdout), dtype="float32")
    return to_mono_16k(samples, rate)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_PLAIN = re.compile(r"^[A-Za-z ,;:'\"!?.\-()]+$")


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def training_sentences(num: int, exclude: list[str], seed: int = 0, min_words: int = 3, max_words: int = 14,
                       cache_dir: Path | None = None) -> list[str]:
    """``num`` distinct normalised sentences from the ShareGPT training pool."""
    from specserve.data import load_split

    _, pool = load_split(cache_dir)
    held = [normalize_transcript(s) for s in exclude]
    held_set = set(held)
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    seen: set[str] = set()
    out: list[str] = []
    for i in order:
        for raw in split_sentences(pool[i]):
            if not _PLAIN.match(raw):
                continue
            s = normalize_transcript(raw)
            words = s.split()
            if not min_words <= len(words) <= max_words or s in seen or s in held_set:
                continue
            if any(h in s for h in held):
                continue
            seen.add(s)
            out.append(s)
            if len(out) >= num:
                return out
    return out
