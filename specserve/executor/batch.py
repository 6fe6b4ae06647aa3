"""The step contract between the control plane and the data plane (pure Python).

The engine turns one scheduler decision into one ``StepBatch``; every runner
backend (torch on CUDA with persistent buffers and graphs, torch on the CPU,
the fused CPU decoder) consumes exactly this object and returns logits for
``logits_rows`` plus the hidden states a proposer asked for, by row.

All new tokens of all sequences lie on one axis T, sequence after sequence::

    token_ids, positions, slot_mapping   (T,)    slot = block * block_size + offset
    query_start                          (B+1,)  sequence b owns tokens [qs[b], qs[b+1])
    seq_lens                             (B,)    context length INCLUDING the new tokens
    block_tables                         B rows  (ragged here; runners pad them)
    logits_rows                          (R,)    rows of T whose logits are wanted, seq order
    row_offsets                          (B,)    first index into logits_rows of sequence b
    num_drafts                           (B,)    drafts among sequence b's new tokens

A sequence's new tokens are the last ``qlen`` positions of its context: the
pending token(s) of a decode, a prefill chunk, or the pending token plus K
drafts of a verification.  New token i of a sequence sits at context index
``start_pos + i`` (its K/V goes to that slot) and by default at rotary position
``start_pos + i``; ``SeqInput.positions`` overrides the rotary positions only.

Draft trees.  A sequence may verify a tree of drafts in one forward:
``tree_base`` is the context index where its tree starts and ``tree_masks``
holds one bitmask per new token over the context indexes
[tree_base, start_pos + qlen): bit (j - tree_base) is set iff the token sees the
key at context index j (its ancestors and itself; :func:`tree_masks` builds them
from a parent list).  Keys before tree_base are seen as without a tree, by the
token's rotary position p: j <= p, and p - j < window under a sliding window;
keys from tree_base on follow the bits alone (under a sliding window, the caller
leaves the ancestors outside it out of the masks: ``tree_masks(..., window=)``).
A step where some sequence has a tree carries::

    tree_base   (B,)   per sequence; seq_len for a sequence without a tree
    tree_masks  (T,)   per token, bits as Python ints; 0 for tokens of tree-less sequences
                       (tensors hold them as int64 two's complement: :func:`int64_masks`)

and None for both when no sequence has one (every existing step is unchanged).

Input embeddings.  A sequence may give some of its new tokens' input embeddings
instead of their token embeddings (a speech model's audio rows, from its projector):
``SeqInput.input_embeds`` lists (offset in token_ids, (n, H) tensor) pairs; the step
carries them as ``input_embeds``: (row on T, tensor) pairs, None when no sequence has
any (the text path is unchanged).  The tensors are opaque handles here: the runner
replaces those rows' embeddings with them before the first layer.
The span start_pos + qlen - tree_base is at most :data:`MAX_TREE_SPAN` = 64.

Batch buckets (:func:`batch_buckets`, :func:`batch_bucket`): the batch sizes a
uniform step is padded to, so one captured CUDA graph serves every batch up to
its size; adaptive speculation measures step costs per bucket by the same
definition, so the graph timings it starts from are found for every batch.
Draft sizes (:func:`draft_sizes`): the numbers of drafts per sequence an adaptive
step may choose, so the verification sizes (q = drafts + 1) graphs are captured for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SeqInput:
    """One sequence's part of a step, as a caller describes it."""

    token_ids: list[int]  # the new tokens to run (prefill chunk, or pending token + drafts)
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # must cover start_pos + len(token_ids) positions
    logits_offsets: list[int] = field(default_factory=list)  # offsets in token_ids whose logits are wanted
    num_drafts: int = 0  # how many of token_ids are drafts (the last ones)
    positions: list[int] | None = None  # rotary positions of token_ids (default start_pos + i)
    tree_base: int | None = None  # context index where this sequence's draft tree starts (<= start_pos)
    tree_masks: list[int] | None = None  # per token: bit (j - tree_base) set iff it sees context index j
    # (offset in token_ids, (n, H) embeddings) pairs: rows whose input embeddings are given
    input_embeds: list[tuple[int, Any]] | None = None


MAX_TREE_SPAN = 64  # tree bitmasks are int64


def int64_masks(masks: list[int]) -> list[int]:
    """Tree bitmasks as the int64 values a tensor holds: a mask with bit 63 set (a tree
    spanning 64 keys) becomes its two's complement, a negative number whose bits are the
    same, so ``(mask >> bit) & 1`` reads every bit as before.  Build every int64 mask
    tensor from these; ``torch.tensor`` refuses Python ints from 2**63 on."""
    return [m - (1 << 64) if m >> 63 else m for m in masks]


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of every node of a tree given as parent indexes (parents[0] == -1, the root
    at depth 0; 0 <= parents[i] < i otherwise)."""
    _check_parents(parents)
    depths: list[int] = []
    for i, p in enumerate(parents):
        depths.append(0 if i == 0 else depths[p] + 1)
    return depths


def tree_masks(parents: list[int], offset: int = 0, window: int | None = None) -> list[int]:
    """Attention bitmask of every node (its own bit and its ancestors'); node i owns
    bit ``offset + i`` (the nodes follow ``offset`` earlier keys of the tree range, whose
    bits the caller ORs in where a node should see them).  ``window``: a sliding window,
    as plain decoding applies it: an ancestor ``window`` or more levels up is left out."""
    _check_parents(parents)
    if offset < 0:
        raise ValueError(f"offset: must be >= 0, got {offset}")
    if window is not None and window < 1:
        raise ValueError(f"window: must be None or >= 1, got {window}")
    masks: list[int] = []
    for i, p in enumerate(parents):
        own = 1 << (offset + i)
        if window is None:
            masks.append(own if i == 0 else masks[p] | own)
            continue
        m, a = own, p
        for _ in range(window - 1):
            if a < 0:
                break
            m |= 1 << (offset + a)
            a = parents[a]
        masks.append(m)
    return masks


def _check_parents(parents: list[int]) -> None:
    if not parents or parents[0] != -1:
        raise ValueError("parents: the first node must be the root (parent -1)")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"parents: node {i} has parent {p}; must be in [0, {i})")


def _check_tree(s: SeqInput, index: int) -> None:
    """The tree fields of one SeqInput (ValueError naming the field)."""
    n, end = len(s.token_ids), s.start_pos + len(s.token_ids)
    if s.positions is not None and len(s.positions) != n:
        raise ValueError(f"positions: sequence {index} has {len(s.positions)} positions for {n} tokens")
    if (s.tree_base is None) != (s.tree_masks is None):
        raise ValueError(f"tree_masks: sequence {index} needs tree_base and tree_masks together")
    if s.tree_base is None or s.tree_masks is None:
        return
    if not 0 <= s.tree_base <= s.start_pos:
        raise ValueError(f"tree_base: sequence {index} has {s.tree_base}; must be in [0, start_pos={s.start_pos}]")
    if end - s.tree_base > MAX_TREE_SPAN:
        raise ValueError(f"tree_base: sequence {index} spans {end - s.tree_base} context indexes "
                         f"[{s.tree_base}, {end}); at most {MAX_TREE_SPAN}")
    if len(s.tree_masks) != n:
        raise ValueError(f"tree_masks: sequence {index} has {len(s.tree_masks)} masks for {n} tokens")
    for i, m in enumerate(s.tree_masks):
        own = s.start_pos + i - s.tree_base
        if not m >> own & 1:
            raise ValueError(f"tree_masks: token {i} of sequence {index} lacks its own bit {own}")
        if m < 0 or m >> (own + 1):
            raise ValueError(f"tree_masks: token {i} of sequence {index} has bits past its own ({own})")


@dataclass
class StepBatch:
    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_rows: list[int]
    row_offsets: list[int]
    num_drafts: list[int]
    tree_base: list[int] | None = None  # (B,) None when no sequence has a tree
    tree_masks: list[int] | None = None  # (T,) int64 bitmasks, None when no sequence has a tree
    input_embeds: list[tuple[int, Any]] | None = None  # (row on T, (n, H) tensor); None when none

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        qs = self.query_start
        return max((qs[i + 1] - qs[i] for i in range(len(qs) - 1)), default=0)

    def uniform_query_len(self) -> int | None:
        """q when every sequence runs exactly q new tokens and wants the logits of all of
        them (a decode step, q = 1, or a verification step, q = K + 1), else None.  Such
        steps have a fixed shape per batch size: they are the ones CUDA graphs replay."""
        B = self.num_seqs
        if B == 0:
            return None
        q = self.query_start[1] - self.query_start[0]
        if q < 1 or self.num_tokens != B * q or len(self.logits_rows) != B * q:
            return None
        if any(self.query_start[i] != i * q for i in range(B + 1)):
            return None
        if any(r != i for i, r in enumerate(self.logits_rows)):
            return None
        return q

    @classmethod
    def from_inputs(
        cls, seqs: list[SeqInput], block_size: int, pad_to: int | None = None, trash_slot: int = -1,
        max_position: int | None = None,
    ) -> "StepBatch":
        """Flatten per-sequence inputs.  ``pad_to`` q: make a uniform step -- every
        sequence gets q tokens (pads after its real ones: token 0, K/V written to
        ``trash_slot``, position clamped to ``max_position``) and logits for all q rows;
        pads come after every real token, so causal attention keeps them invisible.  A pad
        of a tree sequence sees the tree's first key (mask bit 0) and the keys before it."""
        has_tree = False
        for i, s in enumerate(seqs):
            _check_tree(s, i)
            has_tree = has_tree or s.tree_masks is not None
        bases: list[int] = []
        embeds: list[tuple[int, Any]] = []
        masks: list[int] = []
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qs = [0]
        lens: list[int] = []
        rows: list[int] = []
        offsets: list[int] = []
        for s in seqs:
            n = len(s.token_ids)
            end = s.start_pos + n
            if len(s.block_table) * block_size < end:
                raise ValueError(f"block table covers {len(s.block_table) * block_size} positions, needs {end}")
            offsets.append(len(rows))
            table = s.block_table
            if pad_to is None:
                rows.extend(len(ids) + o for o in s.logits_offsets)
            else:
                if n > pad_to:
                    raise ValueError(f"pad_to: a sequence has {n} new tokens, more than {pad_to}")
                rows.extend(range(len(ids), len(ids) + pad_to))
            for off, given in s.input_embeds or ():
                if not 0 <= off or off + len(given) > n:
                    raise ValueError(f"input_embeds: rows [{off}, {off + len(given)}) outside the {n} new tokens")
                embeds.append((len(ids) + off, given))
            ids.extend(s.token_ids)
            pos.extend(s.positions if s.positions is not None else range(s.start_pos, end))
            for p in range(s.start_pos, end):
                slots.append(table[p // block_size] * block_size + p % block_size)
            masks.extend(s.tree_masks if s.tree_masks is not None else [0] * n)
            if pad_to is not None and pad_to > n:
                top = max_position if max_position is not None else end + pad_to
                ids.extend([0] * (pad_to - n))
                pos.extend(min(p, top) for p in range(end, s.start_pos + pad_to))
                slots.extend([trash_slot] * (pad_to - n))
                masks.extend([1 if s.tree_masks is not None else 0] * (pad_to - n))
                end = s.start_pos + pad_to
            qs.append(len(ids))
            lens.append(end)
            bases.append(s.tree_base if s.tree_base is not None else end)
        return cls(
            token_ids=ids, positions=pos, slot_mapping=slots, query_start=qs, seq_lens=lens,
            block_tables=[s.block_table for s in seqs], logits_rows=rows, row_offsets=offsets,
            num_drafts=[s.num_drafts for s in seqs],
            tree_base=bases if has_tree else None, tree_masks=masks if has_tree else None,
            input_embeds=embeds or None,
        )


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to and including max_num_seqs (the captured batch sizes)."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    out.append(max_num_seqs)
    return out


def batch_bucket(num_seqs: int, max_num_seqs: int | None = None) -> int:
    """The bucket of a batch of ``num_seqs``: the smallest of ``batch_buckets(max_num_seqs)``
    that holds it; without ``max_num_seqs``, or past it, the next power of two."""
    b = 1
    while b < num_seqs:
        b *= 2
    if max_num_seqs is not None and num_seqs <= max_num_seqs:
        return min(b, max_num_seqs)
    return b


def draft_sizes(num_spec_tokens: int) -> tuple[int, ...]:
    """Numbers of drafts an adaptive step may choose (CUDA graphs are captured for each
    as a verification size): every one up to 8, then powers of two, and K itself."""
    K = num_spec_tokens
    if K <= 8:
        return tuple(range(1, K + 1))
    return tuple(sorted({*range(1, 9), *(2**i for i in range(4, 8) if 2**i < K), K}))
