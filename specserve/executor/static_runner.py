"""The step runner with persistent buffers: the CUDA data path.

Per step the host writes the ``StepBatch`` into a pinned staging buffer
(int32: token ids, positions, slots, logits rows, query starts, context
lengths, block tables, and for a runner built with ``trees`` the tree bases and
int64 tree masks, at fixed offsets), and ONE non-blocking copy moves it to
the same layout on the device.  That copy reads the host buffer when the stream
reaches it, so ``StagingBuffer`` alternates two host buffers and rewrites one
only after the event recorded behind its previous copy (two steps ago) has
completed: steps that sample nothing (the chunks of a long prompt) run without
a host synchronisation and still cannot overwrite a step the device has not
read yet.  The forward reads only slices of the device buffers whose shapes
are fixed by Python ints, and attention is the paged Triton kernel reading
block tables directly (``kernels.paged_attention``), so nothing in a step
allocates from the host or waits for the device beyond that event.

Steps whose shape is fixed by the batch size -- a decode step (every sequence
1 new token) and a uniform verification step (every sequence q = K'+1 tokens,
shorter drafts padded) -- are captured as CUDA graphs for batch buckets
1, 2, 4, ..., max_num_seqs and each captured q; a step replays the smallest
bucket that fits.  A uniform step with draft trees (``StepBatch.tree_masks``:
every sequence q tokens, some of them tree nodes) is a shape of its own, captured
for each q of ``tree_query_lens`` (the kernel's TREE binary reads the staged tree
bases and masks); its graphs are kept apart from the chains' (``tree_graphs``).
Every graph writes its logits, hidden and aux states into ONE
set of output buffers sized for the largest (a graph's own outputs would stay
alive in the pool, one set per graph).  Padding rows of a bucket are sequences
with no tokens (qlen 0), whose K/V writes go to the cache's trash slot.  Mixed
steps (prefill chunks) run the same function eagerly.

Start-up never lets a kernel take the server down.  The attention backend --
the Triton kernels or their torch twin -- is chosen on this model's geometry by
a check against the twin (``kernels.backends``); ``warm_up`` (run first by
``capture``, graphs or not) then compiles every Triton binary the runner can
launch (``kernels.specializations``: nothing compiles while serving), and a
binary that does not compile switches the runner to the twin.  A graph whose
capture fails leaves its (bucket, q) step eager.  Each of these logs one
warning line.

On the CPU this runner is used by tests with the kernel's torch twin: the same
step function, checked to compile with ``torch.compile(fullgraph=True)``
(no graph break = no host synchronisation or data-dependent shape), and, given
a ``transfer``, with a separate device buffer fed by that copier (a device
double that runs copies as late as a GPU may); given ``graphs_api``, with a
graph double (capture records the step, replay reruns it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specserve.executor.attention import AttentionMetadata, PagedKernelArgs
from specserve.executor.batch import StepBatch, batch_bucket, int64_masks
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel
from specserve.executor.staging import StagingBuffer, Transfer
from specserve.kernels.backends import BackendChoice, choose_attention, fall_back
from specserve.kernels.launches import Launch
from specserve.kernels.specializations import AttentionGeometry, batch_buckets, runner_launches, runner_step_shapes

log = logging.getLogger(__name__)

__all__ = ["CudaGraphs", "StaticStepRunner", "StepResult", "batch_buckets"]


@dataclass
class StepResult:
    logits: Tensor  # (R, V) float32: logits of the batch's logits_rows (a view of static memory)
    hidden: Tensor  # (R, H) final-norm hidden states of the same rows
    aux: dict[int, Tensor]  # layer id -> (T, H) residual stream entering that layer (T >= batch tokens)


class CudaGraphs:
    """How the runner makes graphs: CUDA's, in one memory pool (the seam where tests put a
    double that captures by recording the step function and replays it eagerly)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def capture(self, fn: Callable[[], StepResult]) -> tuple[Any, StepResult]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out


class StaticStepRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        kv: KVCache,
        *,
        max_num_seqs: int,
        max_num_tokens: int,
        graph_query_lens: tuple[int, ...] = (1,),
        tree_query_lens: tuple[int, ...] = (),
        trees: bool | None = None,
        aux_layer_ids: tuple[int, ...] = (),
        attention_impl: str | BackendChoice = "auto",
        use_graphs: bool | None = None,
        transfer: Transfer | None = None,
        graphs_api: Callable[[], Any] | None = None,
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
        self.tree_query_lens = tuple(sorted(set(tree_query_lens)))
        # ``trees``: steps may carry draft trees (their kernel binaries are compiled at
        # start-up); on by default when tree steps are captured
        self.trees = bool(self.tree_query_lens) if trees is None else trees
        self.buckets = batch_buckets(max_num_seqs)
        # Uniform steps of the largest bucket and q must fit too.
        self.max_tokens = max(max_num_tokens, max_num_seqs * max(self.graph_query_lens + self.tree_query_lens))
        self.aux_layer_ids = tuple(aux_layer_ids)
        # the kernels or their torch twin: checked on this geometry at start-up (kernels.backends),
        # or a choice the caller checked on it already
        if isinstance(attention_impl, BackendChoice):
            self.attention = attention_impl
        elif attention_impl in ("auto", "triton", "torch"):
            a = self.a
            self.attention = choose_attention(attention_impl, self.device, loaded.dtype, a.num_heads, a.num_kv_heads,
                                              a.head_dim, self.block_size, a.sliding_window)
        else:
            raise ValueError(f"attention_impl: must be 'auto', 'triton' or 'torch', got {attention_impl!r}")
        self.impl = self.attention.used
        self.cuda = self.device.type == "cuda"  # else a CPU twin (tests): no split-KV, graphs only with a double
        self.use_graphs = self.cuda if use_graphs is None else use_graphs
        # ``graphs_api``: makes the graph maker (default CudaGraphs; tests: a CPU double)
        if self.use_graphs and not self.cuda and graphs_api is None:
            raise ValueError("use_graphs: CUDA graphs need a CUDA device")
        self.graphs_api = graphs_api if graphs_api is not None else (lambda: CudaGraphs(self.device))
        self.warmed_up = False
        self.warm_up_s = 0.0
        self.eager_keys: list[tuple[int, int]] = []  # graph keys whose capture failed: they run eagerly
        B, T = max_num_seqs, self.max_tokens
        # ``transfer``: on the CPU, a separate device buffer filled by that copier (tests); the
        # tree fields travel in the same buffer, so the staging-race protection covers them
        fields = [("ids", T), ("pos", T), ("slots", T), ("rows", T), ("qs", B + 1), ("lens", B),
                  ("tables", (B, self.max_blocks))]
        if self.trees:
            fields += [("tbase", B), ("tmask", T, torch.int64)]
        self.staging = StagingBuffer(fields, self.device, transfer)
        self.d = self.staging.d
        self.tables = self.d["tables"]
        self.graphs: dict[tuple[int, int], tuple[Any, StepResult]] = {}  # (bucket, q) -> (graph, outputs)
        self.tree_graphs: dict[tuple[int, int], tuple[Any, StepResult]] = {}  # the same, steps with trees
        self.outputs: StepResult | None = None  # the graphs' shared output buffers (capture)
        self._scratch: tuple[Tensor, Tensor] | None = None
        self.capture_s = 0.0

    # ------------------------------------------------------------------ host side
    def _stage(self, batch: StepBatch, num_seqs: int, num_tokens: int) -> None:
        """Write ``batch`` into the staging buffer, padded to num_seqs sequences and
        num_tokens tokens (padding: qlen 0, context 0, K/V to the trash slot)."""
        T, B = batch.num_tokens, batch.num_seqs
        h = self.staging.acquire()  # a host buffer no copy in flight still reads
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
            h["tables"][b, : len(table)] = table
        if batch.tree_masks is not None:
            h["tbase"][:B] = batch.tree_base
            h["tbase"][B:num_seqs] = 0  # context 0: no tree
            h["tmask"][:T] = int64_masks(batch.tree_masks)
            h["tmask"][T:num_tokens] = 0

    def _upload(self) -> None:
        self.staging.upload()  # the step's one host -> device copy (non-blocking)

    # ------------------------------------------------------------------ device side
    def _num_splits(self, num_seqs: int, q: int) -> int:
        if self.impl == "torch" or q > 1 or not self.cuda:
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

    def step_fn(self, num_seqs: int, num_tokens: int, max_query_len: int, num_rows: int | None,
                out: StepResult | None = None, tree: bool = False, input_embeds: list | None = None) -> StepResult:
        """The forward over the static buffers: shapes fixed by these ints only.
        ``num_rows`` None = logits of every token row (uniform steps).  ``out``: the
        shared output buffers (``alloc_outputs``): the results are written into their
        first rows and views of them returned (what captured graphs do).  ``tree``: the
        step carries draft trees (staged tree bases and masks; never split-KV).  ``input_embeds``:
        the step's given input embeddings (``StepBatch.input_embeds``; eager steps only)."""
        d = self.d
        ids = d["ids"][:num_tokens].long()
        pos = d["pos"][:num_tokens].long()
        splits = 1 if tree else self._num_splits(num_seqs, max_query_len)
        kargs = PagedKernelArgs(
            block_tables=self.tables[:num_seqs], query_start=d["qs"][: num_seqs + 1], seq_lens=d["lens"][:num_seqs],
            block_size=self.block_size, max_query_len=max_query_len, max_seq_len=self.max_seq_len,
            num_splits=splits, scratch=self._scratch_for(splits), impl=self.impl, window=self.a.sliding_window,
            tree_base=d["tbase"][:num_seqs] if tree else None, tree_masks=d["tmask"][:num_tokens] if tree else None,
            tree_positions=pos if tree else None,
        )
        meta = AttentionMetadata(slot_mapping=d["slots"][:num_tokens].long(), kernel=kargs)
        hidden, aux = self.model(ids, pos, meta, self.kv, self.aux_layer_ids, input_embeds)
        sel = hidden if num_rows is None else hidden.index_select(0, d["rows"][:num_rows].long())
        if out is None:
            return StepResult(self.model.compute_logits(sel), sel, aux)
        n = sel.shape[0]
        logits = self.model.compute_logits(sel, out=out.logits[:n])  # no float32 temporary
        return StepResult(logits, out.hidden[:n].copy_(sel),
                          {i: out.aux[i][: t.shape[0]].copy_(t) for i, t in aux.items()})

    def alloc_outputs(self) -> StepResult:
        """ONE set of output buffers for every captured graph, sized for the largest
        (bucket x q rows): a graph's outputs would otherwise stay alive in the pool, one
        set per graph (``engine.memory.graph_output_bytes`` counts this one)."""
        rows = self.max_num_seqs * max(self.graph_query_lens + self.tree_query_lens)
        a, dev, dt = self.a, self.device, self.loaded.dtype
        return StepResult(
            logits=torch.empty(rows, a.vocab_size, dtype=torch.float32, device=dev),  # (R, V)
            hidden=torch.empty(rows, a.hidden_size, dtype=dt, device=dev),  # (R, H)
            aux={i: torch.empty(rows, a.hidden_size, dtype=dt, device=dev) for i in self.aux_layer_ids},
        )

    # ------------------------------------------------------------------ public
    def graph_key(self, batch: StepBatch) -> tuple[int, int] | None:
        """(bucket, q) of the graph that runs ``batch``: in ``graphs``, or in ``tree_graphs``
        for a step with draft trees; None for a step that runs eagerly."""
        q = batch.uniform_query_len()
        lens = self.tree_query_lens if batch.tree_masks is not None else self.graph_query_lens
        if q is None or q not in lens or batch.num_seqs > self.max_num_seqs:
            return None
        bucket = batch_bucket(batch.num_seqs, self.max_num_seqs)
        return bucket, q

    @torch.inference_mode()
    def run(self, batch: StepBatch, device_token_ids: Tensor | None = None) -> StepResult:
        """Run one step.  ``device_token_ids`` (T,): the step's token ids are already on
        the device (a drafter feeding its own argmax back): they replace
        ``batch.token_ids`` without a trip through the host."""
        key = self.graph_key(batch)
        tree = batch.tree_masks is not None
        graphs = self.tree_graphs if tree else self.graphs
        if key is not None and key in graphs and not batch.input_embeds:
            bucket, q = key
            self._stage(batch, bucket, bucket * q)
            self._upload()
            if device_token_ids is not None:
                self.d["ids"][: batch.num_tokens].copy_(device_token_ids)
            graph, out = graphs[key]
            graph.replay()
            n = batch.num_tokens
            return StepResult(out.logits[:n], out.hidden[:n], {i: t[:n] for i, t in out.aux.items()})
        if tree and not self.trees:
            raise ValueError("tree_masks: this step runner was built without trees=True (no tree buffers)")
        if batch.num_tokens > self.max_tokens or batch.num_seqs > self.max_num_seqs:
            raise ValueError(f"step of {batch.num_tokens} tokens / {batch.num_seqs} sequences exceeds the "
                             f"runner's buffers ({self.max_tokens} / {self.max_num_seqs})")
        self._stage(batch, batch.num_seqs, batch.num_tokens)
        self._upload()
        if device_token_ids is not None:
            self.d["ids"][: batch.num_tokens].copy_(device_token_ids)
        q = batch.uniform_query_len()
        rows = None if q is not None else len(batch.logits_rows)
        return self.step_fn(batch.num_seqs, batch.num_tokens, batch.max_query_len, rows, tree=tree,
                            input_embeds=batch.input_embeds)

    # ------------------------------------------------------------------ start-up
    def kernel_launches(self) -> list[Launch]:
        """One launch per Triton binary this runner can launch: every step shape it accepts
        (``kernels.specializations``), the same binaries whatever the step's sizes."""
        from specserve.kernels.launches import interpreter_active

        a = self.a
        g = AttentionGeometry(a.num_heads, a.num_kv_heads, a.head_dim, self.block_size, a.sliding_window,
                              self.loaded.dtype)
        shapes = runner_step_shapes(g, max_num_seqs=self.max_num_seqs, max_tokens=self.max_tokens,
                                    graph_query_lens=self.graph_query_lens, max_seq_len=self.max_seq_len,
                                    split_kv=self.cuda, trees=self.trees, tree_query_lens=self.tree_query_lens)
        return runner_launches(g, shapes, self.device, interpreter_active())

    def warm_up(self, progress: bool = True) -> int:
        """Compile every Triton binary this runner can launch before the first step (with
        a Triton cache from an earlier start, TRITON_CACHE_DIR, each is a load), so none
        compiles while serving.  A binary that does not compile switches the runner to
        the torch twin (one warning).  Returns the number of binaries."""
        if self.impl != "triton" or self.warmed_up:
            return 0
        from specserve.kernels.launches import compile_only

        t0 = time.perf_counter()
        launches = self.kernel_launches()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(launches), desc="compiling Triton kernels", unit="kernel")
        try:
            for launch in launches:
                compile_only(launch)
                if bar is not None:
                    bar.update(1)
        except Exception as exc:  # any compiler or launcher failure: the twin serves instead
            self.attention = fall_back(self.attention, f"to compile {launch.kernel.name}", exc)
            self.impl = "torch"
            return 0
        finally:
            if bar is not None:
                bar.close()
        self.warmed_up = True
        self.warm_up_s = time.perf_counter() - t0
        log.info("compiled %d Triton binaries (attention, KV write) in %.1f s", len(launches), self.warm_up_s)
        return len(launches)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        """Compile every kernel binary (:meth:`warm_up`), then capture a graph for every
        (bucket, q), largest first so smaller ones reuse the pool's memory; every graph
        writes its outputs into the same buffers.  Dummy steps write only to the trash
        slot.  A key whose capture fails runs eagerly (one warning for all such keys)."""
        self.warm_up(progress)
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        maker = self.graphs_api()
        self.outputs = self.alloc_outputs()
        keys = [(b, q, False) for q in self.graph_query_lens for b in self.buckets]
        keys += [(b, q, True) for q in self.tree_query_lens for b in self.buckets]
        keys.sort(key=lambda k: k[0] * k[1], reverse=True)
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(keys), desc="capturing CUDA graphs", unit="graph")
        failed: list[tuple[tuple[int, int], Exception]] = []
        for bucket, q, tree in keys:
            try:
                if tree:
                    self.tree_graphs[bucket, q] = self._capture_one(maker, bucket, q, tree=True)
                else:
                    self.graphs[bucket, q] = self._capture_one(maker, bucket, q)
            except Exception as exc:  # this key runs eagerly; the others keep their graphs
                failed.append(((bucket, q), exc))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        maker.synchronize()
        self.capture_s = time.perf_counter() - t0
        self.eager_keys = [k for k, _ in failed]
        if failed:
            exc = failed[0][1]
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            log.warning("CUDA graph capture failed for %d of %d (batch, q) keys %s (first: %s: %s); those steps "
                        "run eagerly", len(failed), len(keys), self.eager_keys, type(exc).__name__, first)
        log.info("captured %d CUDA graphs (batch buckets %s x q %s, trees q %s) in %.1f s",
                 len(self.graphs) + len(self.tree_graphs), self.buckets, list(self.graph_query_lens),
                 list(self.tree_query_lens), self.capture_s)

    def _capture_one(self, maker, bucket: int, q: int, tree: bool = False) -> tuple[Any, StepResult]:
        dummy = self._dummy_batch(bucket, q, tree)
        self._stage(dummy, bucket, bucket * q)
        self._upload()
        for _ in range(2):  # warm up (cuBLAS picks kernels, allocator pools fill) outside capture
            self.step_fn(bucket, bucket * q, q, None, self.outputs, tree)
        maker.synchronize()
        return maker.capture(lambda: self.step_fn(bucket, bucket * q, q, None, self.outputs, tree))

    def _dummy_batch(self, num_seqs: int, q: int, tree: bool = False) -> StepBatch:
        trash = self.kv.trash_slot
        block = trash // self.block_size
        T = num_seqs * q
        return StepBatch(
            token_ids=[0] * T, positions=list(range(q)) * num_seqs, slot_mapping=[trash] * T,
            query_start=[i * q for i in range(num_seqs + 1)], seq_lens=[q] * num_seqs,
            block_tables=[[block]] * num_seqs, logits_rows=list(range(T)), row_offsets=[i * q for i in range(num_seqs)],
            num_drafts=[q - 1] * num_seqs,
            # a tree-shaped capture: every sequence a chain (tree_base = its length: the causal rule)
            tree_base=[q] * num_seqs if tree else None, tree_masks=[0] * T if tree else None,
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
