"""Verification of speculative drafts: the rejection sampler (torch reference + kernel dispatch).

Vocabulary (vLLM's): per request and step the drafter proposes ``n`` *draft*
tokens d_1..d_n (n = num_draft_tokens[b] <= K); the target scores all of them in
one forward, giving p_1..p_{n+1}.  Drafts are *accepted* left to right; the
first rejected position emits a *recovered* (correction) token instead; if all
n are accepted a *bonus* token is sampled from p_{n+1}.  Each step therefore
emits num_accepted + 1 tokens.

Methods:

- ``strict``: t_i ~ p_i; accept while t_i == d_i; the first mismatch emits t_i.
  Lossless for any drafter (and exact for greedy).
- ``probabilistic`` (Leviathan et al. 2023; Chen et al. 2023): accept d_i with
  probability min(1, p_i(d_i) / q_i(d_i)); on rejection emit a sample of
  normalize(max(p_i - q_i, 0)).  Lossless; accepts more than strict when q is a
  real distribution.  Without draft probabilities q is one-hot at d_i.
- ``block`` (Sun et al. 2024, "Block Verification Accelerates Speculative
  Decoding"): the n drafts are verified as one block.  A weight carries the
  evidence of the prefix, w_0 = 1, w_i = min(1, w_{i-1} p_i(d_i) / q_i(d_i)); the
  block keeps its longest prefix i whose test u_i < h_i passes (all n tests are
  run), with h_n = w_n and, for i < n, h_i = r_i / (r_i + 1 - w_i), r_i the mass
  of max(w_i p_{i+1} - q_{i+1}, 0); after i < n it emits a sample of that
  residual (normalised), after n the bonus.  Lossless (the completed sequence
  follows the target), never fewer tokens than ``probabilistic`` in expectation
  (it is optimal among verifiers of one draft chain), and with one-hot (greedy)
  targets exactly strict.  The tests of a block are decided together, so its
  accept numbers must be fresh for every step (``sampler.step_uniforms``).
- ``synthetic``: accept position i iff u < rate.  NOT lossless: benchmarking only.

One public function, :func:`verify_chain`, verifies a batch of draft chains: the
engine's device sampler (``specserve.sampling.sampler.verify_step``) calls it on the
probabilities it has processed, the start-up kernel check and the tests call it on
theirs.  It takes the target either as probabilities (strict, probabilistic,
synthetic) or as its tokens already chosen (``target_tokens``: greedy rows, where
the token is the argmax and verification needs no probabilities).

The random numbers are the caller's (:class:`RejectionUniforms`): the engine keys
them by (request seed, output position, purpose) (``sampler.step_uniforms``), so a
seeded request's tokens do not depend on its batch.  Tensors with ``[B, K]`` shape
are padded beyond ``num_draft_tokens[b]`` (draft ids with -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.methods import REJECTION_METHODS
from specserve.sampling.filters import sample_from_probs

__all__ = [
    "REJECTION_METHODS",
    "RejectionOutput",
    "RejectionUniforms",
    "check_method",
    "verify_chain",
]


@dataclass
class RejectionUniforms:
    """The random numbers of one verification step, one row per request."""

    accept: Tensor  # [B, K] float32 in [0, 1): accept tests (probabilistic, block, synthetic)
    sample: Tensor  # [B, K+1] float32 in [0, 1): inverse-CDF draws at each position


@dataclass
class RejectionOutput:
    output_token_ids: Tensor  # [B, K+1] int64: accepted drafts, then recovered/bonus; -1 after
    num_accepted: Tensor  # [B] int64 in 0..num_draft_tokens[b]

    def to_lists(self) -> list[list[int]]:
        """Emitted tokens per request (one device sync)."""
        ids = self.output_token_ids.tolist()
        return [row[: n + 1] for row, n in zip(ids, self.num_accepted.tolist())]

    def packed(self) -> Tensor:
        """[B, K+2] int64: the tokens, then num_accepted (the device sampler's one result)."""
        return torch.cat([self.output_token_ids, self.num_accepted[:, None]], dim=1)


def verify_chain(
    target_probs: Tensor | None,
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor,
    draft_probs: Tensor | None = None,
    uniforms: RejectionUniforms | None = None,
    method: str = "strict",
    synthetic_acceptance_rate: float | None = None,
    *,
    target_tokens: Tensor | None = None,
    use_kernel: bool | None = None,
    validate: bool = True,
) -> RejectionOutput:
    """Verify drafts against the target; see the module docstring for the methods.

    Args:
        target_probs: [B, K+1, V] float32, processed (temperature/top-k/top-p/min-p);
            greedy rows one-hot.  Row b is read at positions 0..num_draft_tokens[b].
            None when ``target_tokens`` is given.
        draft_token_ids: [B, K] int64, -1 beyond num_draft_tokens[b].
        num_draft_tokens: [B] int64 in 0..K.
        draft_probs: [B, K, V] float32, or None for drafters without distributions
            (n-gram, suffix, greedy drafters): q is then one-hot at the draft.
        uniforms: the step's random numbers; not needed with ``target_tokens`` unless
            the method is synthetic.
        method: "strict", "probabilistic", "block" or "synthetic".
        synthetic_acceptance_rate: in [0, 1], required with (and only with) "synthetic".
            Synthetic acceptance is NOT lossless: it accepts drafts with a fixed
            probability regardless of the target and exists to benchmark the
            engine at a chosen acceptance rate.  Its emitted non-draft tokens are
            target samples (argmax for greedy rows).
        target_tokens: [B, K+1] int64, the target's tokens already chosen at each
            position (greedy rows: the argmax of the raw logits), instead of
            ``target_probs``.  Strict verification then accepts while d_i equals
            them, which is exactly plain greedy decoding; synthetic accepts by the
            rate.  Probabilistic and block need probabilities (on one-hot targets
            both are strict).
        use_kernel: None = the Triton kernel when the tensors are on CUDA and
            triton is importable (strict/probabilistic on probabilities); True forces
            it (on CPU it runs under Triton's interpreter); False forces the torch
            reference.  Block verification has no kernel: its torch path runs on the
            tensors' device without a host synchronisation.
        validate: check shapes, dtypes and (on the CPU) values first.  The device
            sampler passes False: it has checked its inputs, and reading values on the
            host would synchronise the step.

    Returns:
        RejectionOutput; row b emits output_token_ids[b, :num_accepted[b] + 1].
    """
    check_method(method, synthetic_acceptance_rate)
    rate = synthetic_acceptance_rate
    if target_tokens is not None:
        return _verify_tokens(target_probs, target_tokens, draft_token_ids, num_draft_tokens, uniforms, method, rate,
                              use_kernel, validate)
    if target_probs is None:
        raise ValueError("target_probs: required (or target_tokens)")
    if validate:
        if target_probs.dtype != torch.float32:
            raise ValueError(f"target_probs: expected float32, got {target_probs.dtype}")
        B, K = _check_inputs(target_probs, draft_token_ids, num_draft_tokens, draft_probs)
        if uniforms is None:
            raise ValueError("uniforms: required to verify against target_probs")
        _check_uniforms(uniforms, B, K, draft_token_ids.device)

    if method in ("synthetic", "block") and use_kernel:
        raise ValueError("use_kernel: the Triton kernel implements strict and probabilistic only")
    if method == "block":
        return _block(target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms)
    if method == "synthetic":
        t = _sample_positions(target_probs, uniforms.sample)  # [B, K+1]; greedy rows: argmax
        return _chain(t, uniforms.accept < rate, draft_token_ids, num_draft_tokens)

    if use_kernel is None:
        use_kernel = target_probs.is_cuda and _triton_available()
    if use_kernel:
        from specserve.kernels.rejection_kernel import rejection_sample_triton

        out_ids, num_accepted = rejection_sample_triton(
            target_probs, draft_token_ids, num_draft_tokens, draft_probs,
            uniforms.accept, uniforms.sample, method,
        )
        return RejectionOutput(output_token_ids=out_ids, num_accepted=num_accepted)
    if method == "strict":
        t = _sample_positions(target_probs, uniforms.sample)  # [B, K+1]
        K = draft_token_ids.shape[1]
        return _chain(t, t[:, :K] == draft_token_ids, draft_token_ids, num_draft_tokens)
    return _probabilistic(target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms)


def check_method(method: str, synthetic_acceptance_rate: float | None = None) -> None:
    """``method`` is a verification method, with a synthetic acceptance rate in [0, 1]
    exactly when it is "synthetic"; ValueError naming the argument otherwise."""
    rate = synthetic_acceptance_rate
    if method not in REJECTION_METHODS:
        raise ValueError(f"method: must be one of {', '.join(REJECTION_METHODS)}; got {method!r}")
    if method == "synthetic":
        if rate is None or not 0.0 <= rate <= 1.0:
            raise ValueError(f"synthetic_acceptance_rate: must be in [0, 1] with method 'synthetic', got {rate}")
    elif rate is not None:
        raise ValueError(f"synthetic_acceptance_rate: only valid with method 'synthetic', not {method!r}")


def _verify_tokens(target_probs, target_tokens, draft_token_ids, num_draft_tokens, uniforms, method, rate,
                   use_kernel, validate) -> RejectionOutput:
    """Verification against the target's tokens already chosen (no probabilities)."""
    if target_probs is not None:
        raise ValueError("target_tokens: give target_probs or target_tokens, not both")
    if method in ("probabilistic", "block"):
        raise ValueError(f"method: {method} verification needs target_probs, not target_tokens")
    if use_kernel:
        raise ValueError("use_kernel: the Triton kernel verifies target_probs, not target_tokens")
    if validate:
        B, K = _check_inputs(None, draft_token_ids, num_draft_tokens, None)
        if target_tokens.shape != (B, K + 1) or target_tokens.dtype != torch.int64:
            raise ValueError(f"target_tokens: expected [{B}, {K + 1}] int64, "
                             f"got {tuple(target_tokens.shape)} {target_tokens.dtype}")
        if method == "synthetic":
            if uniforms is None:
                raise ValueError("uniforms: required with method 'synthetic'")
            _check_uniforms(uniforms, B, K, draft_token_ids.device)
    K = draft_token_ids.shape[1]
    accepted = uniforms.accept < rate if method == "synthetic" else target_tokens[:, :K] == draft_token_ids
    return _chain(target_tokens, accepted, draft_token_ids, num_draft_tokens)


def _check_inputs(
    target_probs: Tensor | None,
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_name: str = "target_probs",
) -> tuple[int, int]:

    if draft_token_ids.dim() != 2 or draft_token_ids.dtype != torch.int64:
        raise ValueError(
            f"draft_token_ids: expected [B, K] int64, got {tuple(draft_token_ids.shape)} {draft_token_ids.dtype}"
        )
    B, K = draft_token_ids.shape
    if num_draft_tokens.shape != (B,) or num_draft_tokens.dtype != torch.int64:
        raise ValueError(
            f"num_draft_tokens: expected [{B}] int64, got {tuple(num_draft_tokens.shape)} {num_draft_tokens.dtype}"
        )
    device = draft_token_ids.device
    if num_draft_tokens.device != device:
        raise ValueError(f"num_draft_tokens: on {num_draft_tokens.device} but draft_token_ids on {device}")
    if target_probs is not None:
        if target_probs.dim() != 3 or target_probs.shape[:2] != (B, K + 1):
            raise ValueError(f"{target_name}: expected [{B}, {K + 1}, V], got {tuple(target_probs.shape)}")
        if target_probs.device != device:
            raise ValueError(f"{target_name}: on {target_probs.device} but draft_token_ids on {device}")
    if draft_probs is not None:
        if target_probs is None or draft_probs.shape != (B, K, target_probs.shape[2]):
            raise ValueError(f"draft_probs: expected [{B}, {K}, V] like target_probs, got {tuple(draft_probs.shape)}")
        if draft_probs.dtype != torch.float32 or draft_probs.device != device:
            raise ValueError(
                f"draft_probs: expected float32 on {device}, got {draft_probs.dtype} on {draft_probs.device}"
            )
    if device.type == "cpu":  # value checks cost a device sync elsewhere, so only here
        if B and (num_draft_tokens.min() < 0 or num_draft_tokens.max() > K):
            raise ValueError(f"num_draft_tokens: values must be in [0, {K}], got {num_draft_tokens.tolist()}")
        valid = torch.arange(K) < num_draft_tokens[:, None]  # [B, K]
        V = target_probs.shape[2] if target_probs is not None else None
        ids = draft_token_ids[valid]
        if ids.numel() and (ids.min() < 0 or (V is not None and ids.max() >= V)):
            raise ValueError(f"draft_token_ids: ids within num_draft_tokens must be in [0, {V}), got {ids.tolist()}")
    return B, K


def _check_uniforms(uniforms: RejectionUniforms, B: int, K: int, device: torch.device) -> None:
    for name, t, shape in (("accept", uniforms.accept, (B, K)), ("sample", uniforms.sample, (B, K + 1))):
        if t.shape != shape or t.dtype != torch.float32 or t.device != device:
            raise ValueError(
                f"uniforms.{name}: expected {list(shape)} float32 on {device}, "
                f"got {tuple(t.shape)} {t.dtype} on {t.device}"
            )


def _chain(t: Tensor, accepted: Tensor, draft_token_ids: Tensor, num_draft_tokens: Tensor) -> RejectionOutput:
    """The accepted prefix of each chain, then the target's token at the first position
    not accepted.  t: [B, K+1] the target's token at each position; accepted: [B, K]
    bool per position (only the prefix within num_draft_tokens counts)."""
    num_accepted = _chain_accepted(accepted, num_draft_tokens)  # [B]
    emit = t.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    K = draft_token_ids.shape[1]
    return _finish(emit, t[:, K:], draft_token_ids, num_accepted)


def _finish(emit_at: Tensor, tail: Tensor, draft_token_ids: Tensor, num_accepted: Tensor) -> RejectionOutput:
    # emit_at: [B] the token at position num_accepted; drafts before it; -1 after.
    B, K = draft_token_ids.shape
    pos = torch.arange(K + 1, device=draft_token_ids.device)[None, :]  # [1, K+1]
    drafts = torch.cat([draft_token_ids, tail], dim=1)  # [B, K+1]
    out = torch.where(pos < num_accepted[:, None], drafts, torch.full_like(drafts, -1))
    out = torch.where(pos == num_accepted[:, None], emit_at[:, None], out)
    return RejectionOutput(output_token_ids=out, num_accepted=num_accepted)


def _chain_accepted(accepted: Tensor, num_draft_tokens: Tensor) -> Tensor:
    # accepted: [B, K] bool per position -> [B] length of the accepted prefix within n
    K = accepted.shape[1]
    valid = torch.arange(K, device=accepted.device)[None, :] < num_draft_tokens[:, None]
    return (accepted & valid).to(torch.int64).cumprod(dim=1).sum(dim=1)


def _sample_positions(target_probs: Tensor, u_sample: Tensor) -> Tensor:
    # [B, K+1, V], [B, K+1] -> t [B, K+1] int64, t[b, i] ~ p_i by inverse CDF
    B, K1, V = target_probs.shape
    return sample_from_probs(target_probs.reshape(B * K1, V), u_sample.reshape(B * K1)).view(B, K1)


def _probabilistic(target_probs: Tensor, draft_token_ids: Tensor, num_draft_tokens: Tensor,
                   draft_probs: Tensor | None, uniforms: RejectionUniforms) -> RejectionOutput:
    B, K = draft_token_ids.shape
    rows = torch.arange(B, device=draft_token_ids.device)
    ids = draft_token_ids.clamp(min=0)[:, :, None]  # [B, K, 1]; padding -> 0, masked below
    p_d = target_probs[:, :K].gather(2, ids).squeeze(2)  # [B, K] p_i(d_i)
    q_d = draft_probs.gather(2, ids).squeeze(2) if draft_probs is not None else torch.ones_like(p_d)
    # u < p/q without dividing (q = 0 with p > 0 accepts; p = 0 never does)
    num_accepted = _chain_accepted(uniforms.accept * q_d < p_d, num_draft_tokens)  # [B]

    pos = num_accepted  # [B] position of the emitted token
    p = target_probs[rows, pos]  # [B, V]
    rejected = pos < num_draft_tokens  # [B]; else: bonus from p_{n+1}
    if K > 0:
        qpos = pos.clamp(max=K - 1)
        if draft_probs is not None:
            q = draft_probs[rows, qpos]  # [B, V]
        else:
            q = torch.zeros_like(p).scatter_(1, ids[rows, qpos], 1.0)  # one-hot at d_pos
        q = torch.where(rejected[:, None], q, torch.zeros_like(q))
        residual = torch.clamp(p - q, min=0.0)  # [B, V]
        # all-zero residual (p == q up to rounding): fall back to p
        has_mass = (residual > 0).any(dim=1, keepdim=True)
        p = torch.where(has_mass, residual, p)
    emit = sample_from_probs(p, uniforms.sample[rows, pos])  # [B]
    return _finish(emit, emit[:, None], draft_token_ids, num_accepted)


def _block(target_probs: Tensor, draft_token_ids: Tensor, num_draft_tokens: Tensor,
           draft_probs: Tensor | None, uniforms: RejectionUniforms) -> RejectionOutput:
    """Block verification (see the module docstring), vectorised over the batch."""
    B, K = draft_token_ids.shape
    dev = draft_token_ids.device
    rows = torch.arange(B, device=dev)
    ids = draft_token_ids.clamp(min=0)[:, :, None]  # [B, K, 1]; padding -> 0 (only positions > n use it)
    p_d = target_probs[:, :K].gather(2, ids).squeeze(2)  # [B, K] p_i(d_i)
    q_d = draft_probs.gather(2, ids).squeeze(2) if draft_probs is not None else torch.ones_like(p_d)
    w = _block_weights(p_d, q_d)  # [B, K+1]; w[:, i] after i accepted drafts
    n = num_draft_tokens
    length = torch.arange(1, K + 1, device=dev)[None, :]  # [1, K]: the block lengths i
    mass = _block_residual_mass(w, target_probs, draft_probs, p_d)  # [B, K]: r_i at column i - 1
    denom = mass + 1.0 - w[:, 1:]
    # r_i = 0 with w_i = 1 means p = q there: stopping at i is impossible, and h_i = 1 keeps it so
    h = torch.where(denom > 0, mass / denom.clamp(min=torch.finfo(denom.dtype).tiny), torch.ones_like(mass))
    h = torch.where(length == n[:, None], w[:, 1:], h)  # the whole block: h_n = w_n
    passed = (uniforms.accept < h) & (length <= n[:, None])  # [B, K]
    num_accepted = (passed.to(torch.int64) * length).amax(dim=1) if K else torch.zeros_like(n)  # the longest

    pos = num_accepted  # [B] position of the emitted token
    p = target_probs[rows, pos]  # [B, V]
    if K > 0:
        qpos = pos.clamp(max=K - 1)
        if draft_probs is not None:
            q = draft_probs[rows, qpos]  # [B, V]
        else:
            q = torch.zeros_like(p).scatter_(1, ids[rows, qpos], 1.0)  # one-hot at d_pos
        residual = torch.clamp(w[rows, pos][:, None] * p - q, min=0.0)  # [B, V]
        # the bonus after the whole block; an all-zero residual (rounding) falls back to p
        use = (pos < n)[:, None] & (residual > 0).any(dim=1, keepdim=True)
        p = torch.where(use, residual, p)
    emit = sample_from_probs(p, uniforms.sample[rows, pos])  # [B]
    return _finish(emit, emit[:, None], draft_token_ids, num_accepted)


def _block_weights(p_d: Tensor, q_d: Tensor) -> Tensor:
    # [B, K] p_i(d_i), q_i(d_i) -> [B, K+1]: w_0 = 1, w_i = min(1, w_{i-1} p_i(d_i) / q_i(d_i)).
    # min(w p, q) / q is exactly 1 when w p >= q; q = 0 (a draft q never proposes) keeps w > 0 at 1.
    B, K = p_d.shape
    w = [torch.ones(B, dtype=p_d.dtype, device=p_d.device)]
    for i in range(K):
        wp = w[-1] * p_d[:, i]
        q = q_d[:, i]
        w.append(torch.where(q > 0, torch.minimum(wp, q) / q.clamp(min=torch.finfo(q.dtype).tiny),
                             (wp > 0).to(p_d.dtype)))
    return torch.stack(w, dim=1)


def _block_residual_mass(w: Tensor, target_probs: Tensor, draft_probs: Tensor | None, p_d: Tensor) -> Tensor:
    # [B, K]: column i - 1 holds r_i = sum_x max(w_i p_{i+1}(x) - q_{i+1}(x), 0) for i = 1..K-1
    # (distributions at 0-based position i); the last column (i = K, never a stop before n) is 0.
    B, K1, V = target_probs.shape
    K = K1 - 1
    mass = torch.zeros(B, K, dtype=target_probs.dtype, device=target_probs.device)
    if K < 2:
        return mass
    wi = w[:, 1:K, None]  # [B, K-1, 1]
    if draft_probs is not None:
        r = torch.clamp(wi * target_probs[:, 1:K] - draft_probs[:, 1:K], min=0.0).sum(dim=2)
    else:  # one-hot q at d: w (1 - p(d)) + max(w p(d) - 1, 0), and w p(d) <= 1
        r = wi[:, :, 0] * (1.0 - p_d[:, 1:K])
    mass[:, : K - 1] = r
    return mass


def _triton_available() -> bool:
    from specserve.kernels import triton_available

    return triton_available()
