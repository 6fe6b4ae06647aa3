"""Split a long recording into clips at low-energy points.

A recording longer than ``max_clip_s`` is cut into consecutive segments of at most
that length.  Each cut is placed at the quietest point (the lowest mean energy over a
short window, 20 ms by default) within the last ``overlap_s`` seconds before the clip
limit, so a cut falls in a pause where one is near, not in the middle of a word.  The
segments do not overlap each other: their texts join in order.  No torch.
"""

from __future__ import annotations

import numpy as np

from specserve.audio import SAMPLE_RATE


def split_points(samples: np.ndarray, max_clip_s: float, overlap_s: float = 1.0, window_s: float = 0.02,
                 rate: int = SAMPLE_RATE) -> list[int]:
    """Sample indexes where the recording is cut (empty when it fits in one clip)."""
    if max_clip_s <= 0:
        raise ValueError(f"max_clip_s: must be > 0, got {max_clip_s}")
    n = len(samples)
    clip = int(max_clip_s * rate)
    overlap = max(1, min(int(overlap_s * rate), clip // 2))
    win = max(1, int(window_s * rate))
    energy = np.asarray(samples, dtype=np.float64) ** 2
    csum = np.concatenate([[0.0], np.cumsum(energy)])
    cuts: list[int] = []
    start = 0
    while n - start > clip:
        lo, hi = start + clip - overlap, start + clip  # the cut lies in [lo, hi]
        # mean energy of the window centred on each candidate point
        cand = np.arange(lo, hi + 1)
        a = np.clip(cand - win // 2, 0, n)
        b = np.clip(cand + win - win // 2, 0, n)
        mean = (csum[b] - csum[a]) / np.maximum(b - a, 1)
        cut = int(cand[int(np.argmin(mean))])  # the first quietest point
        cuts.append(cut)
        start = cut
    return cuts


def split_audio(samples: np.ndarray, max_clip_s: float, overlap_s: float = 1.0,
                rate: int = SAMPLE_RATE) -> list[tuple[int, int]]:
    """(start, end) sample ranges covering the recording, each at most ``max_clip_s`` long."""
    bounds = [0, *split_points(samples, max_clip_s, overlap_s, rate=rate), len(samples)]
    return list(zip(bounds[:-1], bounds[1:]))
