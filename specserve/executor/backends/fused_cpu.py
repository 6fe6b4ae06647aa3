"""The fused CPU decoder backend: bfloat16 forwards in one C call per step.

The decoder (``kernels/cpu_decoder.c``, loaded by ``kernels.cpu_decoder``) runs
the whole stack for a flattened ragged batch, reading the model's bf16 weights
and KV cache in place.  Steps of more than ``fused_max_tokens`` new tokens (None:
no limit) run on the torch path instead, over the same cache.  Steps with input
embeddings (a speech prompt's audio rows) run fused too: the decoder takes the
step's input rows whole.  Rotary positions and draft trees (``StepBatch.positions``
/ ``tree_base`` / ``tree_masks``) pass through to the decoder, which applies the
same visibility rule as the torch path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specserve.executor.backends.torch_backend import TorchRunner
from specserve.executor.batch import StepBatch
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel
from specserve.executor.runner import ForwardOutput, Supports
from specserve.kernels.cpu_decoder import FusedStepArgs


def load_decoder(loaded: LoadedModel, kv: KVCache, cache_dir: Path) -> Any:
    """A ``CpuDecoder`` of ``loaded`` over ``kv``, the kernel library built under
    ``cache_dir`` if need be; raises ``KernelUnavailable`` with the reason."""
    from specserve.kernels.cpu_decoder import CpuDecoder, load_library

    return CpuDecoder(load_library(cache_dir), loaded.model, kv, loaded.max_model_len)


class FusedCpuRunner(TorchRunner):
    name = "cpu_fused"
    supports = Supports(devices=("cpu",), dtypes=(torch.bfloat16,))

    def __init__(self, loaded: LoadedModel, kv: KVCache, decoder: Any, fused_max_tokens: int | None = None,
                 min_causal_len: int = 2):
        super().__init__(loaded, kv, min_causal_len, prepack=False)  # the decoder reads the weights as they are
        self.fused = decoder
        self.fused_max_tokens = fused_max_tokens

    @property
    def attention_backend(self) -> str:
        return "cpu_fused"

    @torch.inference_mode()
    def execute(
        self, batch: StepBatch, aux_layer_ids: tuple[int, ...] = (), device_token_ids: Tensor | None = None
    ) -> ForwardOutput:
        if device_token_ids is not None:
            batch.token_ids = device_token_ids.tolist()
        if self.fused_max_tokens is not None and batch.num_tokens > self.fused_max_tokens:
            return super().execute(batch, aux_layer_ids)
        L = self.loaded.arch.num_layers
        hidden, aux = self.fused.run(batch.token_ids, FusedStepArgs.from_batch(batch),
                                     tuple(i for i in aux_layer_ids if i < L), batch.input_embeds)
        if L in aux_layer_ids:
            aux[L] = hidden  # the kernel's output rows are the final-normed states
        rows = batch.logits_rows
        sel = hidden[torch.tensor(rows, dtype=torch.int64)] if rows else hidden[:0]
        dtype = self.loaded.dtype
        return ForwardOutput(
            logits=self.fused.logits(sel),
            hidden=sel.to(dtype),
            aux={i: t.to(dtype) for i, t in aux.items()},
            row_offsets=batch.row_offsets,
        )
