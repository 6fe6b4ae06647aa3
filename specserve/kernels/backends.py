"""Which implementation runs each kernel: its Triton kernel or its torch twin.

``engine.attention_backend`` (paged attention and the KV write) and
``engine.rejection_backend`` (draft verification) each take:

* ``auto``: Triton on CUDA when triton imports and the kernel passes its start-up
  check; the twin otherwise (on the CPU the twin without a check or a warning:
  the CPU's data path is torch);
* ``triton``: the same, and on the CPU Triton's interpreter (``TRITON_INTERPRET=1``
  before triton is imported; tests); where Triton cannot run, the twin with a
  warning;
* ``torch``: the twin.

A kernel that does not compile, launch or agree with its twin must not take the
server down.  At start-up each Triton kernel runs once on a small random input of
the engine's own geometry (head counts, head size, block size, dtype, vocabulary)
and its output is compared with the twin's (:func:`check_attention`,
:func:`check_rejection`); then every binary the engine can launch is compiled
(``kernels.specializations``).  Any failure logs ONE warning line naming the key,
the kernel and the error, and the twin is used from then on.  The twins are
graph-safe (no host synchronisation, shapes fixed by Python ints), so CUDA graphs
capture either; ``engine.cuda_graphs`` only switches graphs, never the backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.kernels import triton_available
from specserve.kernels.launches import interpreter_active

log = logging.getLogger(__name__)

ATTENTION_KEY = "engine.attention_backend"
REJECTION_KEY = "engine.rejection_backend"


class KernelCheckError(RuntimeError):
    """The Triton kernel's output differs from its twin's on the start-up input."""


@dataclass(frozen=True)
class BackendChoice:
    key: str  # the config key: engine.attention_backend or engine.rejection_backend
    requested: str  # auto | triton | torch
    used: str  # triton | torch
    reason: str = ""  # why the twin runs where Triton was asked for or is the default ("" otherwise)


def why_not_triton(requested: str, device: torch.device) -> str | None:
    """None when Triton can run on ``device`` for this request, else the reason it cannot."""
    if requested == "torch":
        return "torch was asked for"
    if not triton_available():
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and requested == "triton":
        return None if interpreter_active() else "CPU tensors need TRITON_INTERPRET=1 before triton is imported"
    return f"the Triton kernels run on CUDA, not {device.type}"


def choose(key: str, requested: str, device: torch.device | str, check: Callable[[], None]) -> BackendChoice:
    """Triton if it can run here and ``check()`` passes, else the twin (one warning line
    when Triton was asked for explicitly or is the default on this device)."""
    device = torch.device(device)
    reason = why_not_triton(requested, device)
    if reason is not None:
        quiet = requested == "torch" or (requested == "auto" and device.type != "cuda")
        if not quiet:
            log.warning("%s=%s: %s; using the torch twin", key, requested, reason)
        return BackendChoice(key, requested, "torch", "" if requested == "torch" else reason)
    try:
        check()
    except Exception as exc:  # any failure to compile, launch or agree degrades to the twin
        return fall_back(BackendChoice(key, requested, "triton"), "its start-up check", exc)
    return BackendChoice(key, requested, "triton")


def choose_attention(requested: str, device: torch.device | str, dtype: torch.dtype, num_heads: int,
                     num_kv_heads: int, head_dim: int, block_size: int, sliding_window: int | None) -> BackendChoice:
    """The attention backend for this geometry (:func:`check_attention` decides)."""
    return choose(ATTENTION_KEY, requested, device, lambda: check_attention(
        device, dtype, num_heads, num_kv_heads, head_dim, block_size, sliding_window))


def choose_rejection(requested: str, device: torch.device | str, method: str, vocab_size: int) -> BackendChoice:
    """The verification backend: the kernel's check, then every binary ``method`` can
    launch compiled; synthetic verification has no kernel (the twin)."""
    if method not in ("strict", "probabilistic"):
        return BackendChoice(REJECTION_KEY, requested, "torch", f"{method} verification has no kernel")

    def check() -> None:
        from specserve.kernels.launches import compile_only
        from specserve.kernels.specializations import rejection_launches

        check_rejection(device, vocab_size, method)
        for launch in rejection_launches(method, vocab_size, device):
            compile_only(launch)

    return choose(REJECTION_KEY, requested, device, check)


def fall_back(choice: BackendChoice, stage: str, exc: BaseException) -> BackendChoice:
    """The twin from now on, with ONE warning line saying why."""
    reason = f"the Triton kernel failed {stage}: {type(exc).__name__}: {_first_line(exc)}"
    log.warning("%s=%s: %s; using the torch twin", choice.key, choice.requested, reason)
    return BackendChoice(choice.key, choice.requested, "torch", reason)


def _first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


# --------------------------------------------------------------------------- checks


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)


def check_attention(device: torch.device | str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                    head_dim: int, block_size: int, sliding_window: int | None) -> None:
    """Run the KV write and paged attention (with and without split-KV) on a small random
    batch of this geometry -- a decode, a verification of 4 and a prefill chunk of 9 over
    shuffled block tables -- and compare with the twins; raises on any difference."""
    from specserve.kernels import paged_attention as pa

    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    qlens, ctxs = [1, 4, 9], [37, 20, 30]
    B, T = len(qlens), sum(qlens)
    nblocks = [-(-c // block_size) for c in ctxs]
    width = max(nblocks) + 1
    perm = torch.randperm(sum(nblocks) + 1, generator=g)
    tables = torch.zeros(B, width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(nblocks):
        tables[b, :n] = perm[at : at + n].to(torch.int32)
        at += n
    slots_total = (sum(nblocks) + 1) * block_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    k_cache, v_cache = rand(slots_total, num_kv_heads, head_dim), rand(slots_total, num_kv_heads, head_dim)
    q, k, v = rand(T, num_heads, head_dim), rand(T, num_kv_heads, head_dim), rand(T, num_kv_heads, head_dim)
    slot = []
    for b in range(B):  # the new tokens are the last qlen positions of each context
        for p in range(ctxs[b] - qlens[b], ctxs[b]):
            slot.append(int(tables[b, p // block_size]) * block_size + p % block_size)
    slot_mapping = torch.tensor(slot, dtype=torch.int64, device=dev)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    pa.write_kv_reference(k, v, ref_k, ref_v, slot_mapping)
    pa.write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    if not (torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)):
        raise KernelCheckError("write_kv: the cache differs from the torch twin's")
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables.to(dev), query_start_loc=qsl,
                seq_lens=torch.tensor(ctxs, dtype=torch.int32, device=dev), block_size=block_size,
                scale=head_dim**-0.5, sliding_window=sliding_window, max_query_len=max(qlens))
    want = pa.paged_attention_reference(**args)
    _compare("paged_attention", pa.paged_attention_triton(**args, num_splits=1), want, dtype)
    decode = dict(args, query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev), q=q[:1],
                  block_tables=args["block_tables"][:1], seq_lens=args["seq_lens"][:1], max_query_len=1)
    _compare("paged_attention (split-KV)", pa.paged_attention_triton(**decode, num_splits=2),
             pa.paged_attention_reference(**decode), dtype)


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    try:
        torch.testing.assert_close(got.float(), want.float(), **_tolerance(dtype))
    except AssertionError:
        err = (got.float() - want.float()).abs().nan_to_num(float("inf")).max().item()
        raise KernelCheckError(f"{name}: differs from the torch twin by up to {err:.3g}") from None


def check_rejection(device: torch.device | str, vocab_size: int, method: str) -> None:
    """Verify a small random batch (3 requests, K = 2, the engine's vocabulary) with the
    kernel and with the twin, strict and (for ``probabilistic``) probabilistic with and
    without draft probabilities; the tokens must be equal."""
    from specserve.kernels import rejection_kernel
    from specserve.sampling.rejection import RejectionUniforms, verify_chain

    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    B, K, V = 3, 2, vocab_size
    probs = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 4, dim=-1).to(dev)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 4, dim=-1).to(dev)
    drafts = torch.randint(0, V, (B, K), generator=g)
    drafts[:, 0] = probs[:, 0].argmax(-1).cpu()  # some drafts are accepted
    num = torch.tensor([2, 1, 0])
    drafts = torch.where(torch.arange(K)[None, :] < num[:, None], drafts, -1).to(dev)
    num = num.to(dev)
    u = RejectionUniforms(accept=torch.rand(B, K, generator=g).to(dev), sample=torch.rand(B, K + 1, generator=g).to(dev))
    cases = [("strict", None)] + ([("probabilistic", q), ("probabilistic", None)] if method == "probabilistic" else [])
    for m, dq in cases:
        ids, acc = rejection_kernel.rejection_sample_triton(probs, drafts, num, dq, u.accept, u.sample, m)
        ref = verify_chain(probs, drafts, num, dq, u, m, use_kernel=False)
        if not (torch.equal(ids, ref.output_token_ids) and torch.equal(acc, ref.num_accepted)):
            raise KernelCheckError(f"rejection ({m}): tokens differ from the torch twin's")
