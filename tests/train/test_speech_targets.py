"""The projector's targets: CTC forced alignment, token frames and audio positions
(``specserve.train.speech_targets``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.train.speech_targets import ctc_forced_alignment, token_frames, token_slots


def _peaked(path: list[int], classes: int = 6) -> np.ndarray:
    x = np.full((len(path), classes), -8.0)
    x[np.arange(len(path)), path] = 0.0
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@st.composite
def _paths(draw):
    labels = draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    path, starts = [], []
    for k, lab in enumerate(labels):
        blanks = draw(st.integers(1 if k and labels[k - 1] == lab else 0, 2))
        path += [0] * blanks
        starts.append(len(path))
        path += [lab] * draw(st.integers(1, 3))
    path += [0] * draw(st.integers(0, 2))
    return labels, path, starts


@settings(max_examples=60, deadline=None)
@given(_paths())
def test_alignment_finds_the_first_frame_of_each_label_on_peaked_posteriors(case):
    labels, path, starts = case
    assert ctc_forced_alignment(_peaked(path), labels) == starts


def test_alignment_follows_the_labels_not_the_argmax():
    # the argmax path says 1 2, the labels say 1 3: 3 is placed where it is least unlikely
    logp = _peaked([1, 0, 2, 0])
    logp[2, 3] = -2.0
    assert ctc_forced_alignment(logp, [1, 3]) == [0, 2]


def test_alignment_refuses_too_few_frames():
    with pytest.raises(ValueError):
        ctc_forced_alignment(_peaked([1, 0, 1]), [1, 1, 1])
    assert ctc_forced_alignment(_peaked([1, 0]), []) == []


def test_a_token_sits_at_its_first_letter_not_its_leading_space():
    text = "ab cd"
    frames = [3, 4, 9, 12, 13]  # one per character; the space's frame is never used
    assert token_frames([(0, 2), (2, 5)], text, frames) == [3, 12]


def test_tokens_take_their_windows_first_free_positions_and_overflow_moves_on():
    # windows of 15 frames, 3 positions each; frames 0, 2, 5, 7 all in window 0: the 4th
    # token overflows into window 1; a token of window 3 goes to its first position
    assert token_slots([0, 2, 5, 7, 47], 60, 15, 3) == [0, 1, 2, 3, 9]
    # the last position is the limit
    assert token_slots([58, 59], 60, 15, 3) == [9, 10]
    assert token_slots([], 60, 15, 3) == []


def test_alignment_of_a_long_transcript():
    labels = [1 + k % 5 for k in range(90)]  # 181 path states: past int8 indices
    path, starts = [], []
    for lab in labels:
        path.append(0)
        starts.append(len(path))
        path += [lab, lab]
    assert ctc_forced_alignment(_peaked(path), labels) == starts
