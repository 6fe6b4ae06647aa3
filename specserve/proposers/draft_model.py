"""Draft-model proposer: a second, smaller causal LM with its own paged KV cache.

Per step the draft first catches up on the tokens it has not seen (the
pending token, plus the last accepted draft and bonus after a full
acceptance, or a whole prompt for a new request), then runs K-1 single-token
steps; all requests are batched in each draft forward.  Drafts are the
draft's argmax, so q is one-hot and both strict and probabilistic
verification stay exact.  After verification the draft's cache is rolled back
to the accepted prefix by bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specserve.engine.memory import (decoder_weight_bytes, graph_output_bytes, graph_pool_bytes, kv_bytes_per_block,
                                     rotary_bytes, runner_buffer_bytes, step_activation_bytes)
from specserve.kv_blocks import BlockManager
from specserve.errors import ConfigError
from specserve.executor.backends.factory import RunnerFactory
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel, load_model
from specserve.executor.batch import SeqInput, StepBatch
from specserve.methods import SpeculativeConfig
from specserve.proposers.base import DraftRequest, MemoryNeeds, Proposal, ProposerContext, TargetShape


@dataclass
class _DraftState:
    num_computed: int = 0  # tokens of the sequence (plus drafts) with draft K/V
    block_table: list[int] = field(default_factory=list)


class DraftModelProposer:
    """``runners``: the factory that picks the draft's backend (``executor.backends.factory``;
    None: torch, or on CUDA graphs with the attention backend chosen on the draft)."""

    aux_layer_ids: tuple[int, ...] = ()

    def __init__(
        self, draft: LoadedModel, num_spec_tokens: int, num_blocks: int, block_size: int,
        runners: RunnerFactory | None = None,
        max_num_seqs: int = 32, max_step_tokens: int = 2048, mask_token_id: int | None = None,
        kv: KVCache | None = None,
    ):
        self.num_spec_tokens = num_spec_tokens  # K: the most drafts per request and step
        # PARD (parallel drafting): the draft's mask token; all K drafts come from one
        # forward over [newest token, mask x (K-1)] (None: K sequential steps).
        self.mask_token_id = mask_token_id
        self.max_step_tokens = max(max_step_tokens, max_num_seqs)  # tokens per draft forward
        self.blocks = BlockManager(num_blocks, block_size)
        if kv is None:  # ``kv``: a cache allocated earlier from the memory budget (layer_skip's)
            kv = KVCache(draft.arch.num_layers, num_blocks, block_size, draft.arch.num_kv_heads,
                         draft.arch.head_dim, draft.dtype, draft.device)
        runners = runners if runners is not None else RunnerFactory()
        self.runner = runners.draft(draft, kv, max_num_seqs=max_num_seqs, max_num_tokens=self.max_step_tokens)
        self.states: dict[str, _DraftState] = {}

    def propose(self, requests: list[DraftRequest], step=None) -> Proposal:
        """Catch each request up on the tokens its draft cache has not seen, then draft
        greedily.  The drafter's own samples are fed back on the device: the K-step loop
        reads nothing back until the drafts are complete (one copy at the end), so on
        CUDA its steps run ahead of the device, and each step's staged positions and
        slots stay in their pinned buffer until its copy ran (``StagingBuffer``)."""
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[int] = []  # indices of requests drafting
        inputs: list[SeqInput] = []
        for i, r in enumerate(requests):
            if r.max_drafts < 1:
                continue
            st = self.states.setdefault(r.seq.request_id, _DraftState())
            toks = r.seq.token_ids
            n_total = len(toks) + r.max_drafts - 1  # cache positions this round writes
            if not self.blocks.ensure(st.block_table, n_total):
                continue  # no room: this request gets no drafts this round
            new = toks[st.num_computed :]
            inputs.append(SeqInput(new, st.num_computed, st.block_table, [len(new) - 1]))
            active.append(i)
        if not active:
            return Proposal(token_ids=drafts)
        if self.mask_token_id is not None:
            return self._propose_parallel(requests, active, inputs, drafts)
        bs = self.runner.kv.block_size
        tokens = self._catch_up(inputs)  # (B,) on the device
        columns = [(active, tokens)]
        for j, i in enumerate(active):
            st = self.states[requests[i].seq.request_id]
            st.num_computed = inputs[j].start_pos + len(inputs[j].token_ids)
        step = 1
        while True:
            keep = [n for n, i in enumerate(active) if requests[i].max_drafts > step]
            if not keep:
                break
            if len(keep) < len(active):  # a request ran out of room (max_model_len)
                tokens = tokens[torch.tensor(keep, device=tokens.device)]
                active = [active[n] for n in keep]
            seqs = []
            for i in active:
                st = self.states[requests[i].seq.request_id]
                seqs.append(SeqInput([0], st.num_computed, st.block_table, [0]))
                st.num_computed += 1
            out = self.runner.execute(StepBatch.from_inputs(seqs, bs), device_token_ids=tokens)
            tokens = out.logits.argmax(dim=-1)
            columns.append((active, tokens))
            step += 1
        host = [t.tolist() for _, t in columns]  # the loop's only device -> host reads
        for (rows, _), values in zip(columns, host):
            for i, t in zip(rows, values):
                drafts[i].append(t)
        return Proposal(token_ids=drafts)

    def _propose_parallel(self, requests, active: list[int], inputs: list[SeqInput], drafts) -> Proposal:
        """PARD: after the unseen tokens, K-1 mask tokens; the logits at the newest real
        token and at each mask are drafts 1..K, from ONE forward.  The masks' K/V lie
        past the committed tokens: the next round overwrites them (the state counts
        real tokens only)."""
        mask = self.mask_token_id
        want = [min(self.num_spec_tokens, requests[i].max_drafts) for i in active]
        seqs = []
        for s, w in zip(inputs, want):
            n = len(s.token_ids)
            seqs.append(SeqInput(s.token_ids + [mask] * (w - 1), s.start_pos, s.block_table, list(range(n - 1, n - 1 + w))))
        if sum(len(s.token_ids) for s in seqs) <= self.max_step_tokens:
            out = self.runner.forward(seqs)
            tokens = out.logits.argmax(dim=-1).tolist()
            offsets = out.row_offsets
            for j, i in enumerate(active):
                drafts[i] = tokens[offsets[j] : offsets[j] + want[j]]
        else:  # a long catch-up (a new prompt): real tokens in chunks, then the masks
            first = self._catch_up(inputs).tolist()
            rest = [(j, SeqInput([mask] * (w - 1), s.start_pos + len(s.token_ids), s.block_table, list(range(w - 1))))
                    for j, (s, w) in enumerate(zip(inputs, want)) if w > 1]
            more: dict[int, list[int]] = {}
            if rest:
                out = self.runner.forward([s for _, s in rest])
                tokens = out.logits.argmax(dim=-1).tolist()
                for n, (j, s) in enumerate(rest):
                    more[j] = tokens[out.row_offsets[n] : out.row_offsets[n] + len(s.token_ids)]
            for j, i in enumerate(active):
                drafts[i] = [first[j]] + more.get(j, [])
        for j, i in enumerate(active):
            self.states[requests[i].seq.request_id].num_computed = inputs[j].start_pos + len(inputs[j].token_ids)
        return Proposal(token_ids=drafts)

    def _catch_up(self, inputs: list[SeqInput]):
        """Run the unseen tokens (whole prompts for new requests) in forwards of at most
        ``max_step_tokens`` tokens; returns the argmax after each sequence's last token."""
        if sum(len(s.token_ids) for s in inputs) <= self.max_step_tokens:
            return self.runner.forward(inputs).logits.argmax(dim=-1)
        cap = self.max_step_tokens
        last: list = [None] * len(inputs)
        pending = [(j, s.token_ids, s.start_pos) for j, s in enumerate(inputs)]
        while pending:
            chunk, owners, budget, rest = [], [], cap, []
            for j, toks, start in pending:
                if budget <= 0:
                    rest.append((j, toks, start))
                    continue
                part = toks[:budget]
                done = len(part) == len(toks)
                chunk.append(SeqInput(part, start, inputs[j].block_table, [len(part) - 1] if done else []))
                owners.append(j if done else None)
                if not done:
                    rest.append((j, toks[len(part):], start + len(part)))
                budget -= len(part)
            out = self.runner.forward(chunk)
            argmax = out.logits.argmax(dim=-1)
            n = 0
            for j in owners:
                if j is not None:
                    last[j] = argmax[n : n + 1]
                    n += 1
            pending = rest
        return torch.cat(last)

    def on_verified(self, seq, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        st = self.states.get(seq.request_id)
        if st is None or num_drafts == 0:
            return
        # The draft cache holds the old tokens + d_1..d_{n-1}; keep the accepted prefix.
        st.num_computed = min(st.num_computed, num_tokens_before + num_accepted)
        self.blocks.trim(st.block_table, st.num_computed)

    def remove(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        if st is not None:
            self.blocks.free(st.block_table)


def runner_needs(a, dtype_bytes: int, max_len: int, engine, k: int, target: TargetShape,
                 parallel_drafting: bool = False) -> MemoryNeeds:
    """What a ``DraftModelProposer`` over a model of ``a`` (an ArchConfig) holds besides
    its weights: its KV cache per block; on CUDA its persistent step runner and the
    decode graphs (q = 1, buckets up to max_num_seqs); its largest eager step (a
    catch-up of max_step_tokens tokens; with PARD the masks' logits too)."""
    B = engine.max_num_seqs
    step_tokens = max(engine.max_num_batched_tokens, B)  # DraftModelProposer.max_step_tokens
    graphs = 0
    if target.cuda:
        graphs = runner_buffer_bytes(B, step_tokens, max_len, engine.block_size, a.num_heads, a.head_dim)
        if target.cuda_graphs:
            graphs += graph_output_bytes(B, a, dtype_bytes) + graph_pool_bytes(B, a, dtype_bytes)
    rows = min(B * k, step_tokens) if parallel_drafting else B
    return MemoryNeeds(
        kv_bytes_per_block=kv_bytes_per_block(a.num_layers, engine.block_size, a.num_kv_heads, a.head_dim, dtype_bytes),
        graph_bytes=graphs, transient_bytes=step_activation_bytes(a, step_tokens, rows, dtype_bytes),
    )


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def memory(spec: SpeculativeConfig, target: TargetShape, engine, draft) -> MemoryNeeds:
    """The draft's weights and ``runner_needs``, from its config.json (nothing loaded)."""
    path = spec.model or (draft.path if draft is not None else None)
    if not path:
        return MemoryNeeds()
    from transformers import AutoConfig

    from specserve.executor.loader import resolve_hf_dir
    from specserve.executor.models.llama import ArchConfig

    cache_dir = draft.cache_dir if draft is not None else None
    a = ArchConfig.from_hf(AutoConfig.from_pretrained(str(resolve_hf_dir(path, cache_dir)), local_files_only=True))
    dtype = draft.dtype if draft is not None else "auto"
    dt = _DTYPE_BYTES.get(dtype, target.dtype_bytes)  # auto: the target's
    max_len = spec.max_model_len or target.max_model_len
    needs = runner_needs(a, dt, max_len, engine, spec.num_speculative_tokens, target, spec.parallel_drafting)
    return replace(needs, weight_bytes=decoder_weight_bytes(a, dt) + rotary_bytes(a.head_dim, max_len))


def build(spec: SpeculativeConfig, ctx: ProposerContext) -> DraftModelProposer:
    path = spec.model or (ctx.draft_model.path if ctx.draft_model is not None else None)
    key = "method.model" if spec.model else "draft.path"
    dtype = ctx.draft_model.dtype if ctx.draft_model is not None else "auto"
    if dtype == "auto":
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[ctx.target.dtype]
    cache_dir = ctx.draft_model.cache_dir if ctx.draft_model is not None else None
    if spec.max_model_len is not None and spec.max_model_len > ctx.target.max_model_len:
        raise ConfigError(
            "method.max_model_len",
            f"{spec.max_model_len} exceeds the target's max_model_len ({ctx.target.max_model_len})",
        )
    max_len = spec.max_model_len or ctx.target.max_model_len
    tp = ctx.target.tp
    if tp is not None and (spec.draft_tensor_parallel_size or tp.size) == tp.size:  # sharded like the target
        from specserve.parallel.launch import current_group

        draft = current_group().load(path, dtype, max_len, cache_dir, key=key)
    else:  # one device (under TP: rank 0's)
        draft = load_model(path, dtype, ctx.target.device, max_len, cache_dir, key=key)
    mask = None
    if spec.parallel_drafting:
        mask = getattr(draft.hf_config, "pard_token", None)
        if mask is None:
            mask = getattr(draft.hf_config, "mask_token_id", None)
        if mask is None:
            raise ConfigError(
                "method.parallel_drafting", "needs a draft whose config.json has pard_token (the mask token id)"
            )
        if not isinstance(mask, int) or not 0 <= mask < draft.arch.vocab_size:
            raise ConfigError("method.parallel_drafting", f"the draft's pard_token {mask!r} is not a token id "
                                                          f"in [0, {draft.arch.vocab_size})")
    if draft.arch.vocab_size != ctx.target.arch.vocab_size:
        raise ConfigError(
            key,
            f"draft vocabulary size {draft.arch.vocab_size} differs from the target's {ctx.target.arch.vocab_size}; "
            "draft_model needs the same tokenizer",
        )
    return DraftModelProposer(
        draft, spec.num_speculative_tokens, ctx.num_kv_blocks, ctx.engine.block_size,
        runners=RunnerFactory.from_engine(ctx.engine, ctx.cache_dir), max_num_seqs=ctx.engine.max_num_seqs,
        max_step_tokens=ctx.engine.max_num_batched_tokens, mask_token_id=mask,
    )
