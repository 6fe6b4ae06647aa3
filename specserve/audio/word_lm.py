"""A word bigram language model for spelling CTC transcripts in context (``audio.spelling``).

A character CTC encoder writes what it hears: "by food" for "buy food", "main stream" for
"main street".  The vocabulary speller alone cannot tell such words apart; counts of which
word follows which in the speech model's own training text can.  ``WordBigramLM`` holds
those counts and gives ``log_prob(prev, word)`` by interpolated absolute discounting:

    P(w | p) = max(c(p, w) - d, 0) / c(p) + d * N1(p) / c(p) * P_uni(w)

where ``N1(p)`` counts the distinct words seen after ``p`` and ``P_uni`` is the add-k
unigram estimate over a nominal vocabulary of ``vocab_size`` words (so an unseen word still
has a small probability); a ``p`` never seen falls back to ``P_uni``.  Sentences begin with
``BOS`` and end with ``EOS``.

The model is a gzip-compressed JSON file in the speech model's directory
(``config.json``'s ``specserve.spelling_lm`` names it), written by
``scripts/speech_spelling_lm.py`` from the sentences the model was trained on (never the
held-out test sentences).  ``load`` checks its shape and raises ``ValueError`` saying what
is wrong.  No torch.
"""

from __future__ import annotations

import gzip
import json
import math
from collections import Counter
from pathlib import Path
from typing import Iterable

BOS, EOS = "<s>", "</s>"
FORMAT = "specserve-word-bigrams"
VERSION = 1


class WordBigramLM:
    def __init__(self, unigrams: dict[str, int], bigrams: dict[tuple[str, str], int], discount: float = 0.75,
                 unigram_k: float = 0.1, vocab_size: int = 200_000):
        if not 0.0 < discount < 1.0:
            raise ValueError(f"discount must be in (0, 1), got {discount!r}")
        if not unigram_k > 0 or vocab_size < 1:
            raise ValueError("unigram_k must be positive and vocab_size at least 1")
        self.unigrams, self.bigrams = unigrams, bigrams
        self.discount, self.unigram_k, self.vocab_size = float(discount), float(unigram_k), int(vocab_size)
        self.total = sum(unigrams.values())
        # per history word: how often it is a history, and how many distinct words follow it
        self._history: Counter[str] = Counter()
        self._followers: Counter[str] = Counter()
        for (p, _), c in bigrams.items():
            self._history[p] += c
            self._followers[p] += 1
        self._denominator = self.total + self.unigram_k * self.vocab_size

    @classmethod
    def from_sentences(cls, sentences: Iterable[str], **kw) -> "WordBigramLM":
        uni: Counter[str] = Counter()
        bi: Counter[tuple[str, str]] = Counter()
        for s in sentences:
            w = [BOS, *s.split(), EOS]
            uni.update(w)
            bi.update(zip(w, w[1:]))
        return cls(dict(uni), dict(bi), **kw)

    def _unigram_prob(self, word: str) -> float:
        return (self.unigrams.get(word, 0) + self.unigram_k) / self._denominator

    def unigram_log_prob(self, word: str) -> float:
        return math.log(self._unigram_prob(word))

    def log_prob(self, prev: str, word: str) -> float:
        h = self._history.get(prev, 0)
        if h == 0:
            return self.unigram_log_prob(word)
        d = self.discount
        seen = max(self.bigrams.get((prev, word), 0) - d, 0.0) / h
        return math.log(seen + d * self._followers[prev] / h * self._unigram_prob(word))

    # ------------------------------------------------------------------ file
    def save(self, path: Path) -> None:
        doc = {"format": FORMAT, "version": VERSION, "discount": self.discount, "unigram_k": self.unigram_k,
               "vocab_size": self.vocab_size, "unigrams": self.unigrams,
               "bigrams": sorted([a, b, c] for (a, b), c in self.bigrams.items())}
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"), sort_keys=True)

    @classmethod
    def load(cls, path: Path) -> "WordBigramLM":
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, EOFError, ValueError) as e:
            raise ValueError(f"{path}: not a gzip-compressed JSON word bigram file ({e})") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{path}: format is not {FORMAT!r}")
        if doc.get("version") != VERSION:
            raise ValueError(f"{path}: version {doc.get('version')!r} is not {VERSION}")
        uni, rows = doc.get("unigrams"), doc.get("bigrams")
        if not isinstance(uni, dict) or not all(isinstance(k, str) and _count(v) for k, v in uni.items()):
            raise ValueError(f"{path}: unigrams must map words to positive integer counts")
        if not isinstance(rows, list) or not all(
                isinstance(r, list) and len(r) == 3 and isinstance(r[0], str) and isinstance(r[1], str) and _count(r[2])
                for r in rows):
            raise ValueError(f"{path}: bigrams must be [previous word, word, positive count] rows")
        try:
            return cls(uni, {(a, b): c for a, b, c in rows}, discount=doc.get("discount", 0.75),
                       unigram_k=doc.get("unigram_k", 0.1), vocab_size=doc.get("vocab_size", 200_000))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from e


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0
