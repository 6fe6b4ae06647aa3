"""Draft-model proposer: a second, smaller causal LM with its own paged KV cache.

Per step the draft first catches up on the tokens it has not seen (the
pending token, plus the last accepted draft and bonus after a full
acceptance, or a whole prompt for a new request), then runs K-1 single-token
steps; all requests are batched in each draft forward.  Drafts are the
draft's argmax, so q is one-hot and both strict and probabilistic
verification stay exact.  After verification the draft's cache is rolled back
to the accepted prefix by bookkeeping.

Trees (``method.tree``): a request that may take one (``DraftRequest.tree``) gets an
EAGLE-2 tree instead of a chain (``_draft_trees``): after the catch-up, level 1 is the
draft's ``topk`` best tokens; each of ``depth - 1`` expansion steps runs the draft once
over the frontier (``heads.tree_levels``), its ``topk`` nodes stored past the committed
tokens in the draft's cache and attending to the committed tokens and their ancestors
through tree masks (``heads.FrontierMasks``), and scores their ``topk`` children; then
the ``max_drafts`` best nodes, parents first (``heads.choose_nodes``).  Tree steps run
eagerly (the chain's CUDA step path is unchanged).  After a tree the draft's cache
counts only the tokens up to the root: the accepted path's K/V is computed by the next
round's catch-up, as a new token's would be.
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
from specserve.methods import SpeculativeConfig, TreeConfig
from specserve.proposers.base import DraftRequest, MemoryNeeds, Proposal, ProposerContext, TargetShape
from specserve.proposers.heads import FrontierMasks, choose_nodes, round_depth, tree_levels


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
        kv: KVCache | None = None, tree: TreeConfig | None = None,
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
        # method.tree (a static tree as its shape): trees for the requests that may take one, else chains
        self.tree = tree.expanded() if tree is not None and tree.enabled else None
        if self.tree is not None:  # a tree step runs topk frontier rows per request
            self.max_step_tokens = max(self.max_step_tokens, max_num_seqs * self.tree.topk)
        self.window = draft.arch.sliding_window
        self.runner = runners.draft(draft, kv, max_num_seqs=max_num_seqs, max_num_tokens=self.max_step_tokens,
                                    trees=self.tree is not None)
        self.states: dict[str, _DraftState] = {}

    def propose(self, requests: list[DraftRequest], step=None) -> Proposal:
        """Trees for the requests that may take one (``_draft_trees``), chains for the rest."""
        trees = [i for i, r in enumerate(requests) if self.tree is not None and r.tree and r.max_drafts > 0]
        if not trees:
            return self._propose_chains(requests)
        chosen = set(trees)
        chains = [i for i in range(len(requests)) if i not in chosen]
        drafts: list[list[int]] = [[] for _ in requests]
        if chains:
            sub = self._propose_chains([requests[i] for i in chains])
            for i, toks in zip(chains, sub.token_ids):
                drafts[i] = toks
        parents: list[list[int] | None] = [None] * len(requests)
        self._draft_trees([requests[i] for i in trees], trees, drafts, parents)
        return Proposal(token_ids=drafts, parents=parents)

    def _propose_chains(self, requests: list[DraftRequest]) -> Proposal:
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
        return self._catch_up_logits(inputs).argmax(dim=-1)

    def _catch_up_logits(self, inputs: list[SeqInput]):
        """``_catch_up``'s forwards; (B, V) the logits after each sequence's last token."""
        if sum(len(s.token_ids) for s in inputs) <= self.max_step_tokens:
            return self.runner.forward(inputs).logits
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
            logits = self.runner.forward(chunk).logits
            n = 0
            for j in owners:
                if j is not None:
                    last[j] = logits[n : n + 1].clone()  # the runner may reuse its output buffer
                    n += 1
            pending = rest
        return torch.cat(last)

    def _tree_nodes_run(self) -> int:
        """Nodes a tree round stores past the committed tokens (the frontiers it expands)."""
        t = self.tree
        return t.topk * (min(t.depth, t.num_draft_tokens - 1) - 1)

    def _draft_trees(self, requests: list[DraftRequest], index: list[int], drafts: list[list[int]],
                     parents: list[list[int] | None]) -> None:
        """EAGLE-2 trees for ``requests`` (rows ``index`` of the proposal): catch up, take
        level 1 from the logits after the newest token, then per expansion step s run the
        draft over each tree's frontier (``topk`` nodes at rotary position len + s - 1,
        stored after the earlier frontiers from context index len on, the tree base) and
        grow their children.  A request without room for its nodes gets no drafts."""
        k = self.tree.topk
        rows, inputs, ends = [], [], []
        for n, r in enumerate(requests):
            st = self.states.setdefault(r.seq.request_id, _DraftState())
            toks = r.seq.token_ids
            if not self.blocks.ensure(st.block_table, len(toks) + self._tree_nodes_run()):
                continue
            new = toks[st.num_computed :]
            inputs.append(SeqInput(new, st.num_computed, st.block_table, [len(new) - 1]))
            rows.append(n)
            ends.append(len(toks))
        if not rows:
            return
        logits = self._catch_up_logits(inputs)
        states = [self.states[requests[n].seq.request_id] for n in rows]
        for st, end in zip(states, ends):
            st.num_computed = end
        want = [min(self.num_spec_tokens, requests[n].max_drafts) for n in rows]
        depth = round_depth(self.tree, want, [requests[n] for n in rows])
        tree = tree_levels(self.tree, torch.log_softmax(logits.float(), dim=-1))
        masks = FrontierMasks(len(rows), k, self.window)
        parent_slot = None
        bs = self.runner.kv.block_size
        for s in range(1, depth):
            stored = masks.stored
            seqs = [SeqInput([0] * k, end + stored, st.block_table, list(range(k)), positions=[end + s - 1] * k,
                             tree_base=end, tree_masks=m)
                    for st, end, m in zip(states, ends, masks.add(parent_slot))]
            out = self.runner.execute(StepBatch.from_inputs(seqs, bs), device_token_ids=tree.frontier_tokens())
            tree.grow(*torch.log_softmax(out.logits.float(), dim=-1).topk(k, dim=-1))  # (B*k, k)
            if s + 1 < depth:
                parent_slot = tree.advance().tolist()
        score, tok, parent = tree.pool()
        choose_nodes([(index[n], w) for n, w in zip(rows, want)], score, tok, parent, drafts, parents)

    def on_verified(self, seq, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        st = self.states.get(seq.request_id)
        if st is None or num_drafts == 0:
            return
        # After a chain the draft cache holds the old tokens + d_1..d_{n-1}: keep the accepted
        # prefix.  After a tree it counts the old tokens only (num_computed stops at the root:
        # the nodes past it are no path's), and the next catch-up runs the accepted path.
        st.num_computed = min(st.num_computed, num_tokens_before + num_accepted)
        self.blocks.trim(st.block_table, st.num_computed)

    def remove(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        if st is not None:
            self.blocks.free(st.block_table)


def runner_needs(a, dtype_bytes: int, max_len: int, engine, k: int, target: TargetShape,
                 parallel_drafting: bool = False, tree_width: int = 0) -> MemoryNeeds:
    """What a ``DraftModelProposer`` over a model of ``a`` (an ArchConfig) holds besides
    its weights: its KV cache per block; on CUDA its persistent step runner and the
    decode graphs (q = 1, buckets up to max_num_seqs); its largest eager step (a
    catch-up of max_step_tokens tokens; with PARD the masks' logits too; with trees of
    ``tree_width`` (topk) a frontier's logits per request, their log-probabilities too)."""
    B = engine.max_num_seqs
    step_tokens = max(engine.max_num_batched_tokens, B, B * tree_width)  # DraftModelProposer.max_step_tokens
    graphs = 0
    if target.cuda:
        graphs = runner_buffer_bytes(B, step_tokens, max_len, engine.block_size, a.num_heads, a.head_dim)
        if target.cuda_graphs:
            graphs += graph_output_bytes(B, a, dtype_bytes) + graph_pool_bytes(B, a, dtype_bytes)
    rows = min(B * k, step_tokens) if parallel_drafting else B
    if tree_width:  # a tree step's frontier rows, and their float log-probabilities beside the logits
        rows = max(rows, 2 * B * tree_width)
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
    width = spec.tree.expanded().topk if spec.tree is not None and spec.tree.enabled else 0
    needs = runner_needs(a, dt, max_len, engine, spec.num_speculative_tokens, target, spec.parallel_drafting, width)
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
        max_step_tokens=ctx.engine.max_num_batched_tokens, mask_token_id=mask, tree=spec.tree,
    )
