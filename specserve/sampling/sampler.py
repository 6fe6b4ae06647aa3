"""Sampling and draft verification on the device: one step, one packed result, one copy to the host.

What one call does
------------------
:func:`verify_step` takes the logits of a step's forward and, for every request b of
the batch, the rows to read and its drafts, and returns ONE int64 tensor::

    packed: (B, K+2) int64
        packed[b, :K+1]  output tokens: the accepted drafts, then the recovered/bonus token, -1 after
        packed[b, K+1]   num_accepted[b] in 0..num_drafts[b]; request b emits packed[b, :num_accepted[b] + 1]

K = 0 is plain decoding (one sampled token per request).  The steps, all on the
device, shape-static and free of host synchronisation:

1. gather the verified rows: ``logits[row_index]``, (B, K+1, V);
2. greedy rows (temperature < GREEDY_EPS) take the argmax of the raw logits;
   sampled rows get temperature, top-k (ties with the k-th value kept), top-p
   and min-p (:func:`process_logits`, a row-wise wrapper of
   :func:`specserve.sampling.filters.logits_to_probs`);
3. uniforms, keyed by output position (:func:`keyed_uniforms`): the inverse-CDF
   draws ``u(seed, position + j, SAMPLE)`` for j = 0..K and the accept tests
   ``u(seed, position + j, ACCEPT)`` for j < K (:class:`RejectionUniforms`; block
   verification's accept tests are keyed by the step instead: :func:`step_uniforms`);
4. verification by :func:`specserve.sampling.rejection.verify_chain`, the one
   verification API (its torch reference, or on CUDA the Triton kernel of
   :mod:`specserve.kernels.rejection_kernel` for strict/probabilistic).  When every
   row is greedy (and the method is not synthetic) the probabilities are skipped:
   the target's tokens are ``argmax`` and drafts are accepted while they match
   (``verify_chain(target_tokens=...)``).  Under ``probabilistic`` and ``block``, rows whose
   drafts carry no distribution (n-gram, suffix, predictions, argmax drafters)
   are verified strictly: see below.

The tests feed ``verify_chain`` the probabilities of ``logits_to_probs`` and the same
keyed uniforms, request by request, and check the tokens are the same.

Random numbers: keyed, never consumed
-------------------------------------
Every request has a 64-bit ``seed`` (int64 pattern, :func:`seed_to_int64`) and,
each step, a ``position``: the output index of its first verified token (the
number of tokens it has generated so far).  The number deciding the token at
output position m is ``u(seed, m, SAMPLE)`` however that position is reached --
as a draft, as the bonus token, or by a plain step -- so nothing depends on K,
on adaptive speculation, on the request's draft count or on its batch
neighbours.  Unseeded requests need a seed too: draw one per request at
admission (:func:`specserve.sampling.philox.random_seed`).

What a seeded request is guaranteed:

* ``strict`` (the default), and any row whose drafts carry no distribution: the
  emitted token at position m is the inverse-CDF sample of the target's
  processed distribution at m with ``u(seed, m, SAMPLE)`` -- a draft is accepted
  exactly when it equals that token.  So the tokens are plain decoding's tokens
  for that seed, bit for bit where the logits are (the batch-invariant fused CPU
  decoder); elsewhere a verification forward and a decode forward may differ in
  the last bits of the logits, which can flip a sample only where two tokens'
  cumulative probabilities straddle the uniform (a near-tie).
* ``probabilistic`` rows whose drafts carry q (drafters that sample): lossless
  (the emitted tokens follow the target distribution exactly) and reproducible
  for the same sequence of draft lengths (fixed K, any batch); the tokens are
  not plain decoding's, and with adaptive K they may differ from run to run,
  because whether a position is verified as a draft (accept test, residual) or
  as a bonus (plain sample) depends on the draft lengths chosen.
* ``block`` rows whose drafts carry q: lossless and reproducible as
  ``probabilistic`` is.  Its accept tests, and the drafts a proposer samples from q,
  read numbers keyed by the step's first position and their index in the step
  (``u(seed, position, purpose, lane)``, :func:`block_uniforms`): the block's outcome
  depends on every draft and test of the step, so those of positions past the
  emitted tokens must not be read again by the next step, which starts there.
* ``synthetic``: not lossless (benchmarking only).

Host flags
----------
:class:`SamplerFlags` (like :class:`SamplingTensors`' flags) select code paths
from Python values, never from device values.  They only skip work: with a flag
set where no row needs it the result is bit for bit the same (the min-p
renormalisation is applied row by row for that reason; ``logits_to_probs``
renormalises every row of the batch once any row uses min-p, which makes a
row's probabilities depend, in the last bit, on its neighbours).  So a captured
CUDA graph may use :meth:`SamplerFlags.conservative` and serve every batch.

Device buffers (:class:`DeviceSampler`)
---------------------------------------
For CUDA graphs every input lives in a persistent buffer preallocated for
``max_num_seqs`` rows: the per-request tensors, ``row_index``, ``draft_ids`` and
``num_drafts`` are written on the host into a pinned staging buffer and moved
by ONE non-blocking copy per step (``executor.staging.StagingBuffer``: two host
buffers in turn, each rewritten only after its previous copy's event); the packed
result comes back by ONE non-blocking copy into a pinned host buffer followed by
an event wait.  On the CPU the device reads the staging buffer itself and the
result is a plain copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

import specserve.sampling.rejection as rejection
from specserve.executor.staging import StagingBuffer, Transfer
from specserve.methods import Q_VERIFICATION_METHODS
from specserve.request import GREEDY_EPS
from specserve.sampling.filters import SamplingTensors, logits_to_probs
from specserve.sampling.philox import ACCEPT, SAMPLE, keyed_uniforms, seed_to_int64
from specserve.sampling.rejection import RejectionUniforms, check_method

__all__ = [
    "DeviceSampler",
    "RequestTensors",
    "SamplerFlags",
    "StepInputs",
    "block_uniforms",
    "process_logits",
    "step_uniforms",
    "unpack",
    "verify_step",
]


def step_uniforms(seed: Tensor, position: Tensor, K: int, method: str = "strict") -> RejectionUniforms:
    """The numbers of one verification step: row b's positions ``position[b] .. + K``.

    ``sample[b, j] = u(seed[b], position[b] + j, SAMPLE)`` (j <= K) and
    ``accept[b, j] = u(seed[b], position[b] + j, ACCEPT)`` (j < K).

    ``method="block"``: ``accept[b, j] = u(seed[b], position[b], ACCEPT, lane j + 1)``,
    keyed by the step's first position.  Block verification decides with all K tests,
    so the numbers of the positions past the emitted tokens are not independent of
    the outcome, and the next step (which starts right after them) must not read them
    again; its own first position differs, so its lanes are fresh.  The other methods
    read no number past the emitted position.
    """
    sample = keyed_uniforms(seed, position, K + 1, SAMPLE)
    if method == "block":
        return RejectionUniforms(accept=block_uniforms(seed, position, K, ACCEPT), sample=sample)
    return RejectionUniforms(accept=keyed_uniforms(seed, position, K, ACCEPT), sample=sample)


def block_uniforms(seed: Tensor, position: Tensor, n: int, purpose: int) -> Tensor:
    """(B, n) ``u(seed[b], position[b], purpose, lane j + 1)``: n numbers for the step that
    starts at ``position[b]``, none of them a positional number (lane 0) nor another
    step's (their first positions differ)."""
    B = seed.shape[0]
    lanes = torch.arange(1, n + 1, dtype=torch.int64, device=seed.device).repeat(B)[:, None]  # (B*n, 1)
    u = keyed_uniforms(seed.repeat_interleave(n), position.repeat_interleave(n), 1, purpose, lane=lanes)
    return u.view(B, n)


@dataclass(frozen=True)
class SamplerFlags:
    """Host-side flags that pick code paths; set them from Python values, never from device tensors.

    A flag may be set where no row needs it (same result, more work);
    ``all_greedy`` may only be True when every row is greedy.
    """

    all_greedy: bool = False
    any_greedy: bool = True
    any_top_k: bool = True
    any_top_p: bool = True
    any_min_p: bool = True

    @classmethod
    def conservative(cls) -> "SamplerFlags":
        """Every filter path on, not all greedy: right for any batch (e.g. one CUDA graph for all)."""
        return cls()

    @classmethod
    def from_lists(
        cls, temperatures: Sequence[float], top_ks: Sequence[int], top_ps: Sequence[float], min_ps: Sequence[float]
    ) -> "SamplerFlags":
        """The tight flags of a batch, by the rules of :meth:`SamplingTensors.build`.

        ``top_k`` <= 0 is off; filters on greedy rows do not count.
        """
        greedy = [float(t) < GREEDY_EPS for t in temperatures]
        sampled = [not g for g in greedy]
        return cls(
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_top_k=any(int(k) > 0 and s for k, s in zip(top_ks, sampled)),
            any_top_p=any(float(p) < 1.0 and s for p, s in zip(top_ps, sampled)),
            any_min_p=any(float(m) > 0.0 and s for m, s in zip(min_ps, sampled)),
        )


@dataclass
class RequestTensors:
    """Per-request sampling state of one step, on the device, plus the host flags."""

    temperature: Tensor  # (B,) float32; < GREEDY_EPS = greedy
    top_k: Tensor  # (B,) int64; 0 = off
    top_p: Tensor  # (B,) float32; 1.0 = off
    min_p: Tensor  # (B,) float32; 0.0 = off
    seed: Tensor  # (B,) int64: 64-bit Philox key (seed_to_int64)
    position: Tensor  # (B,) int64 >= 0: output index of the request's first verified token
    flags: SamplerFlags

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
        seeds: Sequence[int],
        positions: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> "RequestTensors":
        """From Python lists (validated like :meth:`SamplingTensors.build`), with tight flags.

        Allocates new tensors: for tests and eager use.  The step loop uses
        :meth:`DeviceSampler.prepare`, which fills persistent buffers.
        """
        st = SamplingTensors.build(temperatures, top_ks, top_ps, min_ps, device)  # validates the values
        seeds64, pos = _check_seeds_positions(seeds, positions, st.num_rows)
        return cls(
            temperature=st.temperature, top_k=st.top_k, top_p=st.top_p, min_p=st.min_p,
            seed=torch.tensor(seeds64, dtype=torch.int64, device=device),
            position=torch.tensor(pos, dtype=torch.int64, device=device),
            flags=SamplerFlags.from_lists(temperatures, top_ks, top_ps, min_ps),
        )


def _check_seeds_positions(seeds: Sequence[int], positions: Sequence[int], n: int) -> tuple[list[int], list[int]]:
    if len(seeds) != n or len(positions) != n:
        raise ValueError(f"seeds/positions: expected {n} values each (one per row), "
                         f"got {len(seeds)} and {len(positions)}")
    seeds64 = [seed_to_int64(int(s)) for s in seeds]
    pos = [int(o) for o in positions]
    if any(not 0 <= o < 2**62 for o in pos):
        raise ValueError(f"positions: must be in [0, 2**62), got {pos}")
    return seeds64, pos


def _rows(t: Tensor, repeats: int) -> Tensor:
    # (B,) -> (B * repeats,): each request's value on each of its verified positions
    return t[:, None].expand(t.shape[0], repeats).reshape(-1)


def process_logits(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, flags: SamplerFlags
) -> Tensor:
    """Processed probabilities (N, V) float32 from logits (N, V); per-row parameters (N,).

    Row by row equal to :func:`logits_to_probs` applied to that row alone:
    temperature, top-k, top-p by ``logits_to_probs`` itself, then min-p
    (keep p >= min_p * p_max, renormalise) on the rows with min_p > 0 only.
    Greedy rows are one-hot at the argmax of the raw logits.  Sync-free.
    """
    greedy = temperature < GREEDY_EPS  # (N,)
    st = SamplingTensors(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, greedy=greedy,
        all_greedy=flags.all_greedy, any_greedy=flags.any_greedy, any_top_k=flags.any_top_k,
        any_top_p=flags.any_top_p, any_min_p=False,
    )
    probs = logits_to_probs(logits, st)  # (N, V)
    if flags.any_min_p and not flags.all_greedy:
        # After the greedy one-hot: min-p leaves a one-hot row as it is (p_max = 1, min_p <= 1).
        p_max = probs.amax(dim=-1, keepdim=True)  # (N, 1)
        kept = probs.masked_fill(probs < min_p[:, None] * p_max, 0.0)  # (N, V)
        kept = kept / kept.sum(dim=-1, keepdim=True)
        probs = torch.where((min_p > 0.0)[:, None], kept, probs)
    return probs


def _check_verify_inputs(logits, row_index, draft_ids, num_drafts, req, draft_probs,
                         draft_has_q) -> tuple[int, int, int]:
    # Shapes, dtypes and devices only (host metadata): values are never read here.
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: expected (R, V) floating point, got {tuple(logits.shape)} {logits.dtype}")
    V = logits.shape[1]
    dev = logits.device
    if draft_ids.dim() != 2 or draft_ids.dtype != torch.int64 or draft_ids.device != dev:
        raise ValueError(f"draft_ids: expected (B, K) int64 on {dev}, got {tuple(draft_ids.shape)} "
                         f"{draft_ids.dtype} on {draft_ids.device}")
    B, K = draft_ids.shape
    for name, t, shape, dtype in (
        ("row_index", row_index, (B, K + 1), torch.int64),
        ("num_drafts", num_drafts, (B,), torch.int64),
        ("temperature", req.temperature, (B,), torch.float32),
        ("top_k", req.top_k, (B,), torch.int64),
        ("top_p", req.top_p, (B,), torch.float32),
        ("min_p", req.min_p, (B,), torch.float32),
        ("seed", req.seed, (B,), torch.int64),
        ("position", req.position, (B,), torch.int64),
    ):
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != dev:
            raise ValueError(f"{name}: expected {shape} {dtype} on {dev}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    if draft_probs is not None and (
        tuple(draft_probs.shape) != (B, K, V) or draft_probs.dtype != torch.float32 or draft_probs.device != dev
    ):
        raise ValueError(f"draft_probs: expected ({B}, {K}, {V}) float32 on {dev}, "
                         f"got {tuple(draft_probs.shape)} {draft_probs.dtype} on {draft_probs.device}")
    if draft_has_q is not None and (
        draft_probs is None or tuple(draft_has_q.shape) != (B,) or draft_has_q.dtype != torch.bool
        or draft_has_q.device != dev
    ):
        raise ValueError(f"draft_has_q: expected ({B},) bool on {dev} together with draft_probs, "
                         f"got {tuple(draft_has_q.shape)} {draft_has_q.dtype} on {draft_has_q.device}")
    if V == 0:
        raise ValueError("logits: vocabulary dimension is empty")
    return B, K, V


def verify_step(
    logits: Tensor,
    row_index: Tensor,
    draft_ids: Tensor,
    num_drafts: Tensor,
    req: RequestTensors,
    *,
    method: str = "strict",
    synthetic_acceptance_rate: float | None = None,
    draft_probs: Tensor | None = None,
    draft_has_q: Tensor | None = None,
    use_kernel: bool | None = None,
) -> Tensor:
    """Sample / verify every request of a step on the device; returns packed (B, K+2) int64.

    Args:
        logits: (R, V) float (any float dtype; processed in float32), the step's forward rows.
        row_index: (B, K+1) int64, row of ``logits`` for request b at verified position j;
            positions past num_drafts[b] repeat the last real row (they are never read).
        draft_ids: (B, K) int64, -1 beyond num_drafts[b].  K = 0: plain decoding.
        num_drafts: (B,) int64 in 0..K.
        req: per-request tensors (B,) and host flags.
        method: "strict", "probabilistic", "block" or "synthetic" (+ ``synthetic_acceptance_rate``).
        draft_probs: (B, K, V) float32 draft distributions for "probabilistic" and "block"; None =
            no row's drafts carry one (n-gram, suffix, argmax drafters): then every row
            is verified strictly (the same distribution as probabilistic with one-hot q,
            and the tokens of plain decoding for the request's seed).  Ignored by the others.
            Block verification has no kernel: it runs in torch on the logits' device.
        draft_has_q: (B,) bool with ``draft_probs``: which rows' drafts were sampled from
            their ``draft_probs`` row; the others are verified strictly.  None = all.
        use_kernel: None = the Triton kernel for strict/probabilistic when ``logits`` is on
            CUDA and triton imports; True forces it (CPU needs TRITON_INTERPRET=1); False = torch.

    Returns:
        (B, K+2) int64: ``[:, :K+1]`` the tokens (-1 padded), ``[:, K+1]`` num_accepted.
        Random numbers are keyed by (seed, output position, purpose) (:func:`step_uniforms`):
        nothing to advance.  Nothing here reads a device value on the host.
    """
    check_method(method, synthetic_acceptance_rate)
    rate = synthetic_acceptance_rate
    B, K, V = _check_verify_inputs(logits, row_index, draft_ids, num_drafts, req, draft_probs, draft_has_q)
    if method in Q_VERIFICATION_METHODS and draft_probs is None:
        method = "strict"  # no row has a q: one-hot q everywhere is strict verification
    if use_kernel is None:
        use_kernel = logits.is_cuda and method in ("strict", "probabilistic") and _triton_available()
    elif use_kernel and method not in ("strict", "probabilistic"):
        raise ValueError("use_kernel: the Triton kernel implements strict and probabilistic only")
    flags = req.flags
    q = draft_probs if method in Q_VERIFICATION_METHODS else None

    if flags.all_greedy:
        # the target's tokens are the argmax: no probabilities; randomness only for synthetic
        t = logits.argmax(dim=-1)[row_index]  # (B, K+1)
        uniforms = step_uniforms(req.seed, req.position, K) if method == "synthetic" else None
        return rejection.verify_chain(None, draft_ids, num_drafts, None, uniforms,
                                      "synthetic" if method == "synthetic" else "strict", rate,
                                      target_tokens=t, use_kernel=False, validate=False).packed()

    uniforms = step_uniforms(req.seed, req.position, K, method)  # (B, K) accept tests, (B, K+1) draws
    rows = logits[row_index].reshape(B * (K + 1), V)  # (B*(K+1), V): request-major, position-minor
    probs = process_logits(
        rows, _rows(req.temperature, K + 1), _rows(req.top_k, K + 1), _rows(req.top_p, K + 1),
        _rows(req.min_p, K + 1), flags,
    ).view(B, K + 1, V)  # (B, K+1, V)
    packed = rejection.verify_chain(probs, draft_ids, num_drafts, q, uniforms, method, rate,
                                    use_kernel=use_kernel, validate=False).packed()
    if method in Q_VERIFICATION_METHODS and draft_has_q is not None:
        # rows without a q: strict, so their tokens are the seed's plain-decoding tokens
        strict = rejection.verify_chain(probs, draft_ids, num_drafts, None, uniforms, "strict",
                                        use_kernel=use_kernel, validate=False).packed()
        packed = torch.where(draft_has_q[:, None], packed, strict)
    return packed


def unpack(packed_host: Tensor | Sequence[Sequence[int]]) -> list[tuple[list[int], int]]:
    """(emitted tokens, num_accepted) per request from a packed (B, K+2) result on the host."""
    rows = packed_host.tolist() if isinstance(packed_host, Tensor) else packed_host
    return [(row[: row[-1] + 1], row[-1]) for row in rows]


def _triton_available() -> bool:
    from specserve.kernels import triton_available

    return triton_available()


@dataclass
class StepInputs:
    """One step's device inputs (views of :class:`DeviceSampler`'s persistent buffers)."""

    row_index: Tensor  # (B, K+1) int64
    draft_ids: Tensor  # (B, K) int64, -1 padded
    num_drafts: Tensor  # (B,) int64
    requests: RequestTensors
    num_real: int  # rows filled from the caller's lists; the rest (up to B) are padding


# Persistent input layout: field-major, int64 fields first so every float32 field stays aligned.
_INT_FIELDS = ("top_k", "seed", "position", "num_drafts", "row_index", "draft_ids")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p")


class DeviceSampler:
    """Persistent buffers + :func:`verify_step` + the one copy back to the host, for the step loop.

    ``prepare`` writes a step's inputs into a pinned host staging buffer and moves
    it to the device with one non-blocking copy (``StagingBuffer``: a host buffer is
    rewritten only after its previous copy has run; the views it returns always
    point at the same device memory, so a CUDA graph captured on them stays
    valid); ``sample`` runs :func:`verify_step`; ``fetch`` copies the packed result
    into a pinned host buffer (one non-blocking copy + event wait) and unpacks it.

    Args:
        max_num_seqs: rows the buffers hold (the scheduler's max batch).
        num_spec_tokens: K, the most drafts a request verifies per step, fixed for the sampler's
            life (0 = plain decoding).
        device: where the step runs.
        method, synthetic_acceptance_rate: the verification method (see :func:`verify_step`).
        vocab_size: when given, ``prepare`` checks draft ids against it.
        use_kernel: passed to :func:`verify_step`.
        transfer: the copier and events of the staging buffer (default: CUDA's; on the CPU
            none, the device reads the host buffer); tests pass a device double.
    """

    def __init__(
        self,
        max_num_seqs: int,
        num_spec_tokens: int,
        device: torch.device | str = "cpu",
        method: str = "strict",
        synthetic_acceptance_rate: float | None = None,
        vocab_size: int | None = None,
        use_kernel: bool | None = None,
        transfer: Transfer | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
        if num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens: must be >= 0, got {num_spec_tokens}")
        check_method(method, synthetic_acceptance_rate)
        self.max_num_seqs = N = max_num_seqs
        self.num_spec_tokens = K = num_spec_tokens
        self.device = torch.device(device)
        self.method = method
        self.synthetic_acceptance_rate = synthetic_acceptance_rate
        self.vocab_size = vocab_size
        self.use_kernel = use_kernel
        pin = self.device.type == "cuda"
        shapes = {"top_k": (N,), "seed": (N,), "position": (N,), "num_drafts": (N,),
                  "row_index": (N, K + 1), "draft_ids": (N, K),
                  "temperature": (N,), "top_p": (N,), "min_p": (N,)}
        fields = [(n, shapes[n], torch.int64 if n in _INT_FIELDS else torch.float32)
                  for n in _INT_FIELDS + _FLOAT_FIELDS]
        # Pinned host buffers used in turn, each rewritten only after its last copy ran.
        self._staging = StagingBuffer(fields, self.device, transfer)
        self._dev = self._staging.d
        self._out_host = torch.empty(N * (K + 2), dtype=torch.int64, pin_memory=pin)
        t = self._staging.transfer
        self._d2h_done = t.event() if t is not None else None

    def prepare(
        self,
        rows: Sequence[int],
        drafts: Sequence[Sequence[int]],
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        min_ps: Sequence[float],
        seeds: Sequence[int],
        positions: Sequence[int],
        pad_to: int | None = None,
        flags: SamplerFlags | None = None,
    ) -> StepInputs:
        """Fill the persistent buffers for B requests (one host->device copy); returns views (B', ...).

        When no request has drafts, the views are those of a K = 0 step (row_index (B', 1),
        draft_ids (B', 0)): the packed result is (B', 2) and its tokens are the ones the
        full (B', K+2) step would emit (the same keyed numbers).

        Args:
            rows: per request, the logits row of its first verified position (row_index[b, j]
                = rows[b] + min(j, len(drafts[b]))).
            drafts: per request, its draft token ids (at most K).
            temperatures, top_ks, top_ps, min_ps: as :meth:`SamplingTensors.build`.
            seeds: 64-bit seeds in [-2**63, 2**64 - 1]; positions: each request's output
                index of its first verified token (the tokens it has generated so far).
            pad_to: B' >= B rows to expose (a captured graph's batch size); padding rows are
                greedy with no drafts and read logits row 0; their results are to be ignored.
            flags: None = the batch's tight flags (:meth:`SamplerFlags.from_lists`).
        """
        B = len(rows)
        Bp = B if pad_to is None else pad_to
        if not 1 <= B <= Bp <= self.max_num_seqs:
            raise ValueError(f"rows/pad_to: need 1 <= B={B} <= pad_to={Bp} <= max_num_seqs={self.max_num_seqs}")
        n_pad = Bp - B
        SamplingTensors.build(temperatures, top_ks, top_ps, min_ps)  # validates lengths and ranges (tiny, host)
        seeds64, pos = _check_seeds_positions(seeds, positions, B)
        if len(drafts) != B:
            raise ValueError(f"drafts: expected {B} lists (one per row), got {len(drafts)}")
        lens = [len(d) for d in drafts]
        if any(n > self.num_spec_tokens for n in lens):
            raise ValueError(f"drafts: at most K={self.num_spec_tokens} per request, got lengths {lens}")
        V = self.vocab_size
        if any(not 0 <= t < (V if V is not None else 2**63) for d in drafts for t in d):
            raise ValueError(f"drafts: token ids must be in [0, {V}), got {[list(d) for d in drafts]}")
        if any(int(r) < 0 for r in rows):
            raise ValueError(f"rows: must be >= 0, got {list(rows)}")
        if flags is None:
            pad = [0.0] * n_pad
            flags = SamplerFlags.from_lists(
                list(temperatures) + pad, list(top_ks) + [0] * n_pad, list(top_ps) + [1.0] * n_pad,
                list(min_ps) + pad,
            )

        h = self._staging.acquire()  # a host buffer no copy in flight still reads
        h["temperature"][:B] = temperatures
        h["top_k"][:B] = [max(int(k), 0) for k in top_ks]
        h["top_p"][:B] = top_ps
        h["min_p"][:B] = min_ps
        h["seed"][:B] = seeds64
        # A step without any draft verifies position 0 only (1/(K+1) of the work for sampled
        # rows): the same token, as it reads the same keyed number.
        plain = self.num_spec_tokens > 0 and not any(lens)
        h["position"][:B] = pos
        h["num_drafts"][:B] = lens
        j = np.arange(self.num_spec_tokens + 1)[None, :]  # (1, K+1)
        h["row_index"][:B] = np.asarray(rows, dtype=np.int64)[:, None] + np.minimum(j, np.asarray(lens)[:, None])
        ids = h["draft_ids"]
        ids[:B] = -1
        for b, d in enumerate(drafts):
            ids[b, : len(d)] = d
        if n_pad:
            for name, value in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("seed", 0),
                                ("position", 0), ("num_drafts", 0), ("row_index", 0), ("draft_ids", -1)):
                h[name][B:Bp] = value
        self._staging.upload()
        d = {name: t[:Bp] for name, t in self._dev.items()}
        if plain:
            d["row_index"], d["draft_ids"] = d["row_index"][:, :1], d["draft_ids"][:, :0]
        return StepInputs(
            row_index=d["row_index"], draft_ids=d["draft_ids"], num_drafts=d["num_drafts"],
            requests=RequestTensors(temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"],
                                    min_p=d["min_p"], seed=d["seed"], position=d["position"], flags=flags),
            num_real=B,
        )

    def sample(self, logits: Tensor, inputs: StepInputs, draft_probs: Tensor | None = None,
               draft_has_q: Tensor | None = None) -> Tensor:
        """:func:`verify_step` on the prepared inputs; packed (B', K+2) int64 on the device."""
        return verify_step(
            logits, inputs.row_index, inputs.draft_ids, inputs.num_drafts, inputs.requests,
            method=self.method, synthetic_acceptance_rate=self.synthetic_acceptance_rate,
            draft_probs=draft_probs, draft_has_q=draft_has_q, use_kernel=self.use_kernel,
        )

    def copy_to_host(self, packed: Tensor) -> Tensor:
        """One non-blocking copy of ``packed`` (B, W) into the pinned host buffer, then wait for it.

        Returns a view of the host buffer, valid until the next call.
        """
        B, W = packed.shape
        if B > self.max_num_seqs:
            raise ValueError(f"packed: {tuple(packed.shape)} does not fit the host buffer "
                             f"({self.max_num_seqs} x {self.num_spec_tokens + 2})")
        if B * W > self._out_host.numel():  # wider rows (log-probabilities riding along): grow once
            self._out_host = torch.empty(self.max_num_seqs * W, dtype=torch.int64,
                                         pin_memory=self._out_host.is_pinned())  # fmt: skip
        host = self._out_host[: B * W].view(B, W)
        host.copy_(packed, non_blocking=True)
        if self._d2h_done is not None:
            self._d2h_done.record()
            self._d2h_done.synchronize()
        return host

    def fetch(self, packed: Tensor, num_rows: int | None = None) -> list[tuple[list[int], int]]:
        """(emitted tokens, num_accepted) for the first ``num_rows`` requests (default all), one copy."""
        host = self.copy_to_host(packed)
        return unpack(host[: host.shape[0] if num_rows is None else num_rows])
