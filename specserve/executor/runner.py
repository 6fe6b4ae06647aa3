"""Model runner: turns per-sequence inputs into one flattened forward.

It owns the model and its KV cache tensors; callers (the engine, the draft
proposer) only pass token ids, positions and block tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specserve.executor.attention import AttentionMetadata, CausalGroup, build_padded_group
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel


@dataclass
class SeqInput:
    token_ids: list[int]  # the new tokens to run (prefill chunk, or pending token + drafts)
    start_pos: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # must cover start_pos + len(token_ids) positions
    logits_offsets: list[int] = field(default_factory=list)  # offsets in token_ids whose logits are wanted


@dataclass
class ForwardOutput:
    logits: Tensor  # (N, V) float32, rows in the order of the seqs' logits_offsets
    hidden: Tensor  # (N, H) final-norm hidden states of the same rows
    aux: dict[int, Tensor]  # layer id -> (T, H) residual stream entering that layer
    row_offsets: list[int]  # per seq: first row of its logits in `logits`


class ModelRunner:
    def __init__(self, loaded: LoadedModel, kv: KVCache, min_causal_len: int = 2):
        self.loaded = loaded
        self.model = loaded.model
        self.kv = kv
        self.device = loaded.device
        self.min_causal_len = min_causal_len

    def _metadata(self, seqs: list[SeqInput]) -> tuple[AttentionMetadata, Tensor, Tensor, list[int]]:
        bs = self.kv.block_size
        window = self.loaded.arch.sliding_window
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        causal: list[CausalGroup] = []
        pq_starts, pq_lens, p_ctx, p_tables = [], [], [], []
        for s in seqs:
            n = len(s.token_ids)
            start_t = len(ids)
            starts.append(start_t)
            ids.extend(s.token_ids)
            for p in range(s.start_pos, s.start_pos + n):
                pos.append(p)
                slots.append(s.block_table[p // bs] * bs + p % bs)
            fresh = s.start_pos == 0 and n >= self.min_causal_len and (window is None or n <= window)
            if fresh:
                causal.append(CausalGroup(start=start_t, length=n))
            else:
                pq_starts.append(start_t)
                pq_lens.append(n)
                p_ctx.append(s.start_pos + n)
                p_tables.append(s.block_table)
        dev = self.device
        padded = None
        if pq_lens:
            padded = build_padded_group(pq_starts, pq_lens, p_ctx, p_tables, bs, window, dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev), causal=causal, padded=padded
        )
        return meta, torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev), starts

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput], aux_layer_ids: tuple[int, ...] = ()) -> ForwardOutput:
        meta, input_ids, positions, starts = self._metadata(seqs)
        hidden, aux = self.model(input_ids, positions, meta, self.kv, aux_layer_ids)
        rows: list[int] = []
        row_offsets: list[int] = []
        for s, st in zip(seqs, starts):
            row_offsets.append(len(rows))
            rows.extend(st + o for o in s.logits_offsets)
        sel = hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)] if rows else hidden[:0]
        return ForwardOutput(logits=self.model.compute_logits(sel), hidden=sel, aux=aux, row_offsets=row_offsets)
