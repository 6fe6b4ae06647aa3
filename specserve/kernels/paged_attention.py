"""Paged attention and the paged KV-cache write: Triton kernels with torch twins.

One launch of :func:`paged_attention` serves a whole flattened ragged batch:
decode rows (1 query), speculative verification (K+1 queries, causal among the
new tokens) and chunked prefill over cached context.  The K/V of the new tokens
must already be in the cache (:func:`write_kv`); the kernel reads every key,
old or new, from the cache through the block tables.

Data layout (as :class:`specserve.executor.kv_cache.KVCache`)::

    q            (T, nh, hd)          new tokens of all sequences, back to back
    k/v_cache    (S, nkv, hd)         slot = block_id * block_size + offset
    block_tables (B, max_blocks) i32  rows may be padded past what they use
    query_start_loc (B+1,) i32        sequence b owns tokens [qsl[b], qsl[b+1])
    seq_lens     (B,) i32             context length INCLUDING the new tokens
    out          (T, nh, hd)          q's dtype

Masking rule.  Sequence b has qlen_b = qsl[b+1] - qsl[b] new tokens; they are
the last qlen_b positions of its context, so its query i sits at absolute
position p = seq_lens[b] - qlen_b + i and sees key position j iff j <= p (and
p - j < sliding_window when a window is set).  A sequence slot with qlen 0 is
padding: nothing is read or written for it.  Tokens outside
[qsl[0], qsl[B]) are never written.

Draft trees (TREE).  With ``tree_base`` (B,) int32, ``tree_masks`` (T,) int64 and
``positions`` (T,) int64 (the tokens' rotary positions), a sequence whose
tree_base[b] < seq_lens[b] verifies a tree: its query t sees key j < tree_base[b]
iff j <= positions[t] (and positions[t] - j < window), and key j in
[tree_base[b], seq_lens[b]) iff bit j - tree_base[b] of tree_masks[t] is set.
A sequence with tree_base[b] = seq_lens[b] keeps the causal rule.  A mask has no
bit past its token's own context index (``StepBatch.from_inputs`` checks), so a
tile's key range still ends at its last query; tree keys are not windowed (the
caller leaves ancestors outside a window out of the masks).  Without the three
tensors the launch is the non-TREE binary, unchanged.

Attention kernel (``_attn_kernel``).  Grid ``(num_q_tiles, nkv, num_splits)``.
A program owns one query tile of one sequence for one KV head: BLOCK_Q query
positions x the GROUP = nh / nkv query heads that share the KV head, packed as
BLOCK_M = max(16, BLOCK_Q * GROUP_PAD) rows (row r = query r // GROUP_PAD, head
r % GROUP_PAD), so each K/V tile is loaded once for the whole group::

    Q tile   (BLOCK_M, hd)                       loaded once
    for each BLOCK_N keys in this program's key range:
        slots = block_tables[b, j // block_size] * block_size + j % block_size
        K, V   (BLOCK_N, hd)                     gathered by slot
        S = Q @ K^T * scale * log2(e)            (BLOCK_M, BLOCK_N) fp32, masked
        online softmax in base 2: m, l (BLOCK_M,), acc (BLOCK_M, hd) fp32

The key range of a tile is [lo, hi): hi = 1 + the position of its last query,
lo = 0, or with a window the first key its first
query can see (rounded down to BLOCK_N; for a tree tile, by its smallest rotary
position and at most tree_base).  Query tiles are numbered in one of two ways, both fixed by Python
ints only (no tensor values), so the grid is the same on every replay of a
captured CUDA graph:

* seq-major: tile = b * qb_per_seq + qb with qb_per_seq = cdiv(max_query_len,
  BLOCK_Q); B * qb_per_seq programs.  Used when that is the smaller grid
  (decode and uniform verification batches).
* flat: sequence b's tiles start at qsl[b] // BLOCK_Q + b; at most
  T // BLOCK_Q + B programs, found by a binary search over query_start_loc.
  Used for mixed batches where one long chunk would otherwise make every
  sequence pay cdiv(max_query_len, BLOCK_Q) empty programs.

Programs whose tile lies past their sequence's qlen (or whose sequence is a
qlen-0 padding slot) return at once.  max_query_len must bound every qlen (a
bucket value is fine): the seq-major numbering has no tile for queries past it.
Every key tile is masked (causal, window, end of range); there is no separate
unmasked loop for interior tiles yet.  P is rounded to the cache dtype for the
P @ V dot (fp32 accumulation), as flash attention does.

Split-KV (flash-decoding).  With num_splits = S > 1, the n tiles of BLOCK_N keys
in a program's key range are cut into S contiguous runs of cdiv(n, S) tiles;
split s writes, per query row, its normalised partial output and log-sum-exp
(base 2) to scratch::

    part_o   (S_max, T_max, nh, hd) fp32     acc / l
    part_lse (S_max, T_max, nh)     fp32     m + log2(l), -inf when l == 0

An empty split (fewer tiles than splits) writes only lse = -inf.  The reduce
kernel (``_reduce_kernel``, grid (T, nh), one program per output row, tokens
outside [qsl[0], qsl[B]) return at once) combines them::

    M = max_s lse_s;  w_s = 2^(lse_s - M);  out = sum_s w_s * o_s / sum_s w_s

loading o_s only where lse_s > -inf, so stale scratch is never read.

KV write kernel (``_write_kv_kernel``).  Grid (T,): one program copies one
token's (nkv, hd) K and V rows into slot slot_mapping[t]; a negative slot is
padding and is skipped.

Binaries.  Triton compiles one binary per specialization; the ints that vary
from step to step (batch size, split count, the binary search's steps, table
widths, q's layout) are not specialised on (``ATTN``, ``REDUCE``, ``WRITE_KV``),
so a model and dtype need one binary per tile plan (BLOCK_Q, FLAT, SPLIT; TREE for
steps with draft trees, never split) and the reduce one for any split count
(SPLITS_PAD = 16).  :func:`step_launches`
gives the launches of a step's ints on stand-in tensors: what the start-up
warm-up compiles.  fp32 tiles are 16 x 16 (CUDA-core dots; larger ones spill).

Torch twins (:func:`paged_attention_reference`, :func:`write_kv_reference`)
compute the same things by gathering slots from the block tables and a masked
fp32 softmax; they run anywhere and are what the dispatchers use off CUDA.

On CUDA the kernels are compiled.  CPU tensors need Triton's interpreter
(``TRITON_INTERPRET=1`` before triton is first imported; slow, for tests).
There the bf16/fp16 ``tl.dot`` operands are upcast to fp32 (DOT_UPCAST): the
interpreter's dot multiplies bf16 bit patterns as integers.  The products of
bf16 values are exact in fp32, so this matches the compiled kernel's bf16
tensor-core dots with fp32 accumulation up to summation order.
triton is imported behind a guard, so ``import specserve.kernels`` works
without it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from specserve.kernels.launches import KernelDef, Launch
from specserve.kernels.launches import run as run_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # only the torch twins are usable
    triton = None
    tl = None

__all__ = [
    "default_num_splits",
    "interpreter_active",
    "make_split_scratch",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_triton",
    "step_launches",
    "write_kv",
    "write_kv_reference",
    "write_kv_triton",
]

_LOG2E = 1.4426950408889634
# split-KV heuristic: never give a split fewer keys than this, nor use more splits than that
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 16
_DEFAULT_NUM_SMS = 132  # H100 SXM; used when the device cannot be asked


# --------------------------------------------------------------------------- kernels


def _attn_kernel(
    q_ptr,  # (T, nh, hd)
    k_cache_ptr,  # (S, nkv, hd)
    v_cache_ptr,  # (S, nkv, hd)
    out_ptr,  # (T, nh, hd), written when not SPLIT
    part_o_ptr,  # (S_max, T_max, nh, hd) fp32, written when SPLIT
    part_lse_ptr,  # (S_max, T_max, nh) fp32, written when SPLIT
    block_tables_ptr,  # (B, max_blocks) int32
    qsl_ptr,  # (B+1,) query_start_loc
    seq_lens_ptr,  # (B,)
    tree_base_ptr,  # (B,) int32, read only when TREE
    tree_mask_ptr,  # (T,) int64, read only when TREE
    tree_pos_ptr,  # (T,) rotary positions, read only when TREE
    scale_log2,  # softmax scale * log2(e)
    window,  # sliding window (read only when SLIDING)
    num_seqs,  # B
    qb_per_seq,  # query tiles per sequence (seq-major numbering; unused when FLAT)
    num_splits,
    search_steps,  # ceil(log2(B)) for the FLAT binary search (extra steps are harmless)
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_bt,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    HEAD_DIM: tl.constexpr,
    HD_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query positions per tile
    BLOCK_M: tl.constexpr,  # rows per tile: max(16, BLOCK_Q * GROUP_PAD)
    BLOCK_N: tl.constexpr,  # keys per inner step
    PAGE: tl.constexpr,  # KV cache block size (power of two)
    FLAT: tl.constexpr,
    SLIDING: tl.constexpr,
    SPLIT: tl.constexpr,
    TREE: tl.constexpr,  # some sequence verifies a draft tree: per-token bitmasks and positions
    DOT_PREC: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # interpreter only: its tl.dot multiplies bf16 bit patterns as integers
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # ---- which sequence and which of its query tiles
    if FLAT:
        # largest b with qsl[b] // BLOCK_Q + b <= pid (the tile starts are increasing in b)
        lo = pid * 0
        hi = lo + num_seqs
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            go = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        b = lo
        qb = pid - (tl.load(qsl_ptr + b) // BLOCK_Q + b)
    else:
        b = pid // qb_per_seq
        qb = pid % qb_per_seq
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if qb * BLOCK_Q >= q_len:
        return  # past this sequence's queries (or a qlen-0 padding slot)
    seq_len = tl.load(seq_lens_ptr + b)
    first_pos = seq_len - q_len  # absolute position of the sequence's query 0

    # ---- the query tile: (BLOCK_M, HD_PAD), rows = (query, head in group)
    rows = tl.arange(0, BLOCK_M)
    qi = qb * BLOCK_Q + rows // GROUP_PAD  # query index within the sequence
    g = rows % GROUP_PAD
    row_ok = (rows < BLOCK_Q * GROUP_PAD) & (g < GROUP) & (qi < q_len)
    pos = tl.where(row_ok, first_pos + qi, -1)  # -1: an unused row sees no key
    head = kvh * GROUP + g
    tok = (q_start + qi).to(tl.int64)
    d = tl.arange(0, HD_PAD)
    d_ok = d < HEAD_DIM
    q_tile = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # ---- this program's key range [k_begin, k_end)
    tile_first = first_pos + qb * BLOCK_Q
    k_hi = first_pos + tl.minimum(qb * BLOCK_Q + BLOCK_Q, q_len)  # 1 + last query position of the tile
    if TREE:
        # keys before tree_base by rotary position (by context index without a tree), the
        # tree range [tree_base, seq_len) by bitmask
        t_base = tl.load(tree_base_ptr + b)
        is_tree = t_base < seq_len
        rot = tl.load(tree_pos_ptr + tok, mask=row_ok, other=0).to(tl.int32)
        vpos = tl.where(row_ok, tl.where(is_tree, rot, pos), -1)
        q_bits = tl.load(tree_mask_ptr + tok, mask=row_ok, other=0).to(tl.int64)
        tile_first = tl.min(tl.where(row_ok, vpos, seq_len), axis=0)
    k_lo = k_hi * 0
    if SLIDING:
        k_lo = tl.maximum(tile_first - window + 1, 0)
        if TREE:
            k_lo = tl.minimum(k_lo, t_base)  # tree keys are not windowed
        k_lo = (k_lo // BLOCK_N) * BLOCK_N
    n_tiles = (k_hi - k_lo + BLOCK_N - 1) // BLOCK_N
    per_split = (n_tiles + num_splits - 1) // num_splits
    k_begin = k_lo + split * per_split * BLOCK_N
    k_end = tl.minimum(k_begin + per_split * BLOCK_N, k_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for start in range(k_begin, k_end, BLOCK_N):
        kj = start + cols  # key positions (BLOCK_N,)
        k_ok = kj < k_end
        blk = tl.load(bt_row + kj // PAGE, mask=k_ok, other=0).to(tl.int64)
        slot = blk * PAGE + (kj % PAGE)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k_tile = tl.load(
            k_cache_ptr + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0
        )  # (BLOCK_N, HD_PAD)
        if DOT_UPCAST:
            s = tl.dot(q_tile.to(tl.float32), tl.trans(k_tile.to(tl.float32)), input_precision=DOT_PREC)
        else:
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PREC)
        s = s * scale_log2  # (BLOCK_M, BLOCK_N)
        if TREE:
            vis = (kj[None, :] < t_base) & (kj[None, :] <= vpos[:, None])
            if SLIDING:
                vis = vis & (vpos[:, None] - kj[None, :] < window)
            in_tree = (kj >= t_base) & (kj < seq_len)
            shift = tl.where(in_tree, kj - t_base, 0).to(tl.int64)
            bit = (q_bits[:, None] >> shift[None, :]) & 1
            vis = (vis | (in_tree[None, :] & (bit != 0))) & k_ok[None, :]
        else:
            vis = (kj[None, :] <= pos[:, None]) & k_ok[None, :]
            if SLIDING:
                vis = vis & (pos[:, None] - kj[None, :] < window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_tile = tl.load(
            v_cache_ptr + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0
        )  # (BLOCK_N, HD_PAD)
        p = p.to(v_tile.dtype)  # P.V in the cache dtype (bf16 tensor cores), fp32 accumulation
        if DOT_UPCAST:
            pv = tl.dot(p.to(tl.float32), v_tile.to(tl.float32), input_precision=DOT_PREC)
        else:
            pv = tl.dot(p, v_tile, input_precision=DOT_PREC)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + split * stride_ls + tok * stride_lt + head, lse, mask=row_ok)
        if k_begin < k_end:  # an empty split leaves part_o alone: the reduce skips lse = -inf
            tl.store(
                part_o_ptr + split * stride_ps + tok[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :],
                o,
                mask=row_ok[:, None] & d_ok[None, :],
            )
    else:
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


def _reduce_kernel(
    out_ptr,  # (T, nh, hd)
    part_o_ptr,  # (S_max, T_max, nh, hd) fp32
    part_lse_ptr,  # (S_max, T_max, nh) fp32
    qsl_ptr,  # (B+1,)
    num_seqs,
    num_splits,
    stride_ot, stride_oh,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    HEAD_DIM: tl.constexpr,
    HD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    if (t < tl.load(qsl_ptr)) | (t >= tl.load(qsl_ptr + num_seqs)):
        return  # not a token of any sequence: leave out alone
    t64 = t.to(tl.int64)
    sp = tl.arange(0, SPLITS_PAD)
    lse = tl.load(part_lse_ptr + sp * stride_ls + t64 * stride_lt + h, mask=sp < num_splits, other=float("-inf"))
    live = lse > float("-inf")  # a valid query sees its own key, so at least one split is live
    mx = tl.max(lse, axis=0)
    w = tl.where(live, tl.exp2(lse - mx), 0.0)  # (SPLITS_PAD,)
    d = tl.arange(0, HD_PAD)
    parts = tl.load(
        part_o_ptr + sp[:, None] * stride_ps + t64 * stride_pt + h * stride_ph + d[None, :],
        mask=live[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )  # (SPLITS_PAD, HD_PAD)
    o = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + t64 * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _write_kv_kernel(
    k_ptr,  # (T, nkv, hd)
    v_ptr,  # (T, nkv, hd)
    k_cache_ptr,  # (S, nkv, hd)
    v_cache_ptr,  # (S, nkv, hd)
    slot_ptr,  # (T,) int64 or int32, < 0 = skip
    num_kv_heads,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kct, stride_kch,
    stride_vct, stride_vch,
    HEAD_DIM: tl.constexpr,
    HD_PAD: tl.constexpr,
    KV_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, KV_PAD)
    d = tl.arange(0, HD_PAD)
    m = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=m)
    tl.store(k_cache_ptr + slot * stride_kct + h[:, None] * stride_kch + d[None, :], k, mask=m)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=m)
    tl.store(v_cache_ptr + slot * stride_vct + h[:, None] * stride_vch + d[None, :], v, mask=m)


# --------------------------------------------------------------------------- launch helpers

# Ints that change from step to step or runner to runner are not specialised on (an int
# equal to 1 would otherwise be compiled in as a constant, and one divisible by 16
# would get its own binary): a batch of one sequence, a window, a split count or a
# block-table width must not compile a new binary while serving.  q's row stride and
# address, and k/v's in the KV write, are the model's projection layout (views of one
# qkv output), so those are not specialised on either.
ATTN = KernelDef(
    _attn_kernel,
    do_not_specialize=("window", "num_seqs", "qb_per_seq", "num_splits", "search_steps", "stride_qt", "stride_bt",
                       "stride_ps", "stride_ls"),
    do_not_specialize_on_alignment=("q_ptr", "tree_pos_ptr"),
)
REDUCE = KernelDef(_reduce_kernel, do_not_specialize=("num_seqs", "num_splits", "stride_ps", "stride_ls"))
WRITE_KV = KernelDef(_write_kv_kernel, do_not_specialize=("num_kv_heads", "stride_kt", "stride_vt"),
                     do_not_specialize_on_alignment=("k_ptr", "v_ptr"))


def interpreter_active() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1 (needed for CPU tensors)."""
    return triton is not None and type(tl.sum).__name__ == "InterpretedFunction"


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tile_plan(
    num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_query_len: int,
    block_q: int | None = None, block_n: int | None = None, dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """Tile sizes, query-tile numbering and grid for one launch; Python ints in, Python ints out.

    bf16/fp16 tiles target 128 rows (64 with head_dim >= 128).  fp32 dots run on the CUDA
    cores ("ieee"), whose operands and accumulator all live in registers: tiles of 16 rows
    by 16 keys, which ptxas fits without spilling on sm_80 and sm_90 (32 keys spill on
    sm_90 at head_dim 128; docs/benchmarks/triton-aot/)."""
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    hd_pad = max(16, _next_pow2(head_dim))
    fp32 = dtype == torch.float32
    if block_q is None:
        rows = 16 if fp32 else 64 if hd_pad >= 128 else 128  # target rows per tile for multi-query tiles
        block_q = min(_next_pow2(max(max_query_len, 1)), max(1, rows // group_pad))
    if block_q < 1 or block_q & (block_q - 1):
        raise ValueError(f"block_q: must be a power of two, got {block_q}")
    block_m = max(16, block_q * group_pad)
    if block_n is None:
        block_n = 16 if fp32 else 32 if block_m >= 64 and hd_pad >= 128 else 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n: must be a power of two >= 16, got {block_n}")
    qb_per_seq = _cdiv(max(max_query_len, 1), block_q)
    seq_major = num_seqs * qb_per_seq
    flat = num_tokens // block_q + num_seqs
    use_flat = flat < seq_major
    return dict(
        GROUP=group, GROUP_PAD=group_pad, HD_PAD=hd_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        FLAT=use_flat, qb_per_seq=qb_per_seq, num_q_tiles=flat if use_flat else seq_major,
        num_warps=8 if block_m >= 128 else 4,
    )


def _attention_launches(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor, block_tables: Tensor, query_start_loc: Tensor,
    seq_lens: Tensor, scratch: tuple[Tensor, Tensor] | None, *, num_tokens: int, num_seqs: int,
    max_query_len: int, num_splits: int, block_size: int, scale: float, sliding_window: int | None,
    interpreted: bool, block_q: int | None = None, block_n: int | None = None,
    tree: tuple[Tensor, Tensor, Tensor] | None = None,
) -> list[Launch]:
    """The attention launch (and the split-KV reduce) for a step of these ints; ``tree``:
    (tree_base, tree_masks, positions) of a step with draft trees (the TREE binary)."""
    T, B = num_tokens, num_seqs
    nh, hd = q.shape[1], q.shape[2]
    nkv = k_cache.shape[1]
    plan = _tile_plan(T, B, nh, nkv, hd, max_query_len, block_q, block_n, q.dtype)
    num_q_tiles, qb_per_seq, num_warps = plan.pop("num_q_tiles"), plan.pop("qb_per_seq"), plan.pop("num_warps")
    split = num_splits > 1
    part_o, part_lse = scratch if split else (out, out)  # never touched without splits
    sp = part_o.stride() if split else (0, 0, 0, 0)
    sl = part_lse.stride() if split else (0, 0, 0)
    search_steps = max(B - 1, 0).bit_length() if plan["FLAT"] else 0
    # without a tree the tree pointers are never read: stand-ins of the TREE dtypes keep one signature
    tree_args = tree if tree is not None else (seq_lens, _int64_standin(q.device), _int64_standin(q.device))
    attn = Launch(
        ATTN, (num_q_tiles, nkv, num_splits),
        (q, k_cache, v_cache, out, part_o, part_lse, block_tables, query_start_loc, seq_lens, *tree_args,
         float(scale) * _LOG2E, sliding_window or 0, B, qb_per_seq, num_splits, search_steps,
         q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
         v_cache.stride(0), v_cache.stride(1), block_tables.stride(0), sp[0], sp[1], sp[2], sl[0], sl[1]),
        dict(HEAD_DIM=hd, PAGE=block_size, SLIDING=sliding_window is not None, SPLIT=split, TREE=tree is not None,
             DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
             DOT_UPCAST=interpreted and q.dtype != torch.float32, **plan),
        {"num_warps": num_warps},
    )
    if not split:
        return [attn]
    reduce = Launch(
        REDUCE, (T, nh),
        (out, part_o, part_lse, query_start_loc, B, num_splits, out.stride(0), out.stride(1),
         sp[0], sp[1], sp[2], sl[0], sl[1]),
        # one binary for every split count: the reduce masks the splits past num_splits
        dict(HEAD_DIM=hd, HD_PAD=plan["HD_PAD"], SPLITS_PAD=_MAX_SPLITS),
        {"num_warps": 4},
    )
    return [attn, reduce]


@functools.cache
def _int64_standin(device: torch.device) -> Tensor:
    """An int64 tensor passed for the tree pointers of a launch without trees (never read)."""
    return torch.zeros(1, dtype=torch.int64, device=device)


def _write_kv_launch(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> Launch:
    T, nkv, hd = k.shape
    return Launch(
        WRITE_KV, (T,),
        (k, v, k_cache, v_cache, slot_mapping, nkv, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
         k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1)),
        dict(HEAD_DIM=hd, HD_PAD=_next_pow2(hd), KV_PAD=_next_pow2(nkv)),
        {"num_warps": 4},
    )


def step_launches(
    num_seqs: int, num_tokens: int, max_query_len: int, num_splits: int, *, num_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int, sliding_window: int | None, dtype: torch.dtype, device: torch.device | str,
    interpreted: bool = False, tree: bool = False,
) -> list[Launch]:
    """Every launch of one step of these ints (KV write, attention, split-KV reduce), on
    tiny stand-in tensors of the geometry: the same binaries as any real step of these
    ints, since the sizes that differ (token rows, cache slots, table widths) are not
    specialised on.  ``tree``: a step with draft trees (the TREE binary).  For compiling
    at start-up and ahead of time."""
    dev = torch.device(device)
    nh, nkv, hd = num_heads, num_kv_heads, head_dim
    q = torch.zeros(1, nh, hd, dtype=dtype, device=dev)
    kv = torch.zeros(1, nkv, hd, dtype=dtype, device=dev)
    cache = torch.zeros(block_size, nkv, hd, dtype=dtype, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    scratch = make_split_scratch(1, 1, nh, hd, dev) if num_splits > 1 else None
    write = _write_kv_launch(kv, kv, cache, cache, torch.zeros(1, dtype=torch.int64, device=dev))
    i64 = torch.zeros(1, dtype=torch.int64, device=dev)
    return [write, *_attention_launches(
        q, cache, cache, torch.zeros_like(q), torch.zeros(1, 1, **i32), torch.zeros(2, **i32), torch.zeros(1, **i32),
        scratch, num_tokens=num_tokens, num_seqs=num_seqs, max_query_len=max_query_len, num_splits=num_splits,
        block_size=block_size, scale=1.0, sliding_window=sliding_window, interpreted=interpreted,
        tree=(torch.zeros(1, **i32), i64, i64) if tree else None,
    )]


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_num_splits(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_query_len: int,
    max_seq_len: int,
    num_sms: int | None = None,
) -> int:
    """Split-KV factor for a batch bucket (all Python ints: fixed for a captured CUDA graph).

    Without splitting a launch has num_seqs * num_kv_heads * (query tiles per
    sequence) programs.  When that already covers the ``num_sms`` multiprocessors
    the answer is 1.  Otherwise aim for about two programs per multiprocessor,
    with every split still getting at least 256 keys of ``max_seq_len`` and at
    most 16 splits, rounded down to a power of two.  ``max_seq_len`` is an upper
    bound (e.g. max_model_len): splits with no keys return at once.
    """
    if num_sms is None:
        num_sms = _num_sms(torch.cuda.current_device()) if torch.cuda.is_available() else _DEFAULT_NUM_SMS
    plan = _tile_plan(num_seqs * max(max_query_len, 1), num_seqs, num_heads, num_kv_heads, head_dim, max_query_len)
    programs = num_seqs * num_kv_heads * plan["qb_per_seq"]
    if programs <= 0 or programs >= num_sms:
        return 1
    want = _cdiv(2 * num_sms, programs)
    cap = min(_MAX_SPLITS, max_seq_len // _MIN_KEYS_PER_SPLIT)
    n = max(1, min(want, cap))
    return 1 << (n.bit_length() - 1)


def make_split_scratch(
    num_splits: int, max_tokens: int, num_heads: int, head_dim: int, device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """Preallocated split-KV scratch for the largest bucket: (part_o, part_lse) fp32,
    shapes (num_splits, max_tokens, num_heads, head_dim) and (num_splits, max_tokens, num_heads).
    Any launch with at most that many splits and tokens may use it (contents need no reset)."""
    part_o = torch.empty(num_splits, max_tokens, num_heads, head_dim, dtype=torch.float32, device=device)
    part_lse = torch.empty(num_splits, max_tokens, num_heads, dtype=torch.float32, device=device)
    return part_o, part_lse


def _check_attention_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, block_size, scale,
                          sliding_window, max_query_len, out) -> None:
    def fail(name: str, msg: str):
        raise ValueError(f"{name}: {msg}")

    if q.dim() != 3:
        fail("q", f"expected (T, num_heads, head_dim), got {list(q.shape)}")
    T, nh, hd = q.shape
    dev = q.device
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 3 or c.shape[2] != hd or c.shape != k_cache.shape:
            fail(name, f"expected (num_slots, num_kv_heads, {hd}) like k_cache, got {list(c.shape)}")
        if c.dtype != q.dtype or c.device != dev:
            fail(name, f"expected {q.dtype} on {dev} (q's), got {c.dtype} on {c.device}")
        if c.stride(2) != 1:
            fail(name, "the head_dim axis must be contiguous")
    nkv = k_cache.shape[1]
    if nkv == 0 or nh % nkv:
        fail("k_cache", f"num_heads {nh} is not a multiple of num_kv_heads {nkv}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        fail("q", f"dtype must be float32, bfloat16 or float16, got {q.dtype}")
    if q.stride(2) != 1:
        fail("q", "the head_dim axis must be contiguous")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64) or block_tables.device != dev:
        fail("block_tables", f"expected (B, max_blocks) int32 on {dev}, got {list(block_tables.shape)} "
             f"{block_tables.dtype} on {block_tables.device}")
    B = block_tables.shape[0]
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        fail("block_tables", "rows must be contiguous")
    for name, t, n in (("query_start_loc", query_start_loc, B + 1), ("seq_lens", seq_lens, B)):
        if t.dim() != 1 or t.shape[0] != n or t.dtype not in (torch.int32, torch.int64) or t.device != dev:
            fail(name, f"expected ({n},) int32 on {dev}, got {list(t.shape)} {t.dtype} on {t.device}")
    if block_size < 1 or block_size & (block_size - 1):
        fail("block_size", f"must be a power of two, got {block_size}")
    if not scale > 0:
        fail("scale", f"must be > 0, got {scale}")
    if sliding_window is not None and sliding_window < 1:
        fail("sliding_window", f"must be None or >= 1, got {sliding_window}")
    if max_query_len < 0:
        fail("max_query_len", f"must be >= 0, got {max_query_len}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != dev or out.stride(2) != 1):
        fail("out", f"expected {list(q.shape)} {q.dtype} on {dev} with a contiguous head_dim axis, "
             f"got {list(out.shape)} {out.dtype} on {out.device}")


def _check_tree_args(q, block_tables, tree_base, tree_masks, positions) -> tuple[Tensor, Tensor, Tensor] | None:
    """(tree_base, tree_masks, positions) of a step with draft trees, None without."""
    given = [t is not None for t in (tree_base, tree_masks, positions)]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("tree_base: tree_base, tree_masks and positions go together")
    T, B, dev = q.shape[0], block_tables.shape[0], q.device
    for name, t, n, dtype in (("tree_base", tree_base, B, torch.int32), ("tree_masks", tree_masks, T, torch.int64),
                              ("positions", positions, T, torch.int64)):
        if t.dim() != 1 or t.shape[0] < n or t.dtype != dtype or t.device != dev:
            raise ValueError(f"{name}: expected ({n},) {dtype} on {dev}, got {list(t.shape)} {t.dtype} on {t.device}")
    return tree_base, tree_masks, positions


# --------------------------------------------------------------------------- attention


def paged_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: Tensor | None = None,
    scratch: tuple[Tensor, Tensor] | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    tree_base: Tensor | None = None,
    tree_masks: Tensor | None = None,
    positions: Tensor | None = None,
) -> Tensor:
    """The Triton path of :func:`paged_attention` (CUDA tensors, or CPU under the interpreter)."""
    if triton is None:
        raise RuntimeError("paged attention: triton is not installed; use impl='torch'")
    _check_attention_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, block_size, scale,
                          sliding_window, max_query_len, out)
    tree = _check_tree_args(q, block_tables, tree_base, tree_masks, positions)
    interpreted = interpreter_active()
    if q.device.type == "cpu" and not interpreted:
        raise RuntimeError("paged attention: CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported (or use impl='torch')")
    T, nh, hd = q.shape
    nkv = k_cache.shape[1]
    B = block_tables.shape[0]
    if out is None:
        out = torch.zeros_like(q)
    if T == 0 or B == 0 or max_query_len == 0:
        return out
    if num_splits is None:
        bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        num_splits = default_num_splits(B, nh, nkv, hd, max_query_len, bound,
                                        _num_sms(q.device.index or 0) if q.is_cuda else None)
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits: must be in 1..{_MAX_SPLITS}, got {num_splits}")
    split = num_splits > 1
    if split:
        if scratch is None:
            scratch = make_split_scratch(num_splits, T, nh, hd, q.device)
        part_o, part_lse = scratch
        if (part_o.dim() != 4 or part_o.shape[0] < num_splits or part_o.shape[1] < T
                or tuple(part_o.shape[2:]) != (nh, hd) or part_o.dtype != torch.float32
                or part_o.device != q.device or part_o.stride(3) != 1):
            raise ValueError(f"scratch: part_o must be float32 (>={num_splits}, >={T}, {nh}, {hd}) on {q.device} "
                             f"with a contiguous last axis, got {list(part_o.shape)} {part_o.dtype}")
        if (part_lse.dim() != 3 or part_lse.shape[0] < num_splits or part_lse.shape[1] < T
                or part_lse.shape[2] != nh or part_lse.dtype != torch.float32
                or part_lse.device != q.device or part_lse.stride(2) != 1):
            raise ValueError(f"scratch: part_lse must be float32 (>={num_splits}, >={T}, {nh}) on {q.device} "
                             f"with a contiguous last axis, got {list(part_lse.shape)} {part_lse.dtype}")
    for launch in _attention_launches(
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, scratch, num_tokens=T, num_seqs=B,
        max_query_len=max_query_len, num_splits=num_splits, block_size=block_size, scale=scale,
        sliding_window=sliding_window, interpreted=interpreted, block_q=block_q, block_n=block_n, tree=tree,
    ):
        run_launch(launch)
    return out


def paged_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: Tensor | None = None,
    scratch: tuple[Tensor, Tensor] | None = None,
    tree_base: Tensor | None = None,
    tree_masks: Tensor | None = None,
    positions: Tensor | None = None,
) -> Tensor:
    """Torch twin of :func:`paged_attention_triton`: gather every sequence's keys by slot,
    masked softmax in fp32, scatter back.  ``num_splits`` and ``scratch`` are accepted and
    ignored (the maths does not depend on them).  Host-sync free when ``max_seq_len`` is given."""
    _check_attention_args(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, block_size, scale,
                          sliding_window, max_query_len, out)
    tree = _check_tree_args(q, block_tables, tree_base, tree_masks, positions)
    T, nh, hd = q.shape
    S, nkv, _ = k_cache.shape
    B = block_tables.shape[0]
    dev = q.device
    if out is None:
        out = torch.zeros_like(q)
    if T == 0 or B == 0 or max_query_len == 0:
        return out
    qsl = query_start_loc.long()
    sl = seq_lens.long()
    q_len = qsl[1:] - qsl[:-1]  # (B,)
    Q = max_query_len
    L = max_seq_len if max_seq_len is not None else int(torch.where(q_len > 0, sl, 0).max())
    L = max(L, 1)
    ar_q = torch.arange(Q, device=dev)
    q_ok = ar_q[None, :] < q_len[:, None]  # (B, Q)
    q_tok = qsl[:-1, None] + ar_q[None, :]  # (B, Q) token index on T
    q_pos = (sl - q_len)[:, None] + ar_q[None, :]  # (B, Q) absolute position
    k_pos = torch.arange(L, device=dev)  # (L,)
    col = (k_pos // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables.long()[:, col] * block_size + (k_pos % block_size)[None, :]  # (B, L)
    slots = slots.clamp(0, S - 1)  # keys past a sequence's table are masked below
    key_ok = (k_pos[None, :] < sl[:, None])[:, :, None, None]  # (B, L, 1, 1): whatever lies past a context is not read
    kk = k_cache.index_select(0, slots.reshape(-1)).view(B, L, nkv, hd).float().where(key_ok, 0.0)
    vv = v_cache.index_select(0, slots.reshape(-1)).view(B, L, nkv, hd).float().where(key_ok, 0.0)
    qq = q.index_select(0, q_tok.clamp(0, T - 1).reshape(-1)).view(B, Q, nkv, nh // nkv, hd).float()
    scores = torch.einsum("bqhgd,blhd->bhgql", qq, kk) * scale  # (B, nkv, G, Q, L)
    if tree is not None:
        mask = _tree_visibility(tree, q_tok.clamp(0, T - 1), q_pos, k_pos, sl, sliding_window)
    else:
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < sl[:, None, None])
        if sliding_window is not None:
            mask &= q_pos[:, :, None] - k_pos[None, None, :] < sliding_window
    mask &= q_ok[:, :, None]  # (B, Q, L)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing visible: zeros
    o = torch.einsum("bhgql,blhd->bqhgd", probs, vv).reshape(B * Q, nh, hd)
    # scatter valid rows to their tokens; padding rows go to a dummy row T
    dest = torch.where(q_ok, q_tok, T).reshape(-1)
    full = torch.zeros(T + 1, nh, hd, dtype=torch.float32, device=dev).index_copy_(0, dest, o)
    covered = torch.zeros(T + 1, dtype=torch.bool, device=dev).index_copy_(0, dest, q_ok.reshape(-1))
    out.copy_(torch.where(covered[:T, None, None], full[:T].to(out.dtype), out))
    return out


def _tree_visibility(tree: tuple[Tensor, Tensor, Tensor], q_tok: Tensor, q_pos: Tensor, k_pos: Tensor, sl: Tensor,
                     window: int | None) -> Tensor:
    """(B, Q, L) visibility under draft trees (the TREE rule of the module docstring)."""
    base = tree[0].long()[:, None, None]  # (B, 1, 1)
    bits = tree[1].long()[q_tok][:, :, None]  # (B, Q, 1)
    is_tree = base[:, :, 0] < sl[:, None]  # (B, 1)
    vpos = torch.where(is_tree, tree[2].long()[q_tok], q_pos)[:, :, None]
    kp = k_pos[None, None, :]
    vis = (kp < base) & (kp <= vpos)
    if window is not None:
        vis &= vpos - kp < window
    in_tree = (kp >= base) & (kp < sl[:, None, None])
    return vis | (in_tree & ((bits >> (kp - base).clamp(0, 63)) & 1).bool())


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    *,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: Tensor | None = None,
    scratch: tuple[Tensor, Tensor] | None = None,
    impl: str = "auto",
    tree_base: Tensor | None = None,
    tree_masks: Tensor | None = None,
    positions: Tensor | None = None,
) -> Tensor:
    """Attention of a flattened ragged batch of new tokens over the paged KV cache.

    q (T, nh, hd) holds the new tokens of all sequences (their K/V already written to
    the cache); sequence b owns tokens [query_start_loc[b], query_start_loc[b+1]) and has
    seq_lens[b] context positions including them; its keys live at slots
    block_tables[b, j // block_size] * block_size + j % block_size.  Query i of sequence
    b sits at position seq_lens[b] - qlen_b + i and sees keys j <= that position (and
    position - j < sliding_window when set).  Returns out (T, nh, hd) in q's dtype; rows of
    tokens that belong to no sequence are left as they were (zeros when out is None).

    max_query_len must bound every qlen (a bucket value is fine); max_seq_len (optional)
    bounds every seq_len and only feeds the num_splits default (block_tables.shape[1] *
    block_size is used without it).  num_splits None picks :func:`default_num_splits`.
    scratch: (part_o, part_lse) from :func:`make_split_scratch`, used when num_splits > 1.

    impl: "triton", "torch" (the twin), or "auto": Triton on CUDA tensors when triton is
    installed, the twin otherwise (CPU tensors run the kernel only with impl="triton" under
    TRITON_INTERPRET=1).

    Draft trees: ``tree_base`` (B,) int32, ``tree_masks`` (T,) int64 and ``positions``
    (T,) int64, all three or none; the visibility rule is the module docstring's (TREE).
    """
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl: must be 'auto', 'triton' or 'torch', got {impl!r}")
    if impl == "auto":
        impl = "triton" if q.is_cuda and triton is not None else "torch"
    fn = paged_attention_triton if impl == "triton" else paged_attention_reference
    return fn(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, block_size=block_size, scale=scale,
              sliding_window=sliding_window, max_query_len=max_query_len, max_seq_len=max_seq_len,
              num_splits=num_splits, out=out, scratch=scratch, tree_base=tree_base, tree_masks=tree_masks,
              positions=positions)


# --------------------------------------------------------------------------- KV write


def _check_write_args(k, v, k_cache, v_cache, slot_mapping) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k, v: expected equal (T, num_kv_heads, head_dim) shapes, "
                         f"got {list(k.shape)} and {list(v.shape)}")
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[1:]) != tuple(k.shape[1:]):
        raise ValueError(f"k_cache, v_cache: expected equal (num_slots, {k.shape[1]}, {k.shape[2]}) shapes, "
                         f"got {list(k_cache.shape)} and {list(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"v_cache: dtype {v_cache.dtype} differs from k_cache's {k_cache.dtype}")
    if (slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0]
            or slot_mapping.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"slot_mapping: expected ({k.shape[0]},) int64 or int32, got {list(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    dev = k_cache.device
    for name, t in (("k", k), ("v", v), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != dev:
            raise ValueError(f"{name}: expected on {dev} (k_cache's), got {t.device}")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(2) != 1:
            raise ValueError(f"{name}: the head_dim axis must be contiguous")


def write_kv_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Triton path of :func:`write_kv`."""
    if triton is None:
        raise RuntimeError("write_kv: triton is not installed; use impl='torch'")
    _check_write_args(k, v, k_cache, v_cache, slot_mapping)
    interpreted = interpreter_active()
    if k.device.type == "cpu" and not interpreted:
        raise RuntimeError("write_kv: CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported (or use impl='torch')")
    T, nkv, hd = k.shape
    if T == 0:
        return
    run_launch(_write_kv_launch(k, v, k_cache, v_cache, slot_mapping))


def write_kv_reference(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Torch twin of :func:`write_kv_triton`: k_cache[slot] = k for every slot >= 0."""
    _check_write_args(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    idx = slot_mapping[keep].long()
    k_cache.index_copy_(0, idx, k[keep].to(k_cache.dtype))
    v_cache.index_copy_(0, idx, v[keep].to(v_cache.dtype))


def write_kv(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, *, impl: str = "auto"
) -> None:
    """Write each new token's K/V (T, nkv, hd) into its cache slot (S, nkv, hd); slot < 0 skips
    the token (padding).  Values are cast to the cache dtype.  impl as for :func:`paged_attention`."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl: must be 'auto', 'triton' or 'torch', got {impl!r}")
    if impl == "auto":
        impl = "triton" if k_cache.is_cuda and triton is not None else "torch"
    (write_kv_triton if impl == "triton" else write_kv_reference)(k, v, k_cache, v_cache, slot_mapping)
