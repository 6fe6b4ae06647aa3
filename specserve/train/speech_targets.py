"""Where the transcript's tokens sit in a recording's audio positions: the targets of the
embedded speech model's projector (``specserve.train.speech``).

* ``ctc_forced_alignment``: the Viterbi path of a CTC over its labels (log posteriors per
  frame, blank 0) constrained to spell a given label sequence: the frame at which each
  label is emitted.
* ``token_frames``: the frame of each text-model token of a transcript: the frame of its
  first character that is not a space (the tokenizer's character offsets).
* ``token_slots``: each token's audio position.  The projector turns every window of
  ``window_size`` encoder frames into ``num_queries`` positions; a token belongs to the
  window holding its frame and takes that window's first free position, in order (a
  window with more tokens than positions passes the rest on to the next).  The other
  positions are filler.

No torch: numpy only.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

_NEG = -1e30


def ctc_forced_alignment(logp: np.ndarray, labels: Sequence[int], blank: int = 0) -> list[int]:
    """(frames, classes) log posteriors and the labels they must spell -> the first frame
    of each label's emission on the most likely path.  Needs frames >= the path's minimum
    length (labels plus one blank between equal neighbours); raises ValueError otherwise."""
    T, L = logp.shape[0], len(labels)
    if L == 0:
        return []
    need = L + sum(1 for a, b in zip(labels, labels[1:]) if a == b)
    if T < need:
        raise ValueError(f"{T} frames cannot spell {L} labels ({need} frames needed)")
    ext = np.full(2 * L + 1, blank, dtype=np.int64)
    ext[1::2] = labels
    S = ext.shape[0]
    lp = logp[:, ext].astype(np.float64)
    skip = np.zeros(S, dtype=bool)  # s may come from s - 2: a label unlike the one before it
    skip[3::2] = ext[3::2] != ext[1:-2:2]
    dp = np.full(S, _NEG)
    dp[0], dp[1] = lp[0, 0], lp[0, 1]
    back = np.zeros((T, S), dtype=np.int8)
    for t in range(1, T):
        stay = dp
        step1 = np.concatenate(([_NEG], dp[:-1]))
        step2 = np.where(skip, np.concatenate(([_NEG, _NEG], dp[:-2])), _NEG)
        choice = np.stack([stay, step1, step2])
        arg = choice.argmax(axis=0)
        back[t] = arg
        dp = choice[arg, np.arange(S)] + lp[t]
    s = S - 1 if dp[S - 1] >= dp[S - 2] else S - 2
    path = np.zeros(T, dtype=np.int64)
    for t in range(T - 1, -1, -1):
        path[t] = s
        s -= int(back[t, s])
    frames = [-1] * L
    for t in range(T):
        s = int(path[t])
        if s % 2 == 1 and frames[s // 2] < 0:
            frames[s // 2] = t
    return frames


def token_frames(offsets: Sequence[tuple[int, int]], text: str, char_frames: Sequence[int]) -> list[int]:
    """The frame of each token (character ``offsets`` into ``text``, whose characters were
    aligned to ``char_frames``): its first non-space character's."""
    out = []
    for a, b in offsets:
        chars = [i for i in range(a, b) if text[i] != " "] or list(range(a, b)) or [min(a, len(text) - 1)]
        out.append(int(char_frames[chars[0]]))
    return out


def token_slots(frames: Sequence[int], num_frames: int, window_size: int, num_queries: int) -> list[int]:
    """Each token's audio position (see the module's docstring)."""
    num_slots = num_queries * -(-num_frames // window_size)
    slots, nxt = [], 0
    for f in frames:
        s = min(max(nxt, (f // window_size) * num_queries), num_slots - 1)
        slots.append(s)
        nxt = s + 1
    return slots


def transcript_targets(tok: Any, text: str, logp: np.ndarray, window_size: int, num_queries: int) -> tuple[list[int], list[int]]:
    """(token ids, audio positions) of ``text`` in a recording with these CTC log posteriors
    (code-point labels); tokens past the last position share it (the caller may drop
    such recordings)."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    chars = ctc_forced_alignment(logp, [ord(c) for c in text])
    frames = token_frames(enc.offset_mapping, text, chars)
    return list(enc.input_ids), token_slots(frames, logp.shape[0], window_size, num_queries)
