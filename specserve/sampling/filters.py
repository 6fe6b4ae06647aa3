"""The sampling filters (temperature, top-k, top-p, min-p) and inverse-CDF sampling.

Everything here is vectorised over the rows of a batch: one row per request, or
one row per (request, position) when verifying speculative drafts.  Per-row
parameters live in :class:`SamplingTensors`; its Python-side flags let the hot
path skip work nobody asked for (no sort when no row uses top-k/top-p).

Sampling is by inverse CDF from caller-supplied uniforms: the engine's are keyed by
(request seed, output position, purpose) (``specserve.sampling.philox.keyed_uniforms``),
so a seeded request gets the same tokens whatever batch it lands in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.request import GREEDY_EPS

__all__ = ["SamplingTensors", "logits_to_probs", "sample_from_probs"]


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as device tensors, plus flags for the hot path."""

    temperature: Tensor  # [N] float32; < GREEDY_EPS (0 included) = greedy
    top_k: Tensor  # [N] int64; 0 = off
    top_p: Tensor  # [N] float32; 1.0 = off
    min_p: Tensor  # [N] float32; 0.0 = off
    greedy: Tensor  # [N] bool; temperature < GREEDY_EPS
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        min_ps: Sequence[float],
        device: torch.device | str = "cpu",
    ) -> "SamplingTensors":
        """Build from per-row Python lists (all of the same length N >= 1).

        ``top_k`` of 0 or -1 means off; ``top_p`` must be in (0, 1]; ``min_p`` in [0, 1].
        """
        n = len(temperatures)
        for name, values in (("top_ks", top_ks), ("top_ps", top_ps), ("min_ps", min_ps)):
            if len(values) != n:
                raise ValueError(f"{name}: expected {n} values (one per row, like temperatures), got {len(values)}")
        if n == 0:
            raise ValueError("temperatures: need at least one row")
        temps = [float(t) for t in temperatures]
        ks = [int(k) for k in top_ks]
        ps = [float(p) for p in top_ps]
        mps = [float(m) for m in min_ps]
        if any(not t >= 0.0 for t in temps):  # also rejects NaN
            raise ValueError(f"temperatures: must be >= 0, got {temps}")
        if any(k < -1 for k in ks):
            raise ValueError(f"top_ks: must be -1 or 0 (off) or > 0, got {ks}")
        if any(not 0.0 < p <= 1.0 for p in ps):
            raise ValueError(f"top_ps: must be in (0, 1], got {ps}")
        if any(not 0.0 <= m <= 1.0 for m in mps):
            raise ValueError(f"min_ps: must be in [0, 1], got {mps}")
        ks = [max(k, 0) for k in ks]
        greedy = [t < GREEDY_EPS for t in temps]
        sampled = [not g for g in greedy]
        # Filters on greedy rows are moot (they become one-hot), so they do not set the flags.
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(ks, dtype=torch.int64, device=device),
            top_p=torch.tensor(ps, dtype=torch.float32, device=device),
            min_p=torch.tensor(mps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_k=any(k > 0 and s for k, s in zip(ks, sampled)),
            any_top_p=any(p < 1.0 and s for p, s in zip(ps, sampled)),
            any_min_p=any(m > 0.0 and s for m, s in zip(mps, sampled)),
        )

    def repeat_interleave(self, repeats: int) -> "SamplingTensors":
        """Each row repeated ``repeats`` times (e.g. K+1 verification positions per request)."""
        if repeats < 1:
            raise ValueError(f"repeats: must be >= 1, got {repeats}")
        rep = lambda t: t.repeat_interleave(repeats, dim=0)  # noqa: E731
        return SamplingTensors(
            temperature=rep(self.temperature), top_k=rep(self.top_k), top_p=rep(self.top_p),
            min_p=rep(self.min_p), greedy=rep(self.greedy), all_greedy=self.all_greedy,
            any_greedy=self.any_greedy, any_top_k=self.any_top_k, any_top_p=self.any_top_p,
            any_min_p=self.any_min_p,
        )


def _one_hot_argmax(logits: Tensor) -> Tensor:
    # [N, V] -> [N, V] float32 with a single 1 at the (first) argmax of each row
    out = torch.zeros_like(logits, dtype=torch.float32)
    out.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return out


def logits_to_probs(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Processed probabilities [N, V] float32 from raw logits [N, V].

    Order: temperature, top-k (ties with the k-th value are kept), top-p (the
    smallest prefix of the sorted distribution whose mass reaches top_p; the top
    token always stays), min-p (keep p >= min_p * p_max), renormalise.  Greedy
    rows (temperature 0) become one-hot at the argmax of the raw logits.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [N, V], got shape {tuple(logits.shape)}")
    n, v = logits.shape
    if st.num_rows != n:
        raise ValueError(f"st: has {st.num_rows} rows but logits has {n}")
    if st.temperature.device != logits.device:
        raise ValueError(f"st: tensors on {st.temperature.device} but logits on {logits.device}")
    logits = logits.float()
    if st.all_greedy:
        return _one_hot_argmax(logits)

    temp = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature)  # [N]
    # Shift by the row maximum first: the largest scaled logit is then exactly 0, so a
    # small temperature sends the others towards -inf without overflowing to NaN.
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temp[:, None]  # [N, V]

    if st.any_top_k or st.any_top_p:
        sorted_vals, sorted_idx = scaled.sort(dim=-1, descending=True)  # [N, V] each
        remove = torch.zeros_like(sorted_vals, dtype=torch.bool)  # [N, V], sorted order
        if st.any_top_k:
            k = st.top_k.clamp(max=v)
            k = torch.where(k > 0, k, torch.full_like(k, v))  # [N]; off => keep all
            kth = sorted_vals.gather(1, (k - 1)[:, None])  # [N, 1]
            remove |= sorted_vals < kth
        if st.any_top_p:
            sp = sorted_vals.masked_fill(remove, float("-inf")).softmax(dim=-1)  # [N, V]
            mass_before = sp.cumsum(dim=-1) - sp  # mass strictly above each token
            remove |= (mass_before >= st.top_p[:, None]) & (st.top_p < 1.0)[:, None]
            remove[:, 0] = False
        # back to vocabulary order
        remove = torch.zeros_like(remove).scatter_(1, sorted_idx, remove)
        scaled = scaled.masked_fill(remove, float("-inf"))

    probs = scaled.softmax(dim=-1)  # [N, V]
    if st.any_min_p:
        p_max = probs.amax(dim=-1, keepdim=True)  # [N, 1]
        probs = probs.masked_fill(probs < st.min_p[:, None] * p_max, 0.0)
        # Renormalise only the rows min-p touched: a row's bits must not depend on its neighbours.
        probs = torch.where((st.min_p > 0)[:, None], probs / probs.sum(dim=-1, keepdim=True), probs)
    if st.any_greedy:
        probs = torch.where(st.greedy[:, None], _one_hot_argmax(logits), probs)
    return probs


def sample_from_probs(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Tokens [N] int64 by inverse CDF: the first index whose running mass exceeds u * total.

    ``probs`` [N, V] need not be normalised (only non-negative); ``uniforms`` [N]
    in [0, 1).  The running sum is taken in float64 so the Triton kernel, which
    sums block by block, picks the same token.  A zero-probability token is never
    returned; if rounding leaves u * total at or above the last running sum the
    last token with positive mass is returned.  An all-zero row returns 0.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs: expected [N, V], got shape {tuple(probs.shape)}")
    if uniforms.shape != probs.shape[:1]:
        raise ValueError(f"uniforms: expected shape ({probs.shape[0]},), got {tuple(uniforms.shape)}")
    if uniforms.device != probs.device:
        raise ValueError(f"uniforms: on {uniforms.device} but probs on {probs.device}")
    if probs.shape[1] == 0:
        raise ValueError("probs: vocabulary dimension is empty")
    positive = probs > 0  # [N, V]
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    target = uniforms.double() * cdf[:, -1]  # [N]
    hit = (cdf > target[:, None]) & positive  # [N, V]
    first = hit.to(torch.uint8).argmax(dim=-1)  # first True (argmax returns the first maximum)
    # last index with positive mass; 0 for an all-zero row
    idx = torch.arange(probs.shape[1], device=probs.device)
    last = torch.where(positive, idx, torch.zeros_like(idx)).amax(dim=-1)
    return torch.where(hit.any(dim=-1), first, last).to(torch.int64)

