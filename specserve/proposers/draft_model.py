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

from dataclasses import dataclass, field

import torch

from specserve.config import SpeculativeConfig
from specserve.engine.kv_blocks import BlockManager
from specserve.errors import ConfigError
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import LoadedModel, load_model
from specserve.executor.runner import ModelRunner, SeqInput
from specserve.proposers.base import DraftRequest, Proposal, ProposerContext, register


@dataclass
class _DraftState:
    num_computed: int = 0  # tokens of the sequence (plus drafts) with draft K/V
    block_table: list[int] = field(default_factory=list)


class DraftModelProposer:
    def __init__(
        self, draft: LoadedModel, k: int, num_blocks: int, block_size: int, cpu_kernel: str = "torch",
        fused_max_tokens: int | None = None,
    ):
        self.k = k
        self.blocks = BlockManager(num_blocks, block_size)
        kv = KVCache(draft.arch.num_layers, num_blocks, block_size, draft.arch.num_kv_heads,
                     draft.arch.head_dim, draft.dtype, draft.device)
        self.runner = ModelRunner(draft, kv, cpu_kernel=cpu_kernel, fused_max_tokens=fused_max_tokens)
        self.states: dict[str, _DraftState] = {}

    def propose(self, requests: list[DraftRequest]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[int] = []  # indices of requests still drafting
        inputs: list[SeqInput] = []
        for i, r in enumerate(requests):
            st = self.states.setdefault(r.seq.request_id, _DraftState())
            toks = r.seq.token_ids
            n_total = len(toks) + r.max_drafts - 1  # cache positions this round writes
            if r.max_drafts < 1 or not self.blocks.ensure(st.block_table, n_total):
                continue  # no room: this request gets no drafts this step
            new = toks[st.num_computed :]
            inputs.append(SeqInput(new, st.num_computed, st.block_table, [len(new) - 1]))
            active.append(i)
        step = 0
        while active:
            out = self.runner.forward(inputs)
            next_tokens = out.logits.argmax(dim=-1).tolist()
            still, nxt_inputs = [], []
            for j, i in enumerate(active):
                r, st = requests[i], self.states[requests[i].seq.request_id]
                st.num_computed = inputs[j].start_pos + len(inputs[j].token_ids)
                drafts[i].append(next_tokens[j])
                if len(drafts[i]) < r.max_drafts:
                    still.append(i)
                    nxt_inputs.append(SeqInput([next_tokens[j]], st.num_computed, st.block_table, [0]))
            active, inputs = still, nxt_inputs
            step += 1
        return Proposal(token_ids=drafts)

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


@register("draft_model")
def _build(spec: SpeculativeConfig, ctx: ProposerContext) -> DraftModelProposer:
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
    draft = load_model(path, dtype, ctx.target.device, max_len, cache_dir, key=key)
    if spec.parallel_drafting:
        mask = getattr(draft.hf_config, "pard_token", None) or getattr(draft.hf_config, "mask_token_id", None)
        if mask is None:
            raise ConfigError(
                "method.parallel_drafting", "needs a draft whose config.json has pard_token (the mask token id)"
            )
        raise ConfigError("method.parallel_drafting", "PARD-style parallel drafting is not implemented in this build yet")
    if draft.arch.vocab_size != ctx.target.arch.vocab_size:
        raise ConfigError(
            key,
            f"draft vocabulary size {draft.arch.vocab_size} differs from the target's {ctx.target.arch.vocab_size}; "
            "draft_model needs the same tokenizer",
        )
    return DraftModelProposer(
        draft, spec.num_speculative_tokens, ctx.num_kv_blocks, ctx.engine.block_size,
        cpu_kernel=ctx.engine.cpu_kernel, fused_max_tokens=ctx.engine.cpu_fused_max_tokens,
    )
