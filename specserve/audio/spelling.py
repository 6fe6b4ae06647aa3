"""Spelling of a CTC transcript with the text model's own vocabulary (``method.ctc_spelling``).

A character CTC encoder trained on little text spells by sound ("cote", "becide") and puts
word boundaries in the wrong places ("leftopen", "d inner").  The words a byte-pair or
sentencepiece tokenizer holds as single word-initial tokens (``Ġword`` / ``▁word``) are a
lexicon the text model already has, with a frequency order for free: tokens are numbered
in merge order, so a lower id is a more frequent word.

``VocabularySpeller.correct`` rewrites the words of a lowercase transcript by a dynamic
programme over them, at the least total cost:

* a lexicon word stays (cost 0), and so does a contraction of one ("i'm", "it's", "can't":
  the letters before its apostrophe are a lexicon word; byte-pair vocabularies hold the
  clitics as tokens of their own, not the contracted words);
* a word outside the lexicon stays (``oov_cost``), or becomes the nearest lexicon word by
  Levenshtein distance, at most a third of its length and at least 1 (cost: the distance;
  ties go to a word with the same first letter, then to the more frequent word: "yess" is
  "yes", not "less"), or splits into two lexicon words (``split_cost``);
* two neighbours, one of them outside the lexicon or a single letter, join into a lexicon
  word, or the nearest one (``merge_cost`` plus the distance).

With a word bigram model (``lm``: ``audio.word_lm``, the speech model's
``specserve.spelling_lm``), the programme also weighs each choice in context: every word,
a lexicon word too, may become one of its ``num_candidates`` nearest lexicon words by
``sound_distance`` (an edit distance where vowels, similar consonants, quiet and doubled
letters cost less; cost: ``edit_weight`` times the distance, plus ``change_cost`` for a
lexicon word), a plural
its possessive ("farmers" -> "farmer's", ``possessive_cost``), and the whole sentence's
words pay ``lm_weight`` times their negative log probability under the model (a Viterbi
search over the last word written), so "by food" becomes "buy food" where the counts say
so.  Joins then look for a lexicon word within a quarter of the joined length (a third
without the model).

Words holding anything but lowercase letters and apostrophes are left as they are, so a
transcript with case and punctuation keeps them.  One call makes at most ``max_searches``
nearest-word searches (about a millisecond each; a word met twice in it is searched once,
and nothing is kept from one call to the next, so no transcript's timing reveals another's
words), so a long or garbled transcript cannot hold the engine thread: the words past that
budget stay; with a word model, at most ``max_rescored`` candidates a call are rescored by
``sound_distance``.  The speller changes drafts only: with
``ctc_acceptance: exact`` the output is still plain decoding's; in relaxed mode it is the
text the entropy gate settles with and the hypothesis the first pass verifies.
"""

from __future__ import annotations

import bisect
import heapq
import re
from typing import Any

from rapidfuzz import process
from rapidfuzz.distance import Levenshtein

_WORD = re.compile(r"[a-z']+")
_MARKERS = ("Ġ", "▁")  # byte-level BPE and sentencepiece word starts


def vocabulary_lexicon(tokenizer: Any) -> dict[str, int]:
    """word -> rank (the lowest token id spelling it) of the tokenizer's word-initial tokens
    made of lowercase letters and apostrophes (two letters or more, and "a", "i")."""
    lex: dict[str, int] = {}
    for tok, i in tokenizer.get_vocab().items():
        if not tok or tok[0] not in _MARKERS:
            continue
        w = tok[1:]
        if _WORD.fullmatch(w) and w.strip("'") and (len(w) > 1 or w in ("a", "i")) and i < lex.get(w, 1 << 62):
            lex[w] = int(i)
    return lex


_VOWELS = frozenset("aeiouy")
_QUIET = frozenset("ehwu")  # letters spelling often adds or drops without a sound of their own
_NEAR = (frozenset("ck"), frozenset("cs"), frozenset("sz"), frozenset("fv"), frozenset("dt"), frozenset("bp"),
         frozenset("gk"))
MAX_RESCORED = 200  # candidates a search rescores by sound_distance


def _substitution(a: str, b: str) -> float:
    if a == b:
        return 0.0
    if a in _VOWELS and b in _VOWELS:
        return 0.5
    return 0.6 if any(a in pair and b in pair for pair in _NEAR) else 1.0


_LETTERS = "abcdefghijklmnopqrstuvwxyz'"
_SUBSTITUTION = {(x, y): _substitution(x, y) for x in _LETTERS for y in _LETTERS}


def _indels(word: str) -> list[float]:
    """What adding or dropping each letter of ``word`` costs."""
    out = []
    for i, c in enumerate(word):
        if c in _QUIET:
            out.append(0.5)
        elif (i > 0 and word[i - 1] == c) or (i + 1 < len(word) and word[i + 1] == c):
            out.append(0.3)  # a doubled letter
        else:
            out.append(1.0)
    return out


def sound_distance(a: str, b: str, cutoff: float = float("inf")) -> float:
    """An edit distance weighted for spelling by sound: a vowel for a vowel costs 0.5, a
    consonant for a similar one (c/k, c/s, s/z, f/v, d/t, b/p, g/k) 0.6, adding or dropping
    e, h, w or u 0.5 and a doubled letter 0.3, anything else 1 ("windo" -> "window" 0.5,
    "newn" -> "noon" 1.3, "dauter" -> "daughter" 1.5); past ``cutoff`` it stops and
    returns infinity."""
    ia, ib = _indels(a), _indels(b)
    prev = [0.0]
    for c in ib:
        prev.append(prev[-1] + c)
    for i, x in enumerate(a):
        cost_a = ia[i]
        cur = [prev[0] + cost_a]
        for j, y in enumerate(b):
            sub = _SUBSTITUTION.get((x, y))
            if sub is None:
                sub = _substitution(x, y)
            cur.append(min(prev[j + 1] + cost_a, cur[j] + ib[j], prev[j] + sub))
        if min(cur) > cutoff:  # every path through this row already costs more
            return float("inf")
        prev = cur
    return prev[-1] if prev[-1] <= cutoff else float("inf")


class VocabularySpeller:
    def __init__(self, lexicon: dict[str, int], oov_cost: float = 1.6, split_cost: float = 1.2,
                 merge_cost: float = 0.5, max_searches: int = 64, max_word_len: int = 24, lm: Any = None,
                 lm_weight: float = 0.15, edit_weight: float = 1.0, change_cost: float = 0.5,
                 possessive_cost: float = 0.5, num_candidates: int = 12, max_rescored: int = 1200):
        if not lexicon:
            raise ValueError("the lexicon is empty (the tokenizer has no word-initial lowercase tokens)")
        self.rank = lexicon
        self.oov_cost, self.split_cost, self.merge_cost = oov_cost, split_cost, merge_cost
        # the work one transcript may cost the engine thread: nearest-word searches (about a
        # millisecond each) per call, and no search for longer words (no lexicon word is near)
        self.max_searches, self.max_word_len = max_searches, max_word_len
        self.lm, self.lm_weight, self.edit_weight = lm, lm_weight, edit_weight
        self.change_cost, self.possessive_cost, self.num_candidates = change_cost, possessive_cost, num_candidates
        self._words = sorted(lexicon, key=len)  # by length: the candidates of a length range are a slice
        self._lengths = [len(w) for w in self._words]
        self._cache: dict[tuple[str, int], list[tuple[str, float]] | None] = {}
        self._searches = self._rescored = 0
        # with a word model, candidates rescored by sound_distance per call (about 30 us
        # each); past it a search scores by Levenshtein's distance alone
        self.max_rescored = max_rescored

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **kw: Any) -> "VocabularySpeller":
        return cls(vocabulary_lexicon(tokenizer), **kw)

    def _search(self, word: str, limit: int) -> list[tuple[str, float]] | None:
        """Lexicon words within ``limit`` of ``word``, nearest first (ties: the same first
        letter, then the more frequent word); None past the call's search budget.  The
        distance is Levenshtein's, or, with a word model, ``sound_distance`` over the
        ``MAX_RESCORED`` nearest by Levenshtein's within half the word's length (while the
        call's ``max_rescored`` lasts)."""
        key = (word, limit)
        if key in self._cache:
            return self._cache[key]
        if len(word) > self.max_word_len or self._searches >= self.max_searches:
            return None
        self._searches += 1
        wide = max(limit, (len(word) + 1) // 2) if self.lm is not None else limit
        lo = bisect.bisect_left(self._lengths, len(word) - wide)
        hi = bisect.bisect_right(self._lengths, len(word) + wide)
        hits = process.extract(word, self._words[lo:hi], scorer=Levenshtein.distance, score_cutoff=wide, limit=None)
        if self.lm is not None:
            hits = heapq.nsmallest(MAX_RESCORED, hits, key=lambda h: (h[1], self.rank[h[0]], h[0]))
            k = max(0, min(len(hits), self.max_rescored - self._rescored))  # the call's budget left
            self._rescored += k
            scored = [(h[0], sound_distance(word, h[0], limit)) for h in hits[:k]] + [(h[0], float(h[1])) for h in hits[k:]]
            scored = [h for h in scored if h[1] <= limit]
        else:
            scored = [(h[0], int(h[1])) for h in hits]
        found = sorted(scored, key=lambda h: (h[1], h[0][:1] != word[:1], self.rank[h[0]], h[0]))
        self._cache[key] = found
        return found

    def nearest(self, word: str) -> tuple[str, float] | None:
        """The nearest lexicon word within a third of ``word``'s length (at least 1) and its
        distance; None when there is none."""
        found = self._search(word, max(1, len(word) // 3))
        return found[0] if found else None

    def _known(self, word: str) -> bool:
        """A lexicon word, or a contraction of one."""
        stem, apostrophe, _ = word.partition("'")
        return word in self.rank or (bool(apostrophe) and stem in self.rank)

    def _options(self, words: list[str], plain: list[bool], i: int) -> list[tuple[int, list[str], float]]:
        """What the words from ``i`` may become: (words consumed, words written, cost)."""
        w, n, lm = words[i], len(words), self.lm is not None
        options: list[tuple[int, list[str], float]] = []
        known = not plain[i] or self._known(w)
        options.append((1, [w], 0.0 if known else self.oov_cost))
        if plain[i] and lm:
            for cand, dist in (self._search(w, max(1, len(w) // 3)) or [])[: self.num_candidates]:
                if cand != w:
                    options.append((1, [cand], self.edit_weight * dist + (self.change_cost if known else 0.0)))
            if w.endswith("s") and "'" not in w and w[:-1] in self.rank:
                options.append((1, [w[:-1] + "'s"], self.edit_weight * self.possessive_cost))
        elif not known:
            near = self.nearest(w)
            if near is not None:
                options.append((1, [near[0]], float(near[1])))
        if not known:
            for k in range(2, len(w) - 1):
                if w[:k] in self.rank and w[k:] in self.rank:
                    options.append((1, [w[:k], w[k:]], self.split_cost))
        if i + 1 < n:
            v = words[i + 1]
            odd = not self._known(w) or not self._known(v) or len(w) == 1 or len(v) == 1
            if plain[i] and plain[i + 1] and odd:
                m = w + v
                if m in self.rank:
                    options.append((2, [m], self.merge_cost))
                else:
                    found = self._search(m, max(1, len(m) // (4 if lm else 3)))
                    if found:
                        options.append((2, [found[0][0]], self.edit_weight * found[0][1] + self.merge_cost))
        return options

    def correct(self, text: str) -> str:
        """``text`` with its words respelt (single spaces between them)."""
        words = text.split()
        n = len(words)
        if n == 0:
            return text
        self._searches = self._rescored = 0
        self._cache = {}  # per call: what one transcript looked up never speeds up another's
        plain = [bool(_WORD.fullmatch(w)) for w in words]  # only such words are respelt or joined
        if self.lm is not None:
            return " ".join(self._viterbi(words, plain))
        inf = float("inf")
        cost = [inf] * (n + 1)
        back: list[tuple[int, list[str]] | None] = [None] * (n + 1)
        cost[0] = 0.0
        for i in range(n):
            for k, out, c in self._options(words, plain, i):
                if cost[i] + c < cost[i + k]:
                    cost[i + k] = cost[i] + c
                    back[i + k] = (i, out)
        result: list[str] = []
        j = n
        while j > 0:
            i, out = back[j]  # type: ignore[misc]
            result[:0] = out
            j = i
        return " ".join(result)

    def _viterbi(self, words: list[str], plain: list[bool]) -> list[str]:
        """The least-cost respelling with the word model's cost in it: states are (words
        consumed, last word written)."""
        from specserve.audio.word_lm import BOS, EOS

        lm, weight, n = self.lm, self.lm_weight, len(words)
        # per position: last word -> (cost, back pointer (position, last word), words written)
        states: list[dict[str, tuple[float, tuple[int, str] | None, list[str]]]] = [{} for _ in range(n + 1)]
        states[0][BOS] = (0.0, None, [])
        for i in range(n):
            if not states[i]:
                continue
            options = self._options(words, plain, i)
            for last, (cost, _, _) in list(states[i].items()):
                for k, out, c in options:
                    total, prev = cost + c, last
                    for w in out:
                        total -= weight * lm.log_prob(prev, w)
                        prev = w
                    held = states[i + k].get(prev)
                    if held is None or total < held[0]:
                        states[i + k][prev] = (total, (i, last), out)
        final = min(states[n].items(), key=lambda kv: (kv[1][0] - weight * lm.log_prob(kv[0], EOS), kv[0]))
        result: list[str] = []
        j, last = n, final[0]
        while j > 0:
            _, pointer, out = states[j][last]
            result[:0] = out
            j, last = pointer  # type: ignore[misc]
        return result
