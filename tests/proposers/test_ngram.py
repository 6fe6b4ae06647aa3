from __future__ import annotations

import numpy as np

from specserve.proposers.ngram import ngram_lookup


def L(*xs):
    return np.array(xs, dtype=np.int64)


def test_longest_ngram_wins_over_a_shorter_earlier_match():
    # last 2 tokens (7, 8) occur at index 1; last 3 (6, 7, 8) occur at index 5 -> the 3-gram wins.
    toks = L(1, 7, 8, 100, 2, 6, 7, 8, 200, 201, 6, 7, 8)
    assert ngram_lookup(toks, 2, 3, 2) == [200, 201]


def test_earliest_occurrence_is_used():
    toks = L(5, 6, 1, 2, 5, 6, 3, 4, 5, 6)
    assert ngram_lookup(toks, 2, 2, 2) == [1, 2]


def test_proposal_stops_at_the_end_of_context():
    toks = L(9, 9, 9)
    # last 2 = (9, 9) first occurs at 0, followed by a single 9.
    assert ngram_lookup(toks, 2, 2, 5) == [9]


def test_nothing_when_context_shorter_than_min_or_no_repeat():
    assert ngram_lookup(L(1, 2), 3, 5, 4) == []
    assert ngram_lookup(L(1, 2, 3, 4, 5), 1, 3, 4) == []


def test_min_window_is_respected():
    toks = L(4, 1, 2, 3, 4)
    assert ngram_lookup(toks, 1, 1, 3) == [1, 2, 3]
    assert ngram_lookup(toks, 2, 3, 3) == []
