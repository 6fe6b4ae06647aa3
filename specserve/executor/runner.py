"""The runner interface: what runs one ``StepBatch`` (the step contract,
``executor.batch``) as one flattened forward, and what it returns.

A runner owns a model and its KV cache tensors; callers (the engine, a draft
proposer) pass only token ids, positions and block tables.  The backends that
implement it are in ``executor.backends`` (torch, the fused CPU decoder, the
persistent-buffer step runner with CUDA graphs, tensor parallelism); which one
runs a model is decided in one place, ``executor.backends.factory``, from what
each backend declares it supports (``Supports``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from specserve.executor.batch import SeqInput, StepBatch
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel

if TYPE_CHECKING:
    from specserve.executor.static_runner import StaticStepRunner


@dataclass
class ForwardOutput:
    logits: Tensor  # (N, V) float32, rows in the order of the seqs' logits_offsets
    hidden: Tensor  # (N, H) final-norm hidden states of the same rows
    # layer id -> (T, H) residual stream entering that layer; id num_layers: the
    # final-normed hidden state of every token (the LM head's input)
    aux: dict[int, Tensor]
    row_offsets: list[int]  # per seq: first row of its logits in `logits`


@dataclass(frozen=True)
class Supports:
    """What a backend can run; the factory refuses anything outside it in one line."""

    devices: tuple[str, ...] | None = None  # kinds of device it runs on ("cpu", "cuda"); None: any
    dtypes: tuple[torch.dtype, ...] | None = None  # model dtypes it runs; None: any
    graphs: bool = False  # can replay captured CUDA graphs of decode and verification steps
    aux_per_step: bool = True  # any aux layers per step (False: the ones it was built with)

    def refusal(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when a model on ``device`` in ``dtype`` fits, else why not."""
        kind = device.type
        if self.devices is not None and kind not in self.devices:
            return f"runs on {' or '.join(self.devices)}, not {kind}"
        if self.dtypes is not None and dtype not in self.dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"needs model.dtype={names}, not {str(dtype).removeprefix('torch.')}"
        return None


class Runner:
    """The interface every backend implements.  ``fused`` and ``static`` name the
    machinery a backend runs on, for callers that report or drive it (None where it
    has none): the fused CPU decoder (``kernels.cpu_decoder.CpuDecoder``) and the
    persistent-buffer step runner (``executor.static_runner.StaticStepRunner``)."""

    name: ClassVar[str]
    supports: ClassVar[Supports]
    loaded: LoadedModel
    model: Any  # the model's module (a LlamaModel, a shard of one, or a view of one)
    kv: KVCache
    device: torch.device
    min_causal_len: int = 2
    fused: Any = None
    static: StaticStepRunner | None = None

    @property
    def attention_backend(self) -> str:
        """What runs attention: "torch" (the reference path), "triton" or "cpu_fused"."""
        return "torch"

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks every step runs on."""
        return 1

    def forward(self, seqs: list[SeqInput], aux_layer_ids: tuple[int, ...] = ()) -> ForwardOutput:
        """Convenience for callers that think per sequence (the draft proposer, tests)."""
        return self.execute(StepBatch.from_inputs(seqs, self.kv.block_size), aux_layer_ids)

    def execute(
        self, batch: StepBatch, aux_layer_ids: tuple[int, ...] = (), device_token_ids: Tensor | None = None
    ) -> ForwardOutput:
        """Run ``batch``.  ``device_token_ids`` (T,) on the runner's device replace
        ``batch.token_ids`` (a drafter feeding back its own samples)."""
        raise NotImplementedError
