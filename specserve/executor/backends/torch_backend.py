"""The torch backend: the model's own forward, eagerly, on the CPU or on CUDA.

Attention is the reference path (``executor.attention``: causal SDPA for fresh
prefills, a padded gather for everything else), and every tensor of a step is
built from the ``StepBatch`` on the host.  In bfloat16 on a CPU with oneDNN's
bf16 support the projections are pre-packed once (``LlamaModel.prepack``).
This is also what every rank runs under tensor parallelism.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specserve.executor.attention import AttentionMetadata, batch_metadata
from specserve.executor.batch import StepBatch
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel
from specserve.executor.models.llama import can_prepack
from specserve.executor.runner import ForwardOutput, Runner, Supports


class TorchRunner(Runner):
    """``prepack``: lay the bf16 projections out for oneDNN where it runs them (a
    backend that reads the weights in place, like the fused decoder, asks not to)."""

    name = "torch"
    supports = Supports()  # wherever torch runs

    def __init__(self, loaded: LoadedModel, kv: KVCache, min_causal_len: int = 2, prepack: bool = True):
        self.loaded = loaded
        self.model = loaded.model
        self.kv = kv
        self.device = loaded.device
        self.min_causal_len = min_causal_len
        if prepack and can_prepack(loaded.dtype, loaded.device):
            self.model.prepack()

    def _metadata(self, batch: StepBatch) -> tuple[AttentionMetadata, Tensor, Tensor]:
        meta, pos = batch_metadata(batch, self.kv.block_size, self.device, self.loaded.arch.sliding_window,
                                   self.min_causal_len)
        return meta, torch.tensor(batch.token_ids, dtype=torch.int64, device=self.device), pos

    @torch.inference_mode()
    def execute(
        self, batch: StepBatch, aux_layer_ids: tuple[int, ...] = (), device_token_ids: Tensor | None = None
    ) -> ForwardOutput:
        if device_token_ids is not None:
            batch.token_ids = device_token_ids.tolist()
        meta, input_ids, positions = self._metadata(batch)
        hidden, aux = self.model(input_ids, positions, meta, self.kv, aux_layer_ids, batch.input_embeds)
        rows = batch.logits_rows
        sel = hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)] if rows else hidden[:0]
        return ForwardOutput(logits=self.model.compute_logits(sel), hidden=sel, aux=aux, row_offsets=batch.row_offsets)
