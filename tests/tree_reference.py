"""The oracle for draft-tree attention: a dense boolean mask and plain softmax.

Every attention backend (the reference path's padded group, the paged kernel and
its torch twin, the fused CPU decoder) is compared with :func:`dense_tree_attention`
on the same step.  The rule, per sequence b with context length L_b, its query i at
context index c = L_b - qlen_b + i and rotary position p::

    key j < tree_base[b]:          j <= v and (v - j < window when set),
                                   v = p for a tree sequence, c for one without a tree
    tree_base[b] <= j < L_b:       bit (j - tree_base[b]) of the query's mask

A sequence without a tree has tree_base = L_b, which leaves the causal rule.

Helpers build random trees and steps mixing tree sequences with decode rows and
prompt chunks, so the backend tests draw the same shapes.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from specserve.executor.batch import SeqInput, tree_depths, tree_masks


def dense_mask(seq_len: int, q_len: int, positions: list[int], tree_base: int | None,
               masks: list[int] | None, window: int | None) -> Tensor:
    """(q_len, seq_len) bool: which keys each new token of one sequence sees."""
    c = torch.arange(seq_len - q_len, seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    base = seq_len if tree_base is None else tree_base
    v = c if tree_base is None else torch.tensor(positions)[:, None]
    before = (j < base) & (j <= v)
    if window is not None:
        before &= v - j < window
    bits = torch.tensor(masks if masks is not None else [0] * q_len, dtype=torch.int64)[:, None]
    in_tree = (j >= base) & ((bits >> (j - base).clamp(0, 63)) & 1).bool()
    return before | in_tree


def dense_tree_attention(q: Tensor, k_all: list[Tensor], v_all: list[Tensor], query_start: list[int],
                         positions: list[int], tree_base: list[int] | None, tree_masks_: list[int] | None,
                         window: int | None = None, scale: float | None = None) -> Tensor:
    """Attention of q (T, nh, hd) over each sequence's whole context, k_all[b] / v_all[b]
    (L_b, nkv, hd) in context-index order, under the rule above; fp32, (T, nh, hd)."""
    T, nh, hd = q.shape
    scale = hd ** -0.5 if scale is None else scale
    out = torch.zeros(T, nh, hd, dtype=torch.float32)
    for b, (k, v) in enumerate(zip(k_all, v_all)):
        s, e = query_start[b], query_start[b + 1]
        if e == s:
            continue
        L, nkv = k.shape[0], k.shape[1]
        base = None if tree_base is None or tree_base[b] >= L else tree_base[b]
        masks = None if tree_masks_ is None else tree_masks_[s:e]
        m = dense_mask(L, e - s, positions[s:e], base, masks, window)  # (n, L)
        g = nh // nkv
        kk = k.float().repeat_interleave(g, dim=1).transpose(0, 1)  # (nh, L, hd)
        vv = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
        qq = q[s:e].float().transpose(0, 1)  # (nh, n, hd)
        sc = (qq @ kk.transpose(1, 2)) * scale
        sc = sc.masked_fill(~m[None], float("-inf"))
        out[s:e] = (torch.softmax(sc, dim=-1) @ vv).transpose(0, 1)
    return out


def random_parents(rng: random.Random, n: int) -> list[int]:
    """A random tree of n nodes in topological order (root first)."""
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def tree_seq(rng: random.Random, ctx: int, nodes: int, block_table: list[int], offset: int = 0) -> SeqInput:
    """A tree sequence: ``ctx`` tokens already cached, of which the last ``offset`` are
    earlier keys of the tree range (a chain every new node sees), then ``nodes`` new
    nodes; rotary positions by depth from the tree's first key."""
    parents = random_parents(rng, nodes)
    base = ctx - offset
    chain = (1 << offset) - 1  # earlier tree keys: every node sees all of them
    masks = [m | chain for m in tree_masks(parents, offset)]
    pos = [base + offset + d for d in tree_depths(parents)]
    return SeqInput(token_ids=[rng.randrange(100) for _ in range(nodes)], start_pos=ctx, block_table=block_table,
                    logits_offsets=list(range(nodes)), positions=pos, tree_base=base, tree_masks=masks)


def plain_seq(rng: random.Random, ctx: int, n: int, block_table: list[int]) -> SeqInput:
    """A sequence without a tree: a decode row (n = 1), a verification chain or a prompt chunk."""
    return SeqInput(token_ids=[rng.randrange(100) for _ in range(n)], start_pos=ctx, block_table=block_table,
                    logits_offsets=[n - 1])


def mixed_seqs(rng: random.Random, block_size: int, num_blocks: int, max_ctx: int = 40) -> list[SeqInput]:
    """A ragged step: tree sequences (one with earlier tree keys), a decode row, a
    verification chain and a prompt chunk over cached context, on disjoint random blocks."""
    free = list(range(1, num_blocks))  # block 0 stays unused
    rng.shuffle(free)

    def table(n: int) -> list[int]:
        need = -(-n // block_size)
        out = [free.pop() for _ in range(need)]
        return out

    specs = []
    ctx, nodes = rng.randrange(3, max_ctx), rng.randrange(2, 12)
    specs.append(tree_seq(rng, ctx, nodes, table(ctx + nodes)))
    ctx = rng.randrange(1, max_ctx)
    specs.append(plain_seq(rng, ctx, 1, table(ctx + 1)))
    ctx, nodes, off = rng.randrange(6, max_ctx), rng.randrange(1, 9), rng.randrange(1, 5)
    specs.append(tree_seq(rng, ctx, nodes, table(ctx + nodes), offset=off))
    ctx, n = rng.randrange(1, max_ctx), rng.randrange(3, 7)
    specs.append(plain_seq(rng, ctx, n, table(ctx + n)))
    ctx, n = rng.randrange(0, max_ctx), rng.randrange(5, 20)
    specs.append(plain_seq(rng, ctx, n, table(ctx + n)))
    rng.shuffle(specs)
    return specs


def step_tensors(batch, num_blocks: int, block_size: int, nh: int, nkv: int, hd: int, dtype: torch.dtype,
                 seed: int, poison: bool = False):
    """Random q/k/v for a step and a random cache, plus the dense oracle's per-sequence
    keys and values (the cache after the new tokens' K/V are written):
    (q, k, v, k_cache, v_cache, k_all, v_all).  ``poison``: slots outside every context
    hold NaN, so a stray read shows in the output."""
    g = torch.Generator().manual_seed(seed)
    T, S = batch.num_tokens, num_blocks * block_size

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = rnd(T, nh, hd), rnd(T, nkv, hd), rnd(T, nkv, hd)
    k_cache, v_cache = rnd(S, nkv, hd), rnd(S, nkv, hd)
    if poison:
        used = torch.zeros(S, dtype=torch.bool)
        for table, L in zip(batch.block_tables, batch.seq_lens):
            for j in range(L):
                used[table[j // block_size] * block_size + j % block_size] = True
        k_cache[~used] = float("nan")
        v_cache[~used] = float("nan")
    kc, vc = k_cache.clone(), v_cache.clone()
    slots = torch.tensor(batch.slot_mapping, dtype=torch.int64)
    kc.index_copy_(0, slots, k)
    vc.index_copy_(0, slots, v)
    k_all, v_all = [], []
    for table, L in zip(batch.block_tables, batch.seq_lens):
        ctx_slots = torch.tensor([table[j // block_size] * block_size + j % block_size for j in range(L)],
                                 dtype=torch.int64)
        k_all.append(kc[ctx_slots])
        v_all.append(vc[ctx_slots])
    return q, k, v, k_cache, v_cache, k_all, v_all


def oracle(batch, q, k_all, v_all, window: int | None = None, scale: float | None = None) -> Tensor:
    """:func:`dense_tree_attention` of a ``StepBatch``."""
    return dense_tree_attention(q, k_all, v_all, batch.query_start, batch.positions, batch.tree_base,
                                batch.tree_masks, window, scale)


def tree_and_chain_logits(make_runner, prompt: list[int], parents: list[int], tokens: list[int],
                          block_size: int, nodes: list[int] | None = None,
                          window: int | None = None) -> tuple[Tensor, list[Tensor]]:
    """A model-level check of a runner (``make_runner()`` -> a fresh runner with an empty
    KV cache): the logits of every node of one tree step after ``prompt``, and for each
    of ``nodes`` (default all) the logits of the chain root..node run without a tree on a
    fresh runner.  Lossless tree attention makes row i of the first equal the i-th chain's.
    ``window``: the model's sliding window (the masks leave out ancestors outside it)."""
    blocks = list(range(1, 1 + -(-(len(prompt) + len(parents)) // block_size)))
    P, depths = len(prompt), tree_depths(parents)
    runner = make_runner()
    runner.forward([SeqInput(prompt, 0, blocks, [P - 1])])
    tree = SeqInput(tokens, P, blocks, list(range(len(parents))), positions=[P + d for d in depths],
                    tree_base=P, tree_masks=tree_masks(parents, window=window))
    got = runner.forward([tree]).logits
    chains = []
    for node in nodes if nodes is not None else range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        r = make_runner()
        r.forward([SeqInput(prompt, 0, blocks, [P - 1])])
        chains.append(r.forward([SeqInput([tokens[i] for i in path], P, blocks, [len(path) - 1])]).logits[0])
    return got, chains
