"""Model runner: turns per-sequence inputs into one flattened forward.

It owns the model and its KV cache tensors; callers (the engine, the draft
proposer) only pass token ids, positions and block tables.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from specserve.config import CPU_KERNELS
from specserve.errors import ConfigError
from specserve.executor.attention import AttentionMetadata, CausalGroup, build_padded_group
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel, default_cache_dir
from specserve.executor.models.llama import can_prepack

log = logging.getLogger(__name__)


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
    """``cpu_kernel`` picks the CPU bf16 data path: ``fused`` runs forwards
    through the fused C decoder (specserve/kernels/cpu_decoder.c), except steps
    of more than ``fused_max_tokens`` new tokens (None: no limit), which go
    through torch; ``torch`` always uses torch; ``auto`` is fused where the
    kernel can run."""

    def __init__(
        self,
        loaded: LoadedModel,
        kv: KVCache,
        min_causal_len: int = 2,
        cpu_kernel: str = "torch",
        fused_max_tokens: int | None = None,
        cache_dir: Path | None = None,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.kv = kv
        self.device = loaded.device
        self.min_causal_len = min_causal_len
        self.fused_max_tokens = fused_max_tokens
        self.fused = self._fused_decoder(cpu_kernel, cache_dir)
        if self.fused is None and can_prepack(loaded.dtype, loaded.device):
            self.model.prepack()

    def _fused_decoder(self, mode: str, cache_dir: Path | None):
        if mode not in CPU_KERNELS:
            raise ConfigError("engine.cpu_kernel", f"{mode!r} is not one of {', '.join(CPU_KERNELS)}")
        if mode == "torch":
            return None
        if self.device.type != "cpu" or self.loaded.dtype != torch.bfloat16:
            if mode == "fused":
                raise ConfigError("engine.cpu_kernel", "fused needs model.dtype=bfloat16 on the CPU")
            return None
        from specserve.kernels.cpu_decoder import CpuDecoder, KernelUnavailable, load_library

        try:
            lib = load_library(cache_dir or default_cache_dir())
            return CpuDecoder(lib, self.model, self.kv, self.loaded.max_model_len)
        except KernelUnavailable as e:
            if mode == "fused":
                raise ConfigError("engine.cpu_kernel", f"fused: {e}") from e
            log.warning("fused CPU decoder unavailable (%s): bf16 runs on the slower torch path", e)
            return None

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
        if self.fused is not None and (
            self.fused_max_tokens is None or sum(len(s.token_ids) for s in seqs) <= self.fused_max_tokens
        ):
            return self._forward_fused(seqs, aux_layer_ids)
        meta, input_ids, positions, starts = self._metadata(seqs)
        hidden, aux = self.model(input_ids, positions, meta, self.kv, aux_layer_ids)
        rows: list[int] = []
        row_offsets: list[int] = []
        for s, st in zip(seqs, starts):
            row_offsets.append(len(rows))
            rows.extend(st + o for o in s.logits_offsets)
        sel = hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)] if rows else hidden[:0]
        return ForwardOutput(logits=self.model.compute_logits(sel), hidden=sel, aux=aux, row_offsets=row_offsets)

    def _forward_fused(self, seqs: list[SeqInput], aux_layer_ids: tuple[int, ...]) -> ForwardOutput:
        assert self.fused is not None
        bs = self.kv.block_size
        ids: list[int] = []
        info: list[tuple[int, int, int]] = []
        rows: list[int] = []
        row_offsets: list[int] = []
        for s in seqs:
            n = len(s.token_ids)
            if len(s.block_table) * bs < s.start_pos + n:
                raise ValueError(f"block table covers {len(s.block_table) * bs} positions, needs {s.start_pos + n}")
            row_offsets.append(len(rows))
            rows.extend(len(ids) + o for o in s.logits_offsets)
            info.append((len(ids), n, s.start_pos))
            ids.extend(s.token_ids)
        hidden, aux = self.fused.forward(ids, info, [s.block_table for s in seqs], aux_layer_ids)
        sel = hidden[torch.tensor(rows, dtype=torch.int64)] if rows else hidden[:0]
        dtype = self.loaded.dtype
        return ForwardOutput(
            logits=self.fused.logits(sel),
            hidden=sel.to(dtype),
            aux={i: t.to(dtype) for i, t in aux.items()},
            row_offsets=row_offsets,
        )
