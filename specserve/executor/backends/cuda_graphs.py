"""The persistent-buffer backend: the CUDA data path.

Every step goes through a ``StaticStepRunner`` (``executor.static_runner``): the
batch is staged into pinned host buffers and moved by one non-blocking copy,
attention is the paged kernel (Triton, or its torch twin) reading block tables
in place, and decode and uniform verification steps replay the CUDA graph of
their batch bucket.  The aux layers a step returns are the ones the step runner
was built with (its graphs write them).

On the CPU the same runner serves tests: with the kernels' torch twin, or Triton's
interpreter, and with device and graph doubles (``static_runner``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specserve.executor.batch import StepBatch
from specserve.executor.runner import ForwardOutput, Runner, Supports
from specserve.executor.static_runner import StaticStepRunner


class CudaGraphRunner(Runner):
    name = "cuda_graphs"
    supports = Supports(devices=("cuda", "cpu"), graphs=True, aux_per_step=False)

    def __init__(self, static: StaticStepRunner):
        self.static = static
        self.loaded = static.loaded
        self.model = static.model
        self.kv = static.kv
        self.device = static.device

    @property
    def attention_backend(self) -> str:
        return self.static.impl

    def capture(self, progress: bool = True) -> None:
        """Compile every Triton binary the step runner can launch, then capture its graphs."""
        self.static.capture(progress)

    @torch.inference_mode()
    def execute(
        self, batch: StepBatch, aux_layer_ids: tuple[int, ...] = (), device_token_ids: Tensor | None = None
    ) -> ForwardOutput:
        res = self.static.run(batch, device_token_ids)  # aux: the layers fixed when the graphs were captured
        return ForwardOutput(logits=res.logits, hidden=res.hidden, aux=res.aux, row_offsets=batch.row_offsets)
