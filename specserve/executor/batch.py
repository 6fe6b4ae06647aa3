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
drafts of a verification.

Batch buckets (:func:`batch_buckets`, :func:`batch_bucket`): the batch sizes a
uniform step is padded to, so one captured CUDA graph serves every batch up to
its size; adaptive speculation measures step costs per bucket by the same
definition, so the graph timings it starts from are found for every batch.
Draft sizes (:func:`draft_sizes`): the numbers of drafts per sequence an adaptive
step may choose, so the verification sizes (q = drafts + 1) graphs are captured for.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SeqInput:
    """One sequence's part of a step, as a caller describes it."""

    token_ids: list[int]  # the new tokens to run (prefill chunk, or pending token + drafts)
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # must cover start_pos + len(token_ids) positions
    logits_offsets: list[int] = field(default_factory=list)  # offsets in token_ids whose logits are wanted
    num_drafts: int = 0  # how many of token_ids are drafts (the last ones)


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
        pads come after every real token, so causal attention keeps them invisible."""
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
            ids.extend(s.token_ids)
            for p in range(s.start_pos, end):
                pos.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
            if pad_to is not None and pad_to > n:
                top = max_position if max_position is not None else end + pad_to
                ids.extend([0] * (pad_to - n))
                pos.extend(min(p, top) for p in range(end, s.start_pos + pad_to))
                slots.extend([trash_slot] * (pad_to - n))
                end = s.start_pos + pad_to
            qs.append(len(ids))
            lens.append(end)
        return cls(
            token_ids=ids, positions=pos, slot_mapping=slots, query_start=qs, seq_lens=lens,
            block_tables=[s.block_table for s in seqs], logits_rows=rows, row_offsets=offsets,
            num_drafts=[s.num_drafts for s in seqs],
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
