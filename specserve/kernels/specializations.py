"""Every Triton binary an engine can launch for its configuration, enumerated ahead of time.

What varies from step to step and is not specialised on (batch size, token count,
split count, table widths: ``paged_attention.ATTN``) never asks for a new binary.
What is left is the attention tile plan of a step's ints (``paged_attention._tile_plan``:
BLOCK_Q follows the longest query up to a cap, FLAT the batch's shape) and whether
the KV is split (a decode step with few sequences and long contexts).  So
:func:`runner_step_shapes` walks every step a ``StaticStepRunner`` can run -- decode
at every batch size (captured buckets or eager), uniform verification of each
captured q per bucket, and mixed steps whose longest query is each power of two (and
one more) up to the token budget, alone or beside other sequences -- and keeps one
step per distinct plan.  A runner whose steps may carry draft trees adds the TREE
binary of each of those plans (never split) and of its uniform tree steps.
:func:`runner_launches` turns those steps into launches
(KV write, attention, split-KV reduce) and :func:`rejection_launches` adds the
verification kernel's; each list holds one launch per binary.

The start-up warm-up compiles these (``StaticStepRunner.warm_up``), so no step
compiles while serving; ``scripts/triton_aot_report.py`` compiles the same list for
other GPUs without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.executor.batch import batch_buckets
from specserve.kernels.launches import Launch, specialization


@dataclass(frozen=True)
class AttentionGeometry:
    """What the attention kernels are compiled for, besides the step's ints."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    sliding_window: int | None
    dtype: torch.dtype


@dataclass(frozen=True)
class StepShape:
    """The ints of one step's attention launch."""

    num_seqs: int
    num_tokens: int
    max_query_len: int
    num_splits: int
    tree: bool = False  # the step carries draft trees (the kernel's TREE binary)


def _plan_key(g: AttentionGeometry, s: StepShape) -> tuple:
    from specserve.kernels.paged_attention import _tile_plan

    p = _tile_plan(s.num_tokens, s.num_seqs, g.num_heads, g.num_kv_heads, g.head_dim, s.max_query_len,
                   dtype=g.dtype)
    return (p["BLOCK_Q"], p["BLOCK_M"], p["BLOCK_N"], p["FLAT"], p["num_warps"], s.num_splits > 1, s.tree)


def runner_step_shapes(g: AttentionGeometry, *, max_num_seqs: int, max_tokens: int,
                       graph_query_lens: tuple[int, ...], max_seq_len: int, split_kv: bool,
                       num_sms: int | None = None, trees: bool = False,
                       tree_query_lens: tuple[int, ...] = ()) -> list[StepShape]:
    """One step per distinct attention binary a static runner of this configuration can
    launch.  ``split_kv``: decode steps may split the KV (Triton on CUDA); ``num_sms``
    as for ``default_num_splits``; ``trees``: steps may carry draft trees (uniform ones
    of ``tree_query_lens`` per bucket, and any mixed shape)."""
    from specserve.kernels.paged_attention import default_num_splits

    def shape(B: int, T: int, q: int) -> StepShape:
        splits = 1
        if split_kv and q == 1:
            splits = default_num_splits(B, g.num_heads, g.num_kv_heads, g.head_dim, 1, max_seq_len, num_sms)
        return StepShape(B, T, q, splits)

    candidates = [shape(B, B, 1) for B in range(1, max_num_seqs + 1)]  # decode, any batch size
    for q in graph_query_lens:  # uniform verification (and decode) of each bucket
        candidates += [shape(b, b * q, q) for b in batch_buckets(max_num_seqs) if b * q <= max_tokens]
    p = 2
    while p <= max_tokens:  # mixed steps: the longest query sets BLOCK_Q, the others FLAT
        for q in (p, p + 1):
            for B in {1, 2, max_num_seqs}:
                for T in {q, q + B - 1, B * q}:
                    if q <= max_tokens and B <= max_num_seqs and T <= max_tokens:
                        candidates.append(shape(B, T, q))
        p *= 2
    if trees:
        candidates += [StepShape(b, b * q, q, 1, tree=True) for q in tree_query_lens
                       for b in batch_buckets(max_num_seqs) if b * q <= max_tokens]
        candidates += [StepShape(s.num_seqs, s.num_tokens, s.max_query_len, 1, tree=True) for s in candidates]
    seen: dict[tuple, StepShape] = {}
    for s in candidates:
        seen.setdefault(_plan_key(g, s), s)
    return list(seen.values())


def _dedupe(launches: list[Launch]) -> list[Launch]:
    seen: dict[tuple, Launch] = {}
    for launch in launches:
        seen.setdefault(specialization(launch), launch)
    return list(seen.values())


def runner_launches(g: AttentionGeometry, shapes: list[StepShape], device: torch.device | str,
                    interpreted: bool = False) -> list[Launch]:
    """One launch per binary of those steps (KV write, attention, split-KV reduce)."""
    from specserve.kernels.paged_attention import step_launches

    out: list[Launch] = []
    for s in shapes:
        out += step_launches(s.num_seqs, s.num_tokens, s.max_query_len, s.num_splits, num_heads=g.num_heads,
                             num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, block_size=g.block_size,
                             sliding_window=g.sliding_window, dtype=g.dtype, device=device, interpreted=interpreted,
                             tree=s.tree)
    return _dedupe(out)


def rejection_launches(method: str, vocab_size: int, device: torch.device | str,
                       block_v: int | None = None) -> list[Launch]:
    """One launch per binary verification with ``method`` can need (none for synthetic);
    ``block_v`` None = the default for ``device``."""
    if method not in ("strict", "probabilistic"):
        return []
    from specserve.kernels.rejection_kernel import variant_launches

    return _dedupe(variant_launches(method, vocab_size, device, block_v))
