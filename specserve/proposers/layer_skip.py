"""Layer-skip self-speculation (``+method=layer_skip``): the target drafts with some of
its decoder layers skipped and verifies with all of them; no extra weights.

The draft is the target's own model run through :class:`SkipModel` (embedding, the
kept layers, final norm, LM head: the same tensors, nothing copied).  It drafts like
a separate draft model (:class:`specserve.proposers.draft_model.DraftModelProposer`
does the K-step loop, catch-up and rollback) with its OWN paged KV cache holding
the kept layers only, so the draft pass never writes the target's cache: the
skipped layers change every later layer's input, and K/V computed that way must
not be mistaken for the target's.  The draft cache mirrors the target's block
count: it costs (kept / all layers) of the target's KV memory.

Which layers: ``method.skip_layers`` (explicit ids), or chosen once by a short
calibration on the prompts of the first requests (about
``method.skip_calibration_tokens`` tokens, from at least one request; those
requests are decoded without drafts until it is done):

1. one forward of the full model over the calibration tokens (teacher forced, in
   a scratch KV cache) gives the reference next-token argmax at every position;
2. greedily, ``round(skip_ratio * num_layers)`` times: the layers not yet skipped
   are ranked by how little they change the residual stream under the current
   choice (block influence, 1 - cos(layer input, layer output), measured in the
   same forward), the ``CANDIDATES`` least influential are each tried, and the
   one whose removal keeps the draft's top-1 agreement with the full model
   highest is skipped;
3. the choice, its agreement and the time taken are logged at INFO.

The draft's backend is chosen like any draft's (``executor.backends.factory``): in
bfloat16 on a CPU (``engine.cpu_kernel``) the fused decoder runs, where it can, a
:class:`~specserve.kernels.cpu_decoder.CpuDecoder` over the kept layers only (it
reads the target's bf16 weight tensors in place, and the compact draft cache), so
a draft step costs (kept / all layers) of a target step; float32 runs torch, and on
CUDA the draft steps replay CUDA graphs like draft_model's.  Choosing other layers
builds a new draft (decoder and graphs) over the same cache.  Calibration's forwards
run on the fused decoder too where the target's would (a decoder per candidate set),
else torch.  Drafts are greedy (one-hot q), so strict and probabilistic verification
stay exact.

Memory: the compact cache ((L - round(skip_ratio * L)) layers, or L minus the layers
given) is allocated when the proposer is built, right after the engine's cache, and
the draft's graphs and the calibration's scratch cache and forward are declared
(``memory``), so the engine's budget holds them before the KV cache is sized.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.engine.memory import kv_bytes_per_block, step_activation_bytes
from specserve.errors import ConfigError
from specserve.executor.attention import batch_metadata
from specserve.executor.batch import SeqInput, StepBatch
from specserve.executor.kv_cache import KVCache
from specserve.executor.backends.factory import RunnerFactory
from specserve.executor.loader import LoadedModel
from specserve.kv_blocks import BlockManager
from specserve.methods.layer_skip import LayerSkipOptions
from specserve.proposers.base import DraftRequest, MemoryNeeds, Proposal, ProposerContext, TargetShape
from specserve.proposers.draft_model import DraftModelProposer, runner_needs

log = logging.getLogger(__name__)

CANDIDATES = 3  # layers tried per calibration round (the least influential ones)
CALIBRATION_BLOCK = 16  # block size of calibration's scratch KV cache
MAX_CALIBRATION_REQUESTS = 64  # prompts collected for calibration at most


class _KVView:
    """A KV cache addressed by the target's layer ids, stored compactly."""

    def __init__(self, kv: Any, slot: dict[int, int]):
        self.kv = kv
        self.slot = slot

    def layer(self, i: int):
        return self.kv.layer(self.slot[i])


class SkipModel(nn.Module):
    """The target's LlamaModel with some decoder layers skipped (shares every tensor).

    ``compact``: the KV cache it is given holds the kept layers only (in order);
    otherwise it holds all layers and is addressed by the target's ids.  A compact
    one also looks like a LlamaModel of the kept layers to the fused CPU decoder
    (``a``, ``layers``, ``embed_tokens``, ``norm``, ``lm_head``, ``rotary``), whose
    layer i is kept layer i and reads KV-cache layer i."""

    def __init__(self, base: nn.Module, skip: set[int] | frozenset[int] = frozenset(), compact: bool = True):
        super().__init__()
        object.__setattr__(self, "base", base)  # not a submodule: the target owns (and moves) it
        self.compact = compact
        self.a = base.a
        self.set_skip(skip)

    def set_skip(self, skip: set[int] | frozenset[int]) -> None:
        """Choose the skipped layers.  A fused decoder built over this model keeps
        the old choice: build a new one (LayerSkipProposer builds a new draft)."""
        n = len(self.base.layers)
        self.skip = frozenset(skip)
        self.kept = [i for i in range(n) if i not in self.skip]
        self.slot = {i: j for j, i in enumerate(self.kept)} if self.compact else {i: i for i in range(n)}
        if self.compact:  # what CpuDecoder reads: the kept layers, in cache order
            self.a = dataclasses.replace(self.base.a, num_layers=len(self.kept))
            self.layers = [self.base.layers[i] for i in self.kept]  # a list: the base owns the modules

    @property
    def embed_tokens(self) -> nn.Module:
        return self.base.embed_tokens

    @property
    def norm(self) -> nn.Module:
        return self.base.norm

    @property
    def lm_head(self) -> nn.Module | None:
        return self.base.lm_head

    @property
    def rotary(self) -> Any:
        return self.base.rotary

    def forward(self, input_ids, positions, meta, kv, aux_layer_ids=(), influence: list | None = None):
        b = self.base
        x = b.embed_tokens(input_ids)
        cos, sin = b.rotary.tables(positions, x.dtype)
        view = _KVView(kv, self.slot)
        for i in self.kept:
            y = b.layers[i](x, cos, sin, meta, view)
            if influence is not None:  # block influence: 1 - cos(input, output), mean over tokens
                influence.append((i, float((1 - F.cosine_similarity(x.float(), y.float(), dim=-1)).mean())))
            x = y
        return b.norm(x), {}

    def compute_logits(self, hidden, out=None):
        return self.base.compute_logits(hidden, out=out)

    def prepack(self) -> None:
        pass  # the target's runner owns the weights' layout


def skip_loaded(target: LoadedModel, model: SkipModel) -> LoadedModel:
    """A LoadedModel view of the target that runs ``model`` (kept layers only)."""
    arch = dataclasses.replace(target.arch, num_layers=len(model.kept))
    return dataclasses.replace(target, model=model, arch=arch)


@torch.inference_mode()
def calibrate(target: LoadedModel, sequences: list[list[int]], num_skip: int,
              candidates: int = CANDIDATES, runners: RunnerFactory | None = None) -> tuple[list[int], float]:
    """Greedy layer choice (module docstring): returns (skipped layer ids, sorted; the
    draft's top-1 agreement with the full model over the sequences' positions).

    ``runners`` (the engine's factory; None: torch): where the target's runner would
    be the fused CPU decoder for a step of these tokens, the forwards run on it (a
    decoder over each candidate's kept layers), else torch."""
    a = target.arch
    block = CALIBRATION_BLOCK
    tables, start = [], 0
    for s in sequences:
        n = -(-len(s) // block)
        tables.append(list(range(start, start + n)))
        start += n
    kv = KVCache(a.num_layers, start, block, a.num_kv_heads, a.head_dim, target.dtype, target.device)  # scratch
    batch = StepBatch.from_inputs([SeqInput(list(s), 0, t, list(range(len(s) - 1))) for s, t in zip(sequences, tables)],
                                  block)
    runners = runners if runners is not None else RunnerFactory()
    fused = None
    if runners.fused_max_tokens is None or batch.num_tokens <= runners.fused_max_tokens:  # as for a target step
        fused = runners.runner(skip_loaded(target, SkipModel(target.model)), kv).fused
    if fused is not None:
        forward = _fused_forward(target, fused, kv, batch)
    else:
        model = SkipModel(target.model, compact=False)
        meta, pos = batch_metadata(batch, block, target.device, target.arch.sliding_window)
        ids = torch.tensor(batch.token_ids, dtype=torch.int64, device=target.device)
        rows = torch.tensor(batch.logits_rows, device=target.device)

        def forward(skip: set[int]) -> tuple[torch.Tensor, list[tuple[int, float]]]:
            """Teacher-forced argmax at every position and each kept layer's influence."""
            model.set_skip(skip)
            influence: list[tuple[int, float]] = []
            hidden, _ = model(ids, pos, meta, kv, influence=influence)
            return model.compute_logits(hidden[rows]).argmax(dim=-1), influence

    ref, influence = forward(set())
    skip: set[int] = set()
    agreement = 1.0
    for _ in range(num_skip):
        tried = [i for i, _ in sorted(influence, key=lambda x: x[1])][:candidates]
        best: tuple[float, int, list] | None = None
        for c in tried:
            pred, infl = forward(skip | {c})
            agree = float((pred == ref).float().mean())
            if best is None or agree > best[0]:
                best = (agree, c, infl)
        assert best is not None
        agreement, chosen, influence = best
        skip.add(chosen)
    return sorted(skip), agreement


def _fused_forward(target: LoadedModel, full: Any, kv: KVCache, batch: StepBatch):
    """calibrate's forward on the fused CPU decoder: ``full`` (a decoder of all layers
    over ``kv``) for the reference, one over the kept layers (compact, in the same
    scratch cache) per candidate set.  A layer's input is the residual stream the
    kernel reports entering it; its output is the next kept layer's input, or, for
    the last one, the final-normed state divided by the norm's weight (the same
    direction per token: the cosine ignores the RMS scale)."""
    from specserve.kernels.cpu_decoder import CpuDecoder

    qs = batch.query_start
    info = [(qs[b], qs[b + 1] - qs[b], 0) for b in range(batch.num_seqs)]
    rows = torch.tensor(batch.logits_rows, dtype=torch.int64)
    w = target.model.norm.weight.detach().float()
    w = torch.where(w == 0, torch.ones_like(w), w)

    def forward(skip: set[int]) -> tuple[torch.Tensor, list[tuple[int, float]]]:
        model = SkipModel(target.model, skip)
        n = len(model.kept)
        dec = full if not skip else CpuDecoder(full.lib, model, kv, target.max_model_len, use_amx=False)
        hidden, aux = dec.forward(batch.token_ids, info, batch.block_tables, tuple(range(n)))
        influence = []
        for j, i in enumerate(model.kept):
            y = aux[j + 1] if j + 1 < n else hidden / w
            influence.append((i, float((1 - F.cosine_similarity(aux[j], y, dim=-1)).mean())))
        return dec.logits(hidden[rows]).argmax(dim=-1), influence

    return forward


class LayerSkipProposer:
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, spec: LayerSkipOptions, ctx: ProposerContext):
        self.target: LoadedModel = ctx.target
        self.num_spec_tokens = spec.num_speculative_tokens
        self.tree = spec.tree  # method.tree: the draft expands trees (DraftModelProposer)
        self.ctx = ctx
        self.runners = RunnerFactory.from_engine(ctx.engine, ctx.cache_dir)
        L = self.target.arch.num_layers
        self.num_skip = round(spec.skip_ratio * L)
        self.calibration_tokens = spec.skip_calibration_tokens
        self._pending: dict[str, list[int]] = {}  # calibration prompts collected so far
        self.skip_layers: list[int] | None = None
        self.agreement: float | None = None
        self.inner: DraftModelProposer | None = None
        if spec.skip_layers is not None:
            check_skip_layers(spec.skip_layers, L)
            self.num_skip = len(set(spec.skip_layers))
        elif self.num_skip >= L:
            raise ConfigError("method.skip_ratio", f"{spec.skip_ratio} skips all {L} layers of the target; "
                                                   "keep at least one (a ratio < 1)")
        elif self.num_skip < 1:
            raise ConfigError("method.skip_ratio", f"{spec.skip_ratio} of {L} layers skips none; raise it")
        # The kept layers' cache, now: after calibration nothing of this size may be allocated.
        t, e = self.target, ctx.engine
        self.kv = KVCache(L - self.num_skip, ctx.num_kv_blocks, e.block_size, t.arch.num_kv_heads, t.arch.head_dim,
                          t.dtype, t.device)
        if spec.skip_layers is not None:
            self._build(sorted(set(spec.skip_layers)))

    def _build(self, skip: list[int]) -> None:
        """A new draft skipping ``skip``: a runner over the compact KV cache allocated at
        construction, from the factory (the fused CPU decoder over the kept layers in bf16
        on a CPU where the kernel runs, graphs on CUDA, else torch)."""
        self.skip_layers = skip
        model = SkipModel(self.target.model, set(skip))
        e = self.ctx.engine
        if self.kv.data.shape[0] != len(model.kept):  # another count than declared (calibration keeps it)
            t = self.target
            self.kv = KVCache(len(model.kept), self.ctx.num_kv_blocks, e.block_size, t.arch.num_kv_heads,
                              t.arch.head_dim, t.dtype, t.device)
        self.inner = DraftModelProposer(
            skip_loaded(self.target, model), self.num_spec_tokens, self.ctx.num_kv_blocks, e.block_size,
            runners=self.runners, max_num_seqs=e.max_num_seqs, max_step_tokens=e.max_num_batched_tokens, kv=self.kv,
            tree=self.tree,
        )

    @property
    def fused(self) -> Any:
        """The draft's fused CPU decoder (None: the draft runs torch, or no draft yet)."""
        return self.inner.runner.fused if self.inner is not None else None

    def _calibrate_if_ready(self, requests: list[DraftRequest]) -> None:
        for r in requests:
            rid = r.seq.request_id
            if rid not in self._pending and len(self._pending) < MAX_CALIBRATION_REQUESTS:
                self._pending[rid] = list(r.seq.token_ids[: r.seq.num_prompt_tokens])
        if sum(len(t) for t in self._pending.values()) < self.calibration_tokens and len(self._pending) < 8:
            return
        budget, seqs = self.calibration_tokens, []
        for toks in self._pending.values():  # the first requests' prompts, up to the budget
            if budget <= 1:
                break
            part = toks[: max(budget, 2)]
            if len(part) >= 2:
                seqs.append(part)
                budget -= len(part)
        t0 = time.perf_counter()
        skip, agreement = calibrate(self.target, seqs, self.num_skip, runners=self.runners)
        self.agreement = agreement
        log.info(
            "layer_skip: calibrated on %d tokens of %d requests in %.1f s: skipping %d of %d layers %s; the "
            "draft's top-1 agreement with the full model on them: %.1f%%", sum(len(s) for s in seqs), len(seqs),
            time.perf_counter() - t0, len(skip), self.target.arch.num_layers, skip, 100 * agreement,
        )
        self._pending.clear()
        self._build(skip)

    def propose(self, requests: list[DraftRequest], step: Any = None) -> Proposal:
        if self.inner is None:
            self._calibrate_if_ready(requests)
            if self.inner is None:
                return Proposal(token_ids=[[] for _ in requests])
        return self.inner.propose(requests, step)

    def on_verified(self, seq, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        if self.inner is not None:
            self.inner.on_verified(seq, num_tokens_before, num_drafts, num_accepted)

    def remove(self, request_id: str) -> None:
        if self.inner is not None:
            self.inner.remove(request_id)

    @property
    def blocks(self) -> BlockManager | None:
        return self.inner.blocks if self.inner is not None else None


def check_skip_layers(skip: Any, num_layers: int) -> None:
    if not isinstance(skip, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in skip):
        raise ConfigError("method.skip_layers", f"must be a list of layer ids, got {skip!r}")
    bad = [i for i in skip if not 0 <= i < num_layers]
    if bad:
        raise ConfigError("method.skip_layers", f"layer ids must be in [0, {num_layers}); got {bad}")
    if len(set(skip)) >= num_layers:
        raise ConfigError("method.skip_layers", f"skips all {num_layers} layers of the target; keep at least one")
    if not skip:
        raise ConfigError("method.skip_layers", "is empty: the draft would be the target itself; skip some layers "
                                                "or leave it unset to calibrate")


def calibration_bytes(a, tokens: int, dtype_bytes: int) -> int:
    """Calibration's temporaries: its scratch cache of all layers over at most ``tokens``
    prompt tokens of at most MAX_CALIBRATION_REQUESTS requests (of 2 tokens or more;
    one partial block each, plus the trash block), and a forward of them with the
    logits of every position."""
    n = min(MAX_CALIBRATION_REQUESTS, max(tokens // 2, 1))
    blocks = -(-(tokens + (CALIBRATION_BLOCK - 1) * n) // CALIBRATION_BLOCK) + 1
    scratch = blocks * kv_bytes_per_block(a.num_layers, CALIBRATION_BLOCK, a.num_kv_heads, a.head_dim, dtype_bytes)
    return scratch + step_activation_bytes(a, tokens, tokens, dtype_bytes)


def memory(spec: LayerSkipOptions, target: TargetShape, engine, draft) -> MemoryNeeds:
    """The compact cache and the draft's runner (the target's kept layers: no weights of
    its own), and calibration's temporaries when the layers are to be chosen."""
    L = target.arch.num_layers
    skip = len(set(spec.skip_layers)) if spec.skip_layers is not None else round(spec.skip_ratio * L)
    kept = dataclasses.replace(target.arch, num_layers=min(max(L - skip, 1), L))
    needs = runner_needs(kept, target.dtype_bytes, target.max_model_len, engine, spec.num_speculative_tokens, target)
    if spec.skip_layers is None:
        calib = calibration_bytes(target.arch, spec.skip_calibration_tokens, target.dtype_bytes)
        needs = dataclasses.replace(needs, transient_bytes=needs.transient_bytes + calib)
    return needs


def build(spec: LayerSkipOptions, ctx: ProposerContext) -> LayerSkipProposer:
    return LayerSkipProposer(spec, ctx)
