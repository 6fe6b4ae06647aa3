"""Model runner: runs one ``StepBatch`` (the step contract, ``executor.batch``)
as one flattened forward.

It owns the model and its KV cache tensors; callers (the engine, the draft
proposer) only pass token ids, positions and block tables.  Backends behind
the one interface (``execute``): the persistent-buffer step runner with CUDA
graphs (``executor.static_runner``, what CUDA uses), torch on the CPU, and the
fused CPU decoder.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specserve.config import CPU_KERNELS
from specserve.errors import ConfigError
from specserve.executor.attention import AttentionMetadata, batch_metadata
from specserve.executor.batch import SeqInput, StepBatch
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel, default_cache_dir
from specserve.executor.models.llama import can_prepack

if TYPE_CHECKING:
    from specserve.executor.static_runner import StaticStepRunner

log = logging.getLogger(__name__)


@dataclass
class ForwardOutput:
    logits: Tensor  # (N, V) float32, rows in the order of the seqs' logits_offsets
    hidden: Tensor  # (N, H) final-norm hidden states of the same rows
    # layer id -> (T, H) residual stream entering that layer; id num_layers: the
    # final-normed hidden state of every token (the LM head's input)
    aux: dict[int, Tensor]
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
        static: "StaticStepRunner | None" = None,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.kv = kv
        self.device = loaded.device
        self.min_causal_len = min_causal_len
        self.fused_max_tokens = fused_max_tokens
        self.static = static  # the persistent-buffer step runner (CUDA); it runs every step
        # Tensor parallelism (specserve.parallel): the torch path on every rank; rank 0
        # broadcasts each step to the workers before running its own shard.
        self.tp = getattr(loaded, "tp", None)
        single = self.tp is None
        self.fused = None if static is not None or not single else self._fused_decoder(cpu_kernel, cache_dir)
        if static is None and self.fused is None and can_prepack(loaded.dtype, loaded.device):
            self.model.prepack()
        if not single:
            self.tp.attach(self)  # the workers build their KV caches with the same blocks

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

    def _metadata(self, batch: StepBatch) -> tuple[AttentionMetadata, Tensor, Tensor]:
        meta, pos = batch_metadata(batch, self.kv.block_size, self.device, self.loaded.arch.sliding_window,
                                   self.min_causal_len)
        return meta, torch.tensor(batch.token_ids, dtype=torch.int64, device=self.device), pos

    def forward(self, seqs: list[SeqInput], aux_layer_ids: tuple[int, ...] = ()) -> ForwardOutput:
        """Convenience for callers that think per sequence (the draft proposer, tests)."""
        return self.execute(StepBatch.from_inputs(seqs, self.kv.block_size), aux_layer_ids)

    @torch.inference_mode()
    def execute(
        self, batch: StepBatch, aux_layer_ids: tuple[int, ...] = (), device_token_ids: Tensor | None = None
    ) -> ForwardOutput:
        """Run ``batch``.  ``device_token_ids`` (T,) on the runner's device replace
        ``batch.token_ids`` (a drafter feeding back its own samples)."""
        if self.tp is not None and not self.tp.in_step:  # rank 0: every rank runs this step
            return self.tp.run_step(self, batch, aux_layer_ids, device_token_ids)
        if self.static is not None:  # aux layers were fixed when its graphs were captured
            res = self.static.run(batch, device_token_ids)
            return ForwardOutput(logits=res.logits, hidden=res.hidden, aux=res.aux, row_offsets=batch.row_offsets)
        if device_token_ids is not None:
            batch.token_ids = device_token_ids.tolist()
        if self.fused is not None and (self.fused_max_tokens is None or batch.num_tokens <= self.fused_max_tokens):
            return self._execute_fused(batch, aux_layer_ids)
        meta, input_ids, positions = self._metadata(batch)
        hidden, aux = self.model(input_ids, positions, meta, self.kv, aux_layer_ids)
        rows = batch.logits_rows
        sel = hidden[torch.tensor(rows, dtype=torch.int64, device=self.device)] if rows else hidden[:0]
        return ForwardOutput(logits=self.model.compute_logits(sel), hidden=sel, aux=aux, row_offsets=batch.row_offsets)

    def _execute_fused(self, batch: StepBatch, aux_layer_ids: tuple[int, ...]) -> ForwardOutput:
        assert self.fused is not None
        qs = batch.query_start
        info = [(qs[b], qs[b + 1] - qs[b], batch.seq_lens[b] - (qs[b + 1] - qs[b])) for b in range(batch.num_seqs)]
        L = self.loaded.arch.num_layers
        hidden, aux = self.fused.forward(batch.token_ids, info, batch.block_tables,
                                         tuple(i for i in aux_layer_ids if i < L))
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
