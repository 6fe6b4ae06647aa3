"""The tensor-parallel backend: rank 0's runner of a sharded model.

It wraps the runner of rank 0's own shard (the torch backend) and coordinates the
ranks: each step is first sent to the workers (``parallel.worker`` runs it on their
shards with the same block tables and slots), then rank 0 runs its part; the
forward's all-reduces and the logits gather join the ranks inside it
(``parallel.layers``).  Building one registers it with the workers, which build a
runner and a KV cache of the same block count for that model (``Shard.attach``).

The shard (``LoadedModel.tp``, a ``specserve.parallel.shard.Shard``) is used
through ``attach``, ``send_step``, ``step`` and ``size`` only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specserve.executor.batch import StepBatch
from specserve.executor.runner import ForwardOutput, Runner, Supports


class TensorParallelRunner(Runner):
    name = "tensor_parallel"
    supports = Supports()  # that of the runner it wraps: the torch backend on every rank

    def __init__(self, inner: Runner):
        self.inner = inner
        self.shard = inner.loaded.tp
        self.loaded = inner.loaded
        self.model = inner.model
        self.kv = inner.kv
        self.device = inner.device
        self.min_causal_len = inner.min_causal_len
        self.shard.attach(self)  # refuses a view of the sharded model; the workers build their twins

    @property
    def attention_backend(self) -> str:
        return self.inner.attention_backend

    @property
    def tensor_parallel_size(self) -> int:
        return self.shard.size

    @torch.inference_mode()
    def execute(
        self, batch: StepBatch, aux_layer_ids: tuple[int, ...] = (), device_token_ids: Tensor | None = None
    ) -> ForwardOutput:
        if device_token_ids is not None:  # a drafter's own samples: the workers need them as ids
            batch.token_ids = device_token_ids.tolist()
        self.shard.send_step(self, batch, aux_layer_ids)
        with self.shard.step():
            return self.inner.execute(batch, aux_layer_ids)
