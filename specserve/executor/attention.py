"""Attention over the paged KV cache for a flattened ragged batch.

Tokens of all sequences lie on one axis T.  :func:`write_and_attend` writes the
new tokens' K/V into their cache slots, then attends in one of two ways, chosen
by the step's ``AttentionMetadata``:

* the reference (``batch_metadata``; what runs on the CPU): a long prefill with
  no cached context runs alone as causal SDPA on its own keys; every other
  sequence (decode tokens, K+1 verification positions, chunked prefills with
  cached context) joins a padded group whose keys are gathered from the cache by
  slot index, with a mask built from absolute positions (key j is visible to a
  query at position p iff j <= p, and p - j < window when a sliding window is
  set).  The group is padded to (sequences, longest query, longest context):
  a prompt chunk beside decode rows makes it that large.  A sequence with a
  draft tree (``StepBatch.tree_base`` / ``tree_masks``) always joins the group:
  its keys before tree_base follow the rule above by the query's rotary
  position, its keys from tree_base on are visible by the query's bitmask;
* the paged kernel (``kernels.paged_attention``, Triton or its torch twin) over
  block tables: ``PagedKernelArgs``, from the step runner's persistent buffers
  or, for an eager forward, from ``kernel_metadata``.  Nothing is gathered or
  masked outside the kernel, whatever the mix of prompt chunks and decode rows.

All index tensors are built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from specserve.executor.batch import int64_masks


@dataclass
class CausalGroup:
    """One sequence whose new tokens are its whole context (a fresh prefill)."""

    start: int  # offset of its first token on the T axis
    length: int


@dataclass
class PaddedGroup:
    """Sequences attending to cached context, padded to (B, Q) x (B, L)."""

    q_index: Tensor  # (B*Q,) int64 index into T (padding points at a valid token; dropped on scatter)
    q_valid: Tensor  # (B*Q,) bool
    q_flat_index: Tensor  # (n_valid,) int64: the T indices of valid queries, in (B, Q) order
    kv_slots: Tensor  # (B*L,) int64 cache slot of key position j of sequence b
    mask: Tensor | None  # (B, 1, Q, L) bool, True = attend; None when every key is visible
    B: int
    Q: int
    L: int
    # The group's queries are exactly T[offset : offset + B*Q] in (B, Q) order (a
    # decode or verification batch with equal lengths): no gather or scatter.
    dense_offset: int | None


@dataclass
class PagedKernelArgs:
    """The paged-attention kernel's view of a step (``kernels.paged_attention``): every
    tensor is a slice of the step runner's persistent buffers, every int fixed per
    batch bucket, so a step built on them can be captured in a CUDA graph."""

    block_tables: Tensor  # (B, max_blocks) int32
    query_start: Tensor  # (B+1,) int32
    seq_lens: Tensor  # (B,) int32
    block_size: int
    max_query_len: int
    max_seq_len: int
    num_splits: int = 1
    scratch: tuple[Tensor, Tensor] | None = None
    impl: str = "auto"  # "triton", or "torch" = the twin: what the runner's start-up check chose
    window: int | None = None  # sliding window
    # Draft trees (the kernel's TREE binary); all None for a step without trees.
    tree_base: Tensor | None = None  # (B,) int32
    tree_masks: Tensor | None = None  # (T,) int64
    tree_positions: Tensor | None = None  # (T,) int64: the step's rotary positions


@dataclass
class AttentionMetadata:
    slot_mapping: Tensor  # (T,) int64: the cache slot each new token's K/V is written to
    causal: list[CausalGroup] = field(default_factory=list)
    padded: PaddedGroup | None = None
    scale: float | None = None
    # Set by the step runner: attention runs as ONE paged kernel over block tables
    # (all slots valid: padding tokens write to the cache's trash slot).
    kernel: PagedKernelArgs | None = None
    # A draft head's layer runs whole in one fused CPU call (``kernels.cpu_decoder.
    # FusedHead``) over this layout (a ``FusedStepArgs``): nothing here attends.
    fused: object | None = None


def build_padded_group(
    q_starts: list[int],  # per sequence: offset of its first new token on T
    q_lens: list[int],  # per sequence: number of new tokens
    ctx_lens: list[int],  # per sequence: context length INCLUDING the new tokens
    block_tables: list[list[int]],
    block_size: int,
    window: int | None,
    device: torch.device,
    tree: "TreeInputs | None" = None,
) -> PaddedGroup:
    B = len(q_lens)
    Q = max(q_lens)
    L = max(ctx_lens)
    q_len_t = torch.tensor(q_lens, dtype=torch.int64)
    ctx_t = torch.tensor(ctx_lens, dtype=torch.int64)
    ar_q = torch.arange(Q, dtype=torch.int64)
    q_valid = ar_q[None, :] < q_len_t[:, None]  # (B, Q)
    q_index = torch.tensor(q_starts, dtype=torch.int64)[:, None] + torch.minimum(ar_q[None, :], q_len_t[:, None] - 1)
    # Absolute position of each query: the new tokens are the last q_len of the context.
    q_pos = (ctx_t - q_len_t)[:, None] + ar_q[None, :]  # (B, Q)
    k_pos = torch.arange(L, dtype=torch.int64)  # (L,)
    if tree is not None:
        mask = _tree_mask(tree, q_index, q_pos, k_pos, ctx_t, window)
    else:
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx_t[:, None, None])
        if window is not None:
            mask &= q_pos[:, :, None] - k_pos[None, None, :] < window
    nblk = (L + block_size - 1) // block_size
    bt = torch.zeros(B, nblk, dtype=torch.int64)
    for b, table in enumerate(block_tables):
        n = min(len(table), nblk)
        bt[b, :n] = torch.tensor(table[:n], dtype=torch.int64)
    kv_slots = bt[:, k_pos // block_size] * block_size + (k_pos % block_size)[None, :]  # (B, L)
    valid_flat = q_valid.reshape(-1)
    dense = all(n == Q for n in q_lens) and all(st == q_starts[0] + i * Q for i, st in enumerate(q_starts))
    return PaddedGroup(
        q_index=q_index.reshape(-1).to(device),
        q_valid=valid_flat.to(device),
        q_flat_index=q_index.reshape(-1)[valid_flat].to(device),
        kv_slots=kv_slots.reshape(-1).to(device),
        mask=None if bool(mask.all()) else mask[:, None].to(device),
        B=B, Q=Q, L=L,
        dense_offset=q_starts[0] if dense else None,
    )


@dataclass
class TreeInputs:
    """A padded group's draft-tree inputs: what its mask is built from."""

    tree_base: list[int]  # per group sequence; its context length when it has no tree
    positions: Tensor  # (T,) int64 rotary positions of the step's tokens
    masks: Tensor  # (T,) int64 bitmasks over [tree_base, ctx) of the step's tokens


def _tree_mask(tree: TreeInputs, q_index: Tensor, q_pos: Tensor, k_pos: Tensor, ctx_t: Tensor,
               window: int | None) -> Tensor:
    """(B, Q, L) visibility of a group holding tree sequences.  Keys before a sequence's
    tree_base: causal and windowed by the query's rotary position (its context index when
    the sequence has no tree, as without trees); keys in [tree_base, ctx): by the bitmask."""
    base = torch.tensor(tree.tree_base, dtype=torch.int64)[:, None, None]  # (B, 1, 1)
    has_tree = base[:, :, 0] < ctx_t[:, None]  # (B, 1)
    vis_pos = torch.where(has_tree, tree.positions[q_index], q_pos)[:, :, None]  # (B, Q, 1)
    kp = k_pos[None, None, :]
    before = (kp < base) & (kp <= vis_pos)
    if window is not None:
        before &= vis_pos - kp < window
    bit = (kp - base).clamp(0, 63)
    in_tree = (kp >= base) & (kp < ctx_t[:, None, None]) & ((tree.masks[q_index][:, :, None] >> bit) & 1).bool()
    return before | in_tree


def write_and_attend(
    q: Tensor,  # (T, nh, hd)
    k: Tensor,  # (T, nkv, hd) new keys
    v: Tensor,  # (T, nkv, hd) new values
    k_cache: Tensor,  # (S, nkv, hd) flat slots
    v_cache: Tensor,
    meta: AttentionMetadata,
) -> Tensor:
    """Write the new K/V into their slots, then attend.  Returns (T, nh, hd)."""
    if meta.fused is not None:
        raise ValueError("write_and_attend: this step's metadata is for a fused head layer (FusedHead)")
    if meta.kernel is not None:
        return _kernel_attention(q, k, v, k_cache, v_cache, meta)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    nh, hd = q.shape[1], q.shape[2]
    gqa = nh != k.shape[1]
    out = torch.empty_like(q)
    for g in meta.causal:
        s, n = g.start, g.length
        qs = q[s : s + n].transpose(0, 1)  # (nh, n, hd)
        ks = k[s : s + n].transpose(0, 1)
        vs = v[s : s + n].transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=meta.scale, enable_gqa=gqa)
        out[s : s + n] = o.transpose(0, 1)
    p = meta.padded
    if p is not None:
        B, Q, L = p.B, p.Q, p.L
        # index_select, not advanced indexing: it has a cheap single-threaded path
        # for small gathers that stays fast on a loaded 2-core machine.
        if p.dense_offset is not None:
            qp = q[p.dense_offset : p.dense_offset + B * Q]
        else:
            qp = q.index_select(0, p.q_index)
        qp = qp.view(B, Q, nh, hd).transpose(1, 2)  # (B, nh, Q, hd)
        kp = k_cache.index_select(0, p.kv_slots).view(B, L, -1, hd).transpose(1, 2)  # (B, nkv, L, hd)
        vp = v_cache.index_select(0, p.kv_slots).view(B, L, -1, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=meta.scale, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(B * Q, nh, hd)  # (B*Q, nh, hd)
        if p.dense_offset is not None:
            if not meta.causal and p.dense_offset == 0 and B * Q == q.shape[0]:
                return o  # the whole batch is this group
            out[p.dense_offset : p.dense_offset + B * Q] = o
        else:
            out.index_copy_(0, p.q_flat_index, o[p.q_valid])
    return out


def _kernel_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                      meta: AttentionMetadata) -> Tensor:
    from specserve.kernels.paged_attention import paged_attention as kernel_attention
    from specserve.kernels.paged_attention import write_kv

    a = meta.kernel
    assert a is not None
    if a.impl == "torch":  # every slot is valid (padding -> trash slot): no boolean masks, no sync
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    else:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, impl=a.impl)
    scale = meta.scale if meta.scale is not None else q.shape[-1] ** -0.5
    return kernel_attention(
        q, k_cache, v_cache, a.block_tables, a.query_start, a.seq_lens, block_size=a.block_size, scale=scale,
        sliding_window=a.window, max_query_len=a.max_query_len,
        max_seq_len=a.max_seq_len, num_splits=a.num_splits, scratch=a.scratch, impl=a.impl,
        tree_base=a.tree_base, tree_masks=a.tree_masks, positions=a.tree_positions,
    )


def batch_metadata(batch, block_size: int, device: torch.device, window: int | None = None,
                   min_causal_len: int = 2) -> tuple[AttentionMetadata, Tensor]:
    """(attention metadata, positions (T,)) for a forward over a ``StepBatch`` in a paged
    cache: fresh sequences of at least ``min_causal_len`` new tokens (within the window)
    attend causally among them; the others read their cached positions through a padded
    group."""
    causal: list[CausalGroup] = []
    starts, lens, ctx, tables, bases = [], [], [], [], []
    qs = batch.query_start
    tree_base = batch.tree_base
    for b, n_ctx in enumerate(batch.seq_lens):
        s, n = qs[b], qs[b + 1] - qs[b]
        fresh = tree_base is None or tree_base[b] >= n_ctx
        if fresh and n_ctx == n and n >= min_causal_len and (window is None or n <= window):
            causal.append(CausalGroup(start=s, length=n))
        else:
            starts.append(s)
            lens.append(n)
            ctx.append(n_ctx)
            tables.append(batch.block_tables[b])
            bases.append(n_ctx if tree_base is None else tree_base[b])
    tree = None
    if batch.tree_masks is not None and any(b < c for b, c in zip(bases, ctx)):
        tree = TreeInputs(tree_base=bases, positions=torch.tensor(batch.positions, dtype=torch.int64),
                          masks=torch.tensor(int64_masks(batch.tree_masks), dtype=torch.int64))
    padded = build_padded_group(starts, lens, ctx, tables, block_size, window, device, tree) if lens else None
    meta = AttentionMetadata(slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.int64, device=device),
                             causal=causal, padded=padded)
    return meta, torch.tensor(batch.positions, dtype=torch.int64, device=device)


def kernel_metadata(batch, block_size: int, device: torch.device, impl: str, window: int | None = None,
                    ) -> tuple[AttentionMetadata, Tensor]:
    """(attention metadata, positions (T,)) for an eager forward over a ``StepBatch`` on the
    paged kernel (``impl``: "triton" or the twin "torch", as the target's check chose):
    each sequence's block table cut to its context, its query start and length as int32
    tensors made for this batch (no persistent buffers), one launch without split-KV; a step
    with draft trees adds its tree bases, masks and positions (the TREE binary)."""
    qs, lens = batch.query_start, batch.seq_lens
    need = [-(-n // block_size) for n in lens]
    width = max(need, default=1) or 1
    tables = [list(t[:n]) + [0] * (width - min(len(t), n)) for t, n in zip(batch.block_tables, need)]
    i32 = dict(dtype=torch.int32, device=device)
    positions = torch.tensor(batch.positions, dtype=torch.int64, device=device)
    tree = batch.tree_masks is not None
    args = PagedKernelArgs(
        block_tables=torch.tensor(tables, **i32).view(len(lens), width), query_start=torch.tensor(qs, **i32),
        seq_lens=torch.tensor(lens, **i32), block_size=block_size,
        max_query_len=max((qs[b + 1] - qs[b] for b in range(len(lens))), default=0),
        max_seq_len=max(lens, default=0), num_splits=1, impl=impl, window=window,
        tree_base=torch.tensor(batch.tree_base, **i32) if tree else None,
        tree_masks=torch.tensor(int64_masks(batch.tree_masks), dtype=torch.int64, device=device) if tree else None,
        tree_positions=positions if tree else None,
    )
    meta = AttentionMetadata(slot_mapping=torch.tensor(batch.slot_mapping, dtype=torch.int64, device=device),
                             kernel=args)
    return meta, positions
