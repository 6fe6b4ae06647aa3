"""Which backend runs a model: the one place that reads the engine's settings and
the hardware and builds the runner of the target, of a draft model and the drafting
machinery of an EAGLE head.

The rules, in order (a model is a ``LoadedModel``: its device, dtype and shard):

1. a tensor-parallel shard (``LoadedModel.tp``): the torch backend on every rank,
   wrapped on rank 0 by the tensor-parallel backend that sends each step to the
   workers (no fused decoder, persistent buffers or graphs);
2. on CUDA: the persistent-buffer step runner (``cuda_graphs``), capturing decode
   and verification steps as graphs unless ``engine.cuda_graphs=off``, attention on
   the backend the start-up check chose (``kernels.backends``).  The target also
   runs on it on the CPU when ``engine.attention_backend=triton`` (Triton's
   interpreter: the kernels' tests); drafts there keep rule 3;
3. otherwise ``engine.cpu_kernel``: the fused CPU decoder (``fused_cpu``) where it
   is asked for (``auto``, ``fused``) and can run (bfloat16 on a CPU, with the kernel
   library), else the torch backend.  ``fused`` where it cannot run is refused.

A head's own layers (an EAGLE head, MTP) run eagerly beside the target's runner:
on CUDA they attend through the paged kernel the target's check chose
(``head_attention``), and an EAGLE head's greedy draft steps replay CUDA graphs
where the target's do (``head_graphs``; a bucket whose capture fails drafts
eagerly).

Each backend declares what it supports (``Runner.supports``): the factory reads
those declarations rather than device names where it can.  Adding a backend is
its module under ``executor/backends/`` and its line in these rules.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.config import CPU_KERNELS
from specserve.errors import ConfigError
from specserve.executor.backends.cuda_graphs import CudaGraphRunner
from specserve.executor.backends.fused_cpu import FusedCpuRunner, load_decoder
from specserve.executor.backends.tensor_parallel import TensorParallelRunner
from specserve.executor.backends.torch_backend import TorchRunner
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel, default_cache_dir
from specserve.executor.runner import Runner
from specserve.executor.static_runner import StaticStepRunner
from specserve.kernels.backends import BackendChoice, choose_attention

log = logging.getLogger(__name__)

CPU_KERNEL_KEY = "engine.cpu_kernel"


@dataclass(frozen=True)
class RunnerPlan:
    """What will run a model, known before its KV cache is sized (``engine.memory``
    counts the persistent buffers and graphs from it)."""

    cuda: bool  # the model is on a CUDA device
    static: bool  # a persistent-buffer step runner serves it (``cuda_graphs``)
    graphs: bool  # ... and replays its decode and verification steps as CUDA graphs
    tensor_parallel: bool  # its shard runs on every rank of a tensor-parallel group


@dataclass(frozen=True)
class RunnerFactory:
    """The engine's runner settings (``engine.*``; ``from_engine``) and where the fused
    kernel library is built (``model.cache_dir``; None: the default cache)."""

    cpu_kernel: str = "torch"
    fused_max_tokens: int | None = None
    attention_backend: str = "auto"  # as asked, or (for drafters) what the target's check chose
    cuda_graphs: str = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    cache_dir: Path | None = None

    @classmethod
    def from_engine(cls, e: Any, cache_dir: str | Path | None = None) -> RunnerFactory:
        """From an ``EngineConfig`` (an engine's, or the one a proposer is handed)."""
        return cls(cpu_kernel=e.cpu_kernel, fused_max_tokens=e.cpu_fused_max_tokens,
                   attention_backend=e.attention_backend, cuda_graphs=e.cuda_graphs, max_num_seqs=e.max_num_seqs,
                   max_num_batched_tokens=e.max_num_batched_tokens, block_size=e.block_size,
                   cache_dir=Path(cache_dir) if cache_dir else None)  # fmt: skip

    # ------------------------------------------------------------------ choosing
    def plan(self, loaded: LoadedModel, target: bool = False) -> RunnerPlan:
        """Rules 1 and 2 (module docstring); ``target``: the engine's model, not a draft."""
        cuda = loaded.device.type == "cuda"
        if loaded.tp is not None:
            return RunnerPlan(cuda=cuda, static=False, graphs=False, tensor_parallel=True)
        static = cuda or (target and self.attention_backend == "triton")
        graphs = static and cuda and CudaGraphRunner.supports.graphs and self.cuda_graphs != "off"
        return RunnerPlan(cuda=cuda, static=static, graphs=graphs, tensor_parallel=False)

    def attention(self, loaded: LoadedModel) -> BackendChoice | None:
        """The attention backend on this model's geometry (the Triton kernels or their
        twin, checked at start-up); None for a shard (its ranks run the torch backend)."""
        if loaded.tp is not None:
            return None
        a = loaded.arch
        return choose_attention(self.attention_backend, loaded.device, loaded.dtype, a.num_heads, a.num_kv_heads,
                                a.head_dim, self.block_size, a.sliding_window)

    def cpu_decoder(self, loaded: LoadedModel, kv: KVCache) -> Any:
        """Rule 3: the fused CPU decoder of ``loaded`` over ``kv``, or None for torch."""
        mode = self.cpu_kernel
        if mode not in CPU_KERNELS:
            raise ConfigError(CPU_KERNEL_KEY, f"{mode!r} is not one of {', '.join(CPU_KERNELS)}")
        if mode == "torch":
            return None
        if FusedCpuRunner.supports.refusal(loaded.device, loaded.dtype) is not None:
            if mode == "fused":
                raise ConfigError(CPU_KERNEL_KEY, "fused needs model.dtype=bfloat16 on the CPU")
            return None
        from specserve.kernels.cpu_decoder import KernelUnavailable

        try:
            return load_decoder(loaded, kv, self.cache_dir or default_cache_dir())
        except KernelUnavailable as e:
            if mode == "fused":
                raise ConfigError(CPU_KERNEL_KEY, f"fused: {e}") from e
            log.warning("fused CPU decoder unavailable (%s): bf16 runs on the slower torch path", e)
            return None

    # ------------------------------------------------------------------ building
    def runner(self, loaded: LoadedModel, kv: KVCache, min_causal_len: int = 2) -> Runner:
        """A runner with no persistent buffers (rules 1 and 3): what a draft, a profiling
        pass or a tensor-parallel worker runs on, and the target off CUDA."""
        shard = loaded.tp
        if shard is not None:
            inner = TorchRunner(loaded, kv, min_causal_len)
            if shard.leader:
                return TensorParallelRunner(inner)
            shard.attach(inner)  # a worker: its steps are rank 0's (parallel.worker); the same refusal of views
            return inner
        decoder = self.cpu_decoder(loaded, kv)
        if decoder is not None:
            return FusedCpuRunner(loaded, kv, decoder, self.fused_max_tokens, min_causal_len)
        return TorchRunner(loaded, kv, min_causal_len)

    def target(self, loaded: LoadedModel, kv: KVCache, *, graph_query_lens: tuple[int, ...],
               aux_layer_ids: tuple[int, ...] = (), attention: BackendChoice | None = None,
               trees: bool = False, tree_query_lens: tuple[int, ...] = ()) -> Runner:
        """The engine's runner: ``graph_query_lens`` are the verification sizes (q = K'+1)
        whose steps are captured, ``aux_layer_ids`` the hidden states every step returns
        (a persistent-buffer runner's graphs write those), ``attention`` the start-up
        check's choice; ``trees``: steps may verify draft trees (a persistent-buffer
        runner stages their masks and compiles their kernels), uniform tree steps of
        ``tree_query_lens`` nodes per sequence captured.  A persistent-buffer runner has
        compiled its kernels and captured its graphs when this returns."""
        plan = self.plan(loaded, target=True)
        if not plan.static:
            return self.runner(loaded, kv)
        return self._step_runner(loaded, kv, plan, self.max_num_seqs, self.max_num_batched_tokens, graph_query_lens,
                                 aux_layer_ids, attention if attention is not None else self.attention_backend,
                                 trees=trees or bool(tree_query_lens), tree_query_lens=tree_query_lens)

    def draft(self, loaded: LoadedModel, kv: KVCache, *, max_num_seqs: int, max_num_tokens: int,
              trees: bool = False) -> Runner:
        """A draft model's runner: on CUDA its decode steps (q = 1, up to ``max_num_seqs``
        sequences) replay graphs; steps of up to ``max_num_tokens`` tokens fit its buffers;
        ``trees``: its steps may expand draft trees (tree masks staged, eagerly)."""
        plan = self.plan(loaded)
        if not plan.static:
            return self.runner(loaded, kv)
        return self._step_runner(loaded, kv, plan, max_num_seqs, max_num_tokens, (1,), (), self.attention_backend,
                                 progress=False, trees=trees)

    @staticmethod
    def _step_runner(loaded: LoadedModel, kv: KVCache, plan: RunnerPlan, max_num_seqs: int, max_num_tokens: int,
                     graph_query_lens: tuple[int, ...], aux_layer_ids: tuple[int, ...],
                     attention: BackendChoice | str, progress: bool = True, trees: bool = False,
                     tree_query_lens: tuple[int, ...] = ()) -> CudaGraphRunner:
        """Rule 2's runner, its kernels compiled and its graphs captured."""
        static = StaticStepRunner(loaded, kv, max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens,
                                  graph_query_lens=graph_query_lens, tree_query_lens=tree_query_lens, trees=trees,
                                  aux_layer_ids=aux_layer_ids, use_graphs=plan.graphs,
                                  attention_impl=attention)  # fmt: skip
        runner = CudaGraphRunner(static)
        runner.capture(progress)
        return runner

    # ------------------------------------------------------------------ EAGLE heads
    def fuse_head(self, head: Any, target: LoadedModel, kv: tuple[Any, Any] | None = None,
                  block_size: int | None = None) -> int:
        """Where the target runs on the fused decoder (rule 3), a head's projections and
        LM head run on the decoder's matmul too (torch's bf16 matmul without native bf16
        is about 3x slower, and the head's weights are most of a draft step), and, given
        the head's cache layer ``kv``, its whole decoder layer runs in one fused call
        (``FusedHead``: the dozen torch ops of a head step cost more than its
        weights on a small model).  Returns how many linear layers now run fused (0: the
        head stays on torch)."""
        if target.tp is not None or self.cpu_kernel not in ("auto", "fused"):
            return 0
        if FusedCpuRunner.supports.refusal(target.device, target.dtype) is not None:
            return 0
        from specserve.kernels.cpu_decoder import KernelUnavailable, fuse_linears, load_library

        try:
            lib = load_library(self.cache_dir or default_cache_dir())
        except KernelUnavailable as e:
            log.info("the head runs on torch (fused CPU kernel unavailable: %s)", e)
            return 0
        n = fuse_linears(head, lib, fp32_out=("lm_head",))
        if kv is not None:
            try:
                head.fused = _fused_head(lib, head, kv, block_size or self.block_size)
            except KernelUnavailable as e:
                log.info("the head's layer runs on torch ops (%s); its projections are fused", e)
        log.info("the head's %d projections run on the fused CPU kernel%s", n,
                 ", its layer in one call" if head.fused is not None else "")
        return n

    def head_attention(self, target: LoadedModel, head: Any = None) -> str | None:
        """How the eager forwards of a head's own layers attend (an EAGLE head's, MTP's):
        on CUDA through the paged kernel the target's check chose (``attention_backend``),
        so a step committing a prompt chunk beside decode rows builds no padded keys or
        masks; a ``head`` whose layer runs on the fused CPU decoder (``fuse_head``) gives
        ``heads.FUSED_HEAD``; elsewhere None, the reference attention the CPU target runs too."""
        if target.device.type == "cuda":
            return self.attention_backend
        if head is not None and getattr(head, "fused", None) is not None:
            from specserve.proposers.heads import FUSED_HEAD

            return FUSED_HEAD
        return None

    def head_graphs(self, head: Any, kv: Any, target: LoadedModel, *, block_size: int, trash_slot: int,
                    num_spec_tokens: int, max_seq_len: int) -> Any:
        """A head's K greedy draft steps from persistent buffers, captured as one CUDA
        graph per batch bucket (``head_graphs.HeadDraftGraphs``), on the attention backend
        the target's check chose; None where the head drafts eagerly (rule 2's graphs).
        A bucket whose capture fails drafts eagerly (one warning): start-up goes on.
        Where the head runs fused on the CPU (``fuse_head``: EAGLE-3 with its own LM
        head), the same greedy steps run in one C call (``cpu_decoder.FusedHeadChain``)."""
        fused = getattr(head, "fused", None)
        if fused is not None:
            from specserve.kernels.cpu_decoder import FusedHeadChain, KernelUnavailable

            try:
                return FusedHeadChain(fused, head.draft_to_target, num_spec_tokens)
            except KernelUnavailable:  # an EAGLE-1 head, or one on the target's LM head: as below
                pass
        if not self.plan(target).graphs:
            return None
        from specserve.executor.backends.head_graphs import HeadDraftGraphs

        graphs = HeadDraftGraphs(head, kv, block_size=block_size, trash_slot=trash_slot,
                                 num_spec_tokens=num_spec_tokens, max_num_seqs=self.max_num_seqs,
                                 max_seq_len=max_seq_len, impl=self.attention_backend, use_graphs=True)  # fmt: skip
        graphs.capture()
        return graphs


def _fused_head(lib: Any, head: Any, kv: tuple[Any, Any], block_size: int) -> Any:
    """An EAGLE head's ``FusedHead``: its layer; for EAGLE-3 its input built in the same
    call (the embeddings, the layer's two input norms); its norm and LM head where it
    brings its own (a reduced draft vocabulary)."""
    from specserve.kernels.cpu_decoder import FusedHead

    c, layer = head.c, head.layer
    eagle3 = None
    if c.kind == "eagle3" and head.enorm is None:
        table = head.embed_tokens.weight if head.embed_tokens is not None else head._target.embed_tokens.weight
        eagle3 = (table, layer.input_layernorm.weight, layer.hidden_norm.weight, c.norm_before_residual)
    lm = head.lm_head
    return FusedHead(lib, layer, head.rotary, kv, block_size, hidden_size=c.hidden_size,
                     intermediate_size=c.intermediate_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                     head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, num_positions=head.rotary.cos.shape[0],
                     eagle3=eagle3, final_norm=head.norm.weight if head.norm is not None else None,
                     lm_head=lm)  # fmt: skip
