"""The step runner with persistent buffers: the CUDA data path.

Per step the host writes the ``StepBatch`` into ONE pinned staging buffer
(int32: token ids, positions, slots, logits rows, query starts, context
lengths, block tables, at fixed offsets), and ONE non-blocking copy moves it to
the same layout on the device.  The forward reads only slices of those device
buffers whose shapes are fixed by Python ints, and attention is the paged
Triton kernel reading block tables directly (``kernels.paged_attention``), so
nothing in a step allocates from the host or waits for the device.

Steps whose shape is fixed by the batch size -- a decode step (every sequence
1 new token) and a uniform verification step (every sequence q = K'+1 tokens,
shorter drafts padded) -- are captured as CUDA graphs for batch buckets
1, 2, 4, ..., max_num_seqs and each captured q; a step replays the smallest
bucket that fits.  Padding rows of a bucket are sequences with no tokens
(qlen 0), whose K/V writes go to the cache's trash slot.  Mixed steps (prefill
chunks) run the same function eagerly.

On the CPU this runner is used by tests with the kernel's torch twin: the same
step function, checked to compile with ``torch.compile(fullgraph=True)``
(no graph break = no host synchronisation or data-dependent shape).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specserve.executor.attention import AttentionMetadata, PagedKernelArgs
from specserve.executor.batch import StepBatch
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel

log = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to and including max_num_seqs."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    out.append(max_num_seqs)
    return out


@dataclass
class StepResult:
    logits: Tensor  # (R, V) float32: logits of the batch's logits_rows (a view of static memory)
    hidden: Tensor  # (R, H) final-norm hidden states of the same rows
    aux: dict[int, Tensor]  # layer id -> (T, H) residual stream entering that layer (T >= batch tokens)


class StagingBuffer:
    """Named int32 fields packed in ONE host buffer (pinned on CUDA) and its device twin
    (the same buffer on the CPU): the host writes the fields through numpy views
    (``h``), the device reads tensor views (``d``), and ``upload`` is the one
    host -> device copy between them."""

    def __init__(self, sizes: list[tuple[str, int]], device: torch.device):
        total = sum(n for _, n in sizes)
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.dev = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        self.h: dict[str, np.ndarray] = {}
        self.d: dict[str, Tensor] = {}
        at = 0
        for name, n in sizes:
            self.h[name] = self.host[at : at + n].numpy()
            self.d[name] = self.dev[at : at + n]
            at += n

    def upload(self) -> None:
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)


class StaticStepRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        kv: KVCache,
        *,
        max_num_seqs: int,
        max_num_tokens: int,
        graph_query_lens: tuple[int, ...] = (1,),
        aux_layer_ids: tuple[int, ...] = (),
        attention_impl: str = "auto",
        use_graphs: bool | None = None,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.kv = kv
        self.device = loaded.device
        self.a = loaded.arch
        self.block_size = kv.block_size
        self.max_seq_len = loaded.max_model_len
        self.max_blocks = -(-self.max_seq_len // kv.block_size) + 1
        self.max_num_seqs = max_num_seqs
        self.graph_query_lens = tuple(sorted(set(graph_query_lens)))
        self.buckets = batch_buckets(max_num_seqs)
        # Uniform steps of the largest bucket and q must fit too.
        self.max_tokens = max(max_num_tokens, max_num_seqs * max(self.graph_query_lens))
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.impl = attention_impl
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("use_graphs: CUDA graphs need a CUDA device")
        B, T = max_num_seqs, self.max_tokens
        self.staging = StagingBuffer([("ids", T), ("pos", T), ("slots", T), ("rows", T), ("qs", B + 1),
                                      ("lens", B), ("tables", B * self.max_blocks)], self.device)
        self.h_np, self.d = self.staging.h, self.staging.d
        self.tables = self.d["tables"].view(max_num_seqs, self.max_blocks)
        self.h_tables = self.h_np["tables"].reshape(max_num_seqs, self.max_blocks)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, StepResult]] = {}
        self.graph_pool = None
        self._scratch: tuple[Tensor, Tensor] | None = None
        self.capture_s = 0.0

    # ------------------------------------------------------------------ host side
    def _stage(self, batch: StepBatch, num_seqs: int, num_tokens: int) -> None:
        """Write ``batch`` into the staging buffer, padded to num_seqs sequences and
        num_tokens tokens (padding: qlen 0, context 0, K/V to the trash slot)."""
        T, B = batch.num_tokens, batch.num_seqs
        h = self.h_np
        h["ids"][:T] = batch.token_ids
        h["pos"][:T] = batch.positions
        h["slots"][:T] = batch.slot_mapping
        if num_tokens > T:
            h["ids"][T:num_tokens] = 0
            h["pos"][T:num_tokens] = 0
            h["slots"][T:num_tokens] = self.kv.trash_slot
        R = len(batch.logits_rows)
        h["rows"][:R] = batch.logits_rows
        h["qs"][: B + 1] = batch.query_start
        h["qs"][B + 1 : num_seqs + 1] = T
        h["lens"][:B] = batch.seq_lens
        h["lens"][B:num_seqs] = 0
        for b, table in enumerate(batch.block_tables):
            self.h_tables[b, : len(table)] = table

    def _upload(self) -> None:
        self.staging.upload()  # the step's one host -> device copy

    # ------------------------------------------------------------------ device side
    def _num_splits(self, num_seqs: int, q: int) -> int:
        if self.impl == "torch" or q > 1 or self.device.type != "cuda":
            return 1
        from specserve.kernels.paged_attention import default_num_splits

        return default_num_splits(num_seqs, self.a.num_heads, self.a.num_kv_heads, self.a.head_dim, q, self.max_seq_len)

    def _scratch_for(self, splits: int) -> tuple[Tensor, Tensor] | None:
        if splits <= 1:
            return None
        if self._scratch is None:
            from specserve.kernels.paged_attention import make_split_scratch

            max_decode_tokens = self.max_num_seqs
            self._scratch = make_split_scratch(16, max_decode_tokens, self.a.num_heads, self.a.head_dim, self.device)
        return self._scratch

    def step_fn(self, num_seqs: int, num_tokens: int, max_query_len: int, num_rows: int | None) -> StepResult:
        """The forward over the static buffers: shapes fixed by these ints only.
        ``num_rows`` None = logits of every token row (uniform steps)."""
        d = self.d
        ids = d["ids"][:num_tokens].long()
        pos = d["pos"][:num_tokens].long()
        splits = self._num_splits(num_seqs, max_query_len)
        kargs = PagedKernelArgs(
            block_tables=self.tables[:num_seqs], query_start=d["qs"][: num_seqs + 1], seq_lens=d["lens"][:num_seqs],
            block_size=self.block_size, max_query_len=max_query_len, max_seq_len=self.max_seq_len,
            num_splits=splits, scratch=self._scratch_for(splits), impl=self.impl, window=self.a.sliding_window,
        )
        meta = AttentionMetadata(slot_mapping=d["slots"][:num_tokens].long(), kernel=kargs)
        hidden, aux = self.model(ids, pos, meta, self.kv, self.aux_layer_ids)
        sel = hidden if num_rows is None else hidden.index_select(0, d["rows"][:num_rows].long())
        return StepResult(self.model.compute_logits(sel), sel, aux)

    # ------------------------------------------------------------------ public
    def graph_key(self, batch: StepBatch) -> tuple[int, int] | None:
        q = batch.uniform_query_len()
        if q is None or q not in self.graph_query_lens or batch.num_seqs > self.max_num_seqs:
            return None
        bucket = next(b for b in self.buckets if b >= batch.num_seqs)
        return bucket, q

    @torch.inference_mode()
    def run(self, batch: StepBatch, device_token_ids: Tensor | None = None) -> StepResult:
        """Run one step.  ``device_token_ids`` (T,): the step's token ids are already on
        the device (a drafter feeding its own argmax back): they replace
        ``batch.token_ids`` without a trip through the host."""
        key = self.graph_key(batch)
        if key is not None and key in self.graphs:
            bucket, q = key
            self._stage(batch, bucket, bucket * q)
            self._upload()
            if device_token_ids is not None:
                self.d["ids"][: batch.num_tokens].copy_(device_token_ids)
            graph, out = self.graphs[key]
            graph.replay()
            n = batch.num_tokens
            return StepResult(out.logits[:n], out.hidden[:n], {i: t[:n] for i, t in out.aux.items()})
        if batch.num_tokens > self.max_tokens or batch.num_seqs > self.max_num_seqs:
            raise ValueError(f"step of {batch.num_tokens} tokens / {batch.num_seqs} sequences exceeds the "
                             f"runner's buffers ({self.max_tokens} / {self.max_num_seqs})")
        self._stage(batch, batch.num_seqs, batch.num_tokens)
        self._upload()
        if device_token_ids is not None:
            self.d["ids"][: batch.num_tokens].copy_(device_token_ids)
        q = batch.uniform_query_len()
        rows = None if q is not None else len(batch.logits_rows)
        return self.step_fn(batch.num_seqs, batch.num_tokens, batch.max_query_len, rows)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Capture a graph for every (bucket, q), largest first so smaller ones reuse
        the pool's memory.  Dummy steps write only to the trash slot."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        self.graph_pool = torch.cuda.graph_pool_handle()
        keys = [(b, q) for q in self.graph_query_lens for b in self.buckets]
        keys.sort(key=lambda k: k[0] * k[1], reverse=True)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(keys), desc="capturing CUDA graphs", unit="graph")
        for bucket, q in keys:
            dummy = self._dummy_batch(bucket, q)
            self._stage(dummy, bucket, bucket * q)
            self._upload()
            for _ in range(2):  # warm up (Triton compiles, cuBLAS picks kernels) outside capture
                self.step_fn(bucket, bucket * q, q, None)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                out = self.step_fn(bucket, bucket * q, q, None)
            self.graphs[(bucket, q)] = (graph, out)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d CUDA graphs (batch buckets %s x q %s) in %.1f s",
                 len(self.graphs), self.buckets, list(self.graph_query_lens), self.capture_s)

    def _dummy_batch(self, num_seqs: int, q: int) -> StepBatch:
        trash = self.kv.trash_slot
        block = trash // self.block_size
        T = num_seqs * q
        return StepBatch(
            token_ids=[0] * T, positions=list(range(q)) * num_seqs, slot_mapping=[trash] * T,
            query_start=[i * q for i in range(num_seqs + 1)], seq_lens=[q] * num_seqs,
            block_tables=[[block]] * num_seqs, logits_rows=list(range(T)), row_offsets=[i * q for i in range(num_seqs)],
            num_drafts=[q - 1] * num_seqs,
        )

    def time_graphs(self, repeats: int = 5) -> dict[tuple[int, int], float]:
        """Seconds per replay of each captured graph (device time with a sync): the cost
        table adaptive speculation starts from."""
        out = {}
        for key, (graph, _) in self.graphs.items():
            graph.replay()
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            for _ in range(repeats):
                graph.replay()
            torch.cuda.synchronize(self.device)
            out[key] = (time.perf_counter() - t0) / repeats
        return out


def cuda_kv_budget_bytes(
    loaded: LoadedModel, max_num_tokens: int, block_size: int, utilization: float, graph_tokens: int
) -> int:
    """Bytes left for the KV cache: utilization x the device's memory, minus what this
    process holds now (weights), minus the peak activation memory of a step of
    ``max_num_tokens`` tokens (measured: a dummy prefill of that size), minus an
    allowance for the CUDA graphs' pool (the largest captured step's activations and
    logits, ``graph_tokens`` rows, counted twice for the pool's fragmentation)."""
    from specserve.executor.batch import SeqInput
    from specserve.executor.runner import ModelRunner

    dev = loaded.device
    a = loaded.arch
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    _, total = torch.cuda.mem_get_info(dev)
    held = torch.cuda.memory_allocated(dev)
    blocks = -(-max_num_tokens // block_size) + 1
    scratch = KVCache(a.num_layers, blocks, block_size, a.num_kv_heads, a.head_dim, loaded.dtype, dev)
    runner = ModelRunner(loaded, scratch, cpu_kernel="torch")
    torch.cuda.reset_peak_memory_stats(dev)
    ids = [0] * max_num_tokens
    runner.forward([SeqInput(ids, 0, list(range(blocks)), [max_num_tokens - 1])])
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - held - scratch.data.numel() * scratch.data.element_size()
    del runner, scratch
    torch.cuda.empty_cache()
    elem = torch.empty((), dtype=loaded.dtype).element_size()
    graph_reserve = 2 * graph_tokens * (a.vocab_size * 4 + 8 * a.hidden_size * elem + 4 * a.intermediate_size * elem)
    budget = int(utilization * total) - held - max(peak, 0) - graph_reserve
    log.info(
        "GPU memory: %.2f GiB total x %.2f; weights %.2f GiB, step peak %.2f GiB, graph allowance %.2f GiB -> "
        "KV %.2f GiB", total / 2**30, utilization, held / 2**30, peak / 2**30, graph_reserve / 2**30,
        max(budget, 0) / 2**30,
    )
    return max(budget, 0)
