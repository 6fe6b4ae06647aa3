"""Triton kernel for strict and probabilistic draft verification.

Torch reference twin: :mod:`specserve.sampling.rejection` (``_strict`` and
``_probabilistic``).  Given the same uniforms both return the same tokens; the
inverse-CDF running sums are kept in float64 on both sides so that the kernel's
block-wise sums and torch's cumsum agree to ~1e-16.

One program per request.  It walks positions 0..n (n = num_draft_tokens[b]):
at a draft position it runs the accept test; where a token must be sampled
(strict: every position; probabilistic: the first rejection, or the bonus after
n acceptances) it makes two passes over V in BLOCK_V blocks: the total mass of
the distribution (p, or the residual max(p - q, 0) after a rejection, falling
back to p when the residual is all zero), then the first index whose running
sum exceeds u * total.

Binaries: K (the step's draft count) is not specialised on, so a vocabulary
needs one binary per variant -- strict, probabilistic with and without draft
probabilities (:func:`variant_launches`, compiled at start-up).

On CUDA the kernel is compiled.  CPU tensors need Triton's interpreter, which
must be switched on with ``TRITON_INTERPRET=1`` before triton is first imported
(slow; for tests).  triton is
imported here behind a guard and this module is only imported when a kernel is
requested, so ``import specserve.kernels`` works without triton.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specserve.kernels.launches import KernelDef, Launch
from specserve.kernels.launches import run as run_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference is used instead; see rejection_sample_triton
    triton = None
    tl = None

__all__ = ["interpreter_active", "rejection_sample_triton", "variant_launches"]


def _rejection_kernel(
    target_probs_ptr,  # [B, K+1, V] float32, contiguous
    draft_probs_ptr,  # [B, K, V] float32 (read only when HAS_DRAFT_PROBS)
    draft_ids_ptr,  # [B, K] int64, -1 padded
    num_draft_ptr,  # [B] int64
    u_accept_ptr,  # [B, K] float32
    u_sample_ptr,  # [B, K+1] float32
    out_ids_ptr,  # [B, K+1] int64, pre-filled with -1
    num_accepted_ptr,  # [B] int64
    K,
    V,
    STRICT: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(num_draft_ptr + b).to(tl.int32)
    offs0 = tl.arange(0, BLOCK_V)
    num_acc = n  # overwritten at the first rejection
    done = n * 0  # int32 flag: a token other than an accepted draft has been emitted
    for i in range(0, n + 1):
        if done == 0:
            in_draft = i < n  # False at the bonus position i == n
            d = tl.load(draft_ids_ptr + b * K + i, mask=in_draft, other=0)
            p_row = target_probs_ptr + (b * (K + 1) + i) * V
            # clamped so the bonus position (i == K) never addresses past draft_probs
            q_row = draft_probs_ptr + (b * K + tl.minimum(i, K - 1)) * V
            if STRICT:
                accept = in_draft & (d < 0)  # False; decided after sampling t_i
                residual = in_draft & (d < 0)  # strict always samples p itself
            else:
                p_d = tl.load(p_row + d)
                if HAS_DRAFT_PROBS:
                    q_d = tl.load(q_row + d, mask=in_draft, other=1.0)
                else:
                    q_d = 1.0
                u_a = tl.load(u_accept_ptr + b * K + i, mask=in_draft, other=1.0)
                accept = in_draft & (u_a * q_d < p_d)  # u < p/q without dividing
                residual = in_draft  # a rejection samples max(p - q, 0)
            token = d.to(tl.int32)
            if accept == 0:
                # (interpreter quirk: `block_mask & scalar_bool` is int32 there, hence the nested
                # tl.where on the scalar flag instead of a combined load mask)
                # pass 1: total mass and last positive index, of the residual and of p
                total_r = tl.full([], 0.0, tl.float64)
                total_p = tl.full([], 0.0, tl.float64)
                last_r = tl.full([], -1, tl.int32)
                last_p = tl.full([], -1, tl.int32)
                for start in range(0, V, BLOCK_V):
                    offs = start + offs0
                    m = offs < V
                    p = tl.load(p_row + offs, mask=m, other=0.0)
                    if HAS_DRAFT_PROBS:
                        q = tl.where(residual, tl.load(q_row + offs, mask=m, other=0.0), 0.0)
                    else:
                        q = tl.where(residual, tl.where(offs == d, 1.0, 0.0), 0.0)
                    r = tl.maximum(p - q, 0.0)
                    total_r += tl.sum(r.to(tl.float64), axis=0)
                    total_p += tl.sum(p.to(tl.float64), axis=0)
                    last_r = tl.maximum(last_r, tl.max(tl.where(r > 0.0, offs, -1), axis=0))
                    last_p = tl.maximum(last_p, tl.max(tl.where(p > 0.0, offs, -1), axis=0))
                use_p = last_r < 0  # residual all zero: fall back to p
                total = tl.where(use_p, total_p, total_r)
                last = tl.where(use_p, last_p, last_r)
                target = tl.load(u_sample_ptr + b * (K + 1) + i).to(tl.float64) * total
                # pass 2: first index whose running sum exceeds u * total
                carry = tl.full([], 0.0, tl.float64)
                found = tl.full([], 0, tl.int32) + V
                for start in range(0, V, BLOCK_V):
                    offs = start + offs0
                    m = offs < V
                    p = tl.load(p_row + offs, mask=m, other=0.0)
                    if HAS_DRAFT_PROBS:
                        q = tl.where(residual, tl.load(q_row + offs, mask=m, other=0.0), 0.0)
                    else:
                        q = tl.where(residual, tl.where(offs == d, 1.0, 0.0), 0.0)
                    vals = tl.where(use_p, p, tl.maximum(p - q, 0.0))
                    v64 = vals.to(tl.float64)
                    running = carry + tl.cumsum(v64, axis=0)
                    hit = (running > target) & (vals > 0.0) & m  # zero-mass tokens never hit
                    found = tl.minimum(found, tl.min(tl.where(hit, offs, V), axis=0))
                    carry += tl.sum(v64, axis=0)
                # rounding can leave target >= the final sum: take the last token with mass
                token = tl.where(found < V, found, tl.maximum(last, 0))
                if STRICT:
                    accept = in_draft & (token.to(tl.int64) == d)
            if accept:
                tl.store(out_ids_ptr + b * (K + 1) + i, d)
            else:
                tl.store(out_ids_ptr + b * (K + 1) + i, token.to(tl.int64))
                num_acc = i
                done = done + 1
    tl.store(num_accepted_ptr + b, num_acc.to(tl.int64))


# K varies with the step's draft count (0 and 1 would each get a binary of their own);
# V is the model's, fixed.
REJECTION = KernelDef(_rejection_kernel, do_not_specialize=("K",))


def interpreter_active() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1 (needed for CPU tensors).

    Triton decides at import time: its standard library (tl.sum, tl.cumsum, ...)
    is built for the interpreter or for compilation, so setting the variable
    after ``import triton`` is too late.
    """
    return triton is not None and type(tl.sum).__name__ == "InterpretedFunction"


def default_block_v(vocab_size: int, device: torch.device | str) -> int:
    return min(_next_pow2(vocab_size), 1024 if torch.device(device).type == "cuda" else 4096)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _launch(target_probs: Tensor, draft_probs: Tensor | None, draft_token_ids: Tensor, num_draft_tokens: Tensor,
            u_accept: Tensor, u_sample: Tensor, out_ids: Tensor, num_accepted: Tensor, method: str,
            block_v: int) -> Launch:
    B, K1, V = target_probs.shape
    has_draft_probs = draft_probs is not None
    return Launch(
        REJECTION, (B,),
        (target_probs, draft_probs if has_draft_probs else target_probs, draft_token_ids, num_draft_tokens,
         u_accept, u_sample, out_ids, num_accepted, K1 - 1, V),
        dict(STRICT=method == "strict", HAS_DRAFT_PROBS=has_draft_probs and method == "probabilistic",
             BLOCK_V=block_v),
    )


def variant_launches(method: str, vocab_size: int, device: torch.device | str,
                     block_v: int | None = None) -> list[Launch]:
    """One launch per binary verification with ``method`` can need (strict: one;
    probabilistic: with draft probabilities, without (K = 0 steps), and strict for rows
    whose drafts carry none), on tiny stand-in tensors: B, K and the batch's tensors'
    sizes are not specialised on.  ``block_v``: None = the default for ``device``."""
    dev = torch.device(device)
    V = vocab_size
    f32, i64 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int64, device=dev)
    variants = [("strict", False)] + ([("probabilistic", True), ("probabilistic", False)]
                                      if method == "probabilistic" else [])
    out = []
    for m, with_q in variants:
        out.append(_launch(torch.zeros(1, 2, V, **f32), torch.zeros(1, 1, V, **f32) if with_q else None,
                           torch.zeros(1, 1, **i64), torch.zeros(1, **i64), torch.zeros(1, 1, **f32),
                           torch.zeros(1, 2, **f32), torch.zeros(1, 2, **i64), torch.zeros(1, **i64), m,
                           block_v or default_block_v(V, dev)))
    return out


def _check(name: str, t: Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
        raise ValueError(
            f"{name}: expected {list(shape)} {dtype} on {device}, got {list(t.shape)} {t.dtype} on {t.device}"
        )


def rejection_sample_triton(
    target_probs: Tensor,
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    u_accept: Tensor,
    u_sample: Tensor,
    method: str,
    block_v: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Run the kernel; returns (output_token_ids [B, K+1] int64 (-1 padded), num_accepted [B] int64).

    Inputs as for :func:`specserve.sampling.rejection.verify_chain`, with the
    uniforms passed as ``u_accept`` [B, K] and ``u_sample`` [B, K+1].  ``block_v``
    (a power of two) defaults to min(next_pow2(V), 1024 on CUDA / 4096 on CPU).
    """
    if triton is None:
        raise RuntimeError("use_kernel: triton is not installed; use the torch path (use_kernel=False)")
    if method not in ("strict", "probabilistic"):
        raise ValueError(f"method: the kernel implements 'strict' and 'probabilistic', got {method!r}")
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs: expected [B, K+1, V], got {list(target_probs.shape)}")
    B, K1, V = target_probs.shape
    K = K1 - 1
    device = target_probs.device
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"target_probs: the kernel runs on cuda (or cpu, interpreted), not {device}")
    _check("target_probs", target_probs, (B, K + 1, V), torch.float32, device)
    _check("draft_token_ids", draft_token_ids, (B, K), torch.int64, device)
    _check("num_draft_tokens", num_draft_tokens, (B,), torch.int64, device)
    if draft_probs is not None:
        _check("draft_probs", draft_probs, (B, K, V), torch.float32, device)
    _check("u_accept", u_accept, (B, K), torch.float32, device)
    _check("u_sample", u_sample, (B, K + 1), torch.float32, device)
    if V == 0:
        raise ValueError("target_probs: vocabulary dimension is empty")
    if block_v is None:
        block_v = default_block_v(V, device)
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v: must be a power of two, got {block_v}")

    out_ids = torch.full((B, K + 1), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(B, dtype=torch.int64, device=device)
    if B == 0:
        return out_ids, num_accepted
    if K == 0:  # give the (never read) [B, 0] inputs a valid address
        draft_token_ids = torch.zeros(1, dtype=torch.int64, device=device)
        u_accept = torch.ones(1, dtype=torch.float32, device=device)
        draft_probs = None
    has_draft_probs = draft_probs is not None
    interpreted = interpreter_active()
    if device.type == "cpu" and not interpreted:
        raise RuntimeError(
            "use_kernel: CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is first imported (or use the torch path, use_kernel=False)"
        )
    run_launch(_launch(
        target_probs.contiguous(), draft_probs.contiguous() if has_draft_probs else None,
        draft_token_ids.contiguous(), num_draft_tokens.contiguous(), u_accept.contiguous(), u_sample.contiguous(),
        out_ids, num_accepted, method, block_v,
    ))
    return out_ids, num_accepted
