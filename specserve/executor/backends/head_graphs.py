"""An EAGLE head's K draft steps over persistent buffers, captured as CUDA graphs.

After the head has consumed the rows the target just committed (an eager forward:
its row count varies), drafting is K steps of fixed shape per batch: logits and
argmax of the head's hidden state, then (for steps 1..K-1) one head forward of
one token per sequence at the next position.  ``HeadDraftGraphs`` runs those K
steps from static buffers, so the whole loop is one graph per batch bucket
(1, 2, 4, ..., max_num_seqs), like the target's decode steps
(``executor.static_runner``):

* the host stages, per drafting sequence, its last real position, how many
  drafts it wants and its block table into a pinned int32 buffer, moved to the
  device by ONE non-blocking copy (``StagingBuffer``: two host buffers in turn,
  each rewritten only after its previous copy's event); the hidden states are
  copied device to device;
* on the device, step s (1-based) of row b runs at position base_b + s: its
  cache slot is looked up in the staged block table, or is the cache's trash
  slot where the row wants fewer than s + 1 drafts (the sequence has no block
  there) and for the bucket's padding rows; attention is the paged kernel over
  the block tables (``PagedKernelArgs``), with the context length clamped to
  one position for those rows so nothing reads past a table;
* the K draft tokens (target ids) land in a (B, K) buffer: the round's one read.

Greedy drafts only: a round where some request samples its drafts from q
(probabilistic verification) runs the eager loop.  A bucket whose capture fails
(a synchronisation inside the loop, the graph pool out of memory) runs the same
loop eagerly from the same buffers; the others keep their graphs, and start-up
logs one warning for all such buckets.  On the CPU the loop runs eagerly with the
kernel's torch twin (tests check it equals the eager proposer and compiles with
``torch.compile(fullgraph=True)``, i.e. no host synchronisation or data-dependent
shape; a graph double stands in for CUDA's to check a failed capture).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from specserve.executor.attention import AttentionMetadata, PagedKernelArgs
from specserve.executor.batch import batch_bucket, batch_buckets
from specserve.executor.staging import StagingBuffer, Transfer
from specserve.executor.static_runner import CudaGraphs

log = logging.getLogger(__name__)


class HeadDraftGraphs:
    def __init__(self, head, kv: tuple[Tensor, Tensor], *, block_size: int, trash_slot: int, num_spec_tokens: int,
                 max_num_seqs: int, max_seq_len: int, impl: str = "auto", use_graphs: bool = False,
                 transfer: Transfer | None = None, graphs_api: Callable[[], Any] | None = None):
        self.head = head
        self.kv = kv
        self.block_size = block_size
        self.trash_slot = trash_slot
        self.num_spec_tokens = num_spec_tokens  # K: the draft steps of the loop
        self.max_num_seqs = max_num_seqs
        # drafting reads up to K - 1 positions past a sequence's end
        self.max_seq_len = max_seq_len + num_spec_tokens + 1
        self.max_blocks = -(-self.max_seq_len // block_size) + 1
        self.buckets = batch_buckets(max_num_seqs)
        self.impl = impl
        p = next(head.parameters())
        self.device = p.device
        self.use_graphs = use_graphs  # the factory's choice (executor.backends.factory.head_graphs)
        # ``graphs_api``: makes the graph maker (default ``CudaGraphs``; tests: a CPU double)
        if use_graphs and self.device.type != "cuda" and graphs_api is None:
            raise ValueError("use_graphs: CUDA graphs need a CUDA device")
        self.graphs_api = graphs_api if graphs_api is not None else (lambda: CudaGraphs(self.device))
        B = max_num_seqs
        # ``transfer``: on the CPU, a separate device buffer filled by that copier (tests)
        self.staging = StagingBuffer([("base", B), ("want", B), ("tables", (B, self.max_blocks))], self.device,
                                     transfer)
        self.base = self.staging.d["base"]  # last real position of each row (its head row is the hidden state below)
        self.want = self.staging.d["want"]  # drafts each row wants (0: padding)
        self.tables = self.staging.d["tables"]
        self.hidden = torch.zeros(B, head.c.hidden_size, dtype=p.dtype, device=self.device)
        self.query_start = torch.arange(B + 1, dtype=torch.int32, device=self.device)
        self.drafts = torch.zeros(B, num_spec_tokens, dtype=torch.int64, device=self.device)
        self.graphs: dict[int, Any] = {}  # batch bucket -> its captured loop (``replay()``)
        self.eager_buckets: list[int] = []  # buckets whose capture failed: their loop runs eagerly
        self.capture_s = 0.0

    # ------------------------------------------------------------------ device side
    def loop_fn(self, num_seqs: int) -> Tensor:
        """The K draft steps for the first ``num_seqs`` rows of the static buffers:
        shapes fixed by ``num_seqs`` only.  Returns the (num_seqs, K) drafts buffer."""
        head, bs = self.head, self.block_size
        B = num_seqs
        hidden = self.hidden[:B]
        base = self.base[:B].long()
        want = self.want[:B].long()
        tables = self.tables[:B]
        for s in range(self.num_spec_tokens):
            tokens = head.to_target_ids(head.logits(hidden).argmax(dim=-1))
            self.drafts[:B, s].copy_(tokens)
            if s == self.num_spec_tokens - 1:
                break
            live = want > s + 1  # this row's next draft needs this step's K/V
            pos = base + (s + 1)
            col = torch.clamp(pos // bs, max=self.max_blocks - 1).unsqueeze(1)
            block = tables.gather(1, col).squeeze(1).long()
            slots = torch.where(live, block * bs + pos % bs, torch.full_like(pos, self.trash_slot))
            seq_lens = torch.where(live, pos + 1, torch.ones_like(pos)).to(torch.int32)
            kargs = PagedKernelArgs(
                block_tables=tables, query_start=self.query_start[: B + 1], seq_lens=seq_lens, block_size=bs,
                max_query_len=1, max_seq_len=self.max_seq_len, impl=self.impl,
            )
            meta = AttentionMetadata(slot_mapping=slots, kernel=kargs)
            hidden = head(tokens, hidden, torch.where(live, pos, torch.zeros_like(pos)), meta, self.kv)
        return self.drafts[:B]

    # ------------------------------------------------------------------ host side
    def _stage(self, rows: list[tuple[int, int, list[int]]], bucket: int) -> None:
        """rows: (last real position, drafts wanted, block table) per drafting sequence;
        the bucket's padding rows want nothing."""
        h = self.staging.acquire()  # a host buffer no copy in flight still reads
        tables = h["tables"]
        for i, (base, want, table) in enumerate(rows):
            h["base"][i], h["want"][i] = base, want
            tables[i, : len(table)] = table
            tables[i, len(table) :] = 0
        n = len(rows)
        h["base"][n:bucket] = 0
        h["want"][n:bucket] = 0
        tables[n:bucket] = 0
        self.staging.upload()

    @torch.inference_mode()
    def draft(self, hidden: Tensor, rows: list[tuple[int, int, list[int]]]) -> list[list[int]]:
        """Drafts (target ids) per row from the head's hidden states (len(rows), H) of
        each row's last real position; row i gets its own number of drafts."""
        n = len(rows)
        if n > self.max_num_seqs:
            raise ValueError(f"{n} drafting sequences exceed the head's buffers ({self.max_num_seqs})")
        bucket = batch_bucket(n, self.max_num_seqs)
        self._stage(rows, bucket)
        self.hidden[:n].copy_(hidden)
        if bucket > n:
            self.hidden[n:bucket].zero_()
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
            out = self.drafts[:n]
        else:
            out = self.loop_fn(bucket)[:n]
        return [d[:w] for d, (_, w, _) in zip(out.tolist(), rows)]

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per batch bucket, largest first (smaller ones reuse the pool).
        The dummy rows want nothing: every K/V write goes to the trash slot.  A bucket
        whose capture fails runs its loop eagerly (one warning for all such buckets)."""
        if not self.use_graphs:
            return
        t0 = time.perf_counter()
        maker = self.graphs_api()
        failed: list[tuple[int, Exception]] = []
        for bucket in sorted(self.buckets, reverse=True):
            try:
                self.graphs[bucket] = self._capture_one(maker, bucket)
            except Exception as exc:  # this bucket drafts eagerly; the others keep their graphs
                failed.append((bucket, exc))
        maker.synchronize()
        self.capture_s = time.perf_counter() - t0
        self.eager_buckets = [b for b, _ in failed]
        if failed:
            exc = failed[0][1]
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            log.warning("CUDA graph capture of the head's draft steps failed for %d of %d batch buckets %s (first: "
                        "%s: %s); those rounds draft eagerly", len(failed), len(self.buckets), self.eager_buckets,
                        type(exc).__name__, first)
        log.info("captured the head's %d draft steps as %d CUDA graphs (batch buckets %s) in %.1f s",
                 self.num_spec_tokens, len(self.graphs), self.buckets, self.capture_s)

    def _capture_one(self, maker, bucket: int) -> Any:
        self._stage([], bucket)
        for _ in range(2):  # warm up (Triton compiles, cuBLAS picks kernels) outside capture
            self.loop_fn(bucket)
        maker.synchronize()
        graph, _ = maker.capture(lambda: self.loop_fn(bucket))
        return graph
