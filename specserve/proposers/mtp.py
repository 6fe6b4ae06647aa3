"""MTP (``+method=mtp``): drafts from the multi-token-prediction layers stored inside
the target's own checkpoint; no separate draft model.

Layouts read (Llama/Qwen2/Qwen3-style targets, the families the executor serves):

* DeepSeek-V3 naming: ``model.layers.{N+k}.{enorm, hnorm, eh_proj, shared_head.norm,
  shared_head.head}`` plus an ordinary decoder layer's tensors at the same index
  (N = num_hidden_layers, k < num_nextn_predict_layers); a missing
  ``shared_head.head`` shares the target's LM head.  Step:
  ``x = block(eh_proj(cat(enorm(emb), hnorm(h))))``, logits =
  ``head(shared_head.norm(x))``, and ``x`` is the next step's ``h``.
* MiMo: ``model.mtp_layers.{k}.{token_layernorm, hidden_layernorm, input_proj,
  final_layernorm, mtp_block.*}``.  Step: ``y = final_layernorm(mtp_block(input_proj(
  cat(hidden_layernorm(h), token_layernorm(emb)))))``, logits = the target's LM head
  on ``y``, and ``y`` is the next step's ``h``.

Both embed with the target's embedding, zero the embedding at position 0 and use
the target's rotary table, as vLLM does.

Alignment (as vLLM's MTP/EAGLE proposers): the pair (target hidden h_t, next token
x_{t+1}) is the layer's input at position t.  The first hidden state is the
target's final-normed hidden state of every token row (``aux_layer_ids =
(num_layers,)``).  After each verification the proposer runs the layers over the
pairs of the positions just committed (filling their KV caches) and then drafts:
draft 1 from the last committed pair, draft s from (the layer's own output,
draft s-1) one position later.  Step s uses MTP layer min(s - 1, n - 1): K beyond
the number of MTP layers reuses the last one.  Every layer's cache is filled
at the committed positions from the same target pairs; deeper layers therefore see
depth-0 inputs there (a simplification; drafts stay lossless whatever they are).

The layers' KV caches are the proposer's own (one cache layer per MTP layer,
blocks mirroring the target's count); rollback is bookkeeping.  Positions the
target never ran (prefix-cached prompt blocks) have no hidden state; their
entries stay empty.  Drafts: argmax, or sampled from the layer's distribution
with probabilistic verification (``heads.HeadSampler``).

Trees (``method.tree``): a request that may take one (``DraftRequest.tree``) gets an
EAGLE-2 tree instead of a chain (``_draft_trees``): layer 0's ``topk`` best tokens
from the last committed pair, then ``depth - 1`` expansion steps, step s running the
chain's layer for step s over the frontier (each node's parent output and its token,
stored past the committed pairs in that layer's cache and attending to its ancestors
through tree masks), then the ``num_draft_tokens - 1`` best nodes, parents first
(``Proposal.parents``); a static tree (``method.tree.static``) fixes which nodes
expand and which of their ranked children are kept.  After a tree, the committed
rows are the root and its accepted path (``DraftRequest.hidden_rows``, a list).

Every forward runs eagerly; on CUDA it attends through the paged kernel the target uses
(``RunnerFactory.head_attention``: no padded keys or masks when a step commits a
prompt chunk beside decode rows), elsewhere through the reference attention.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from specserve.engine.memory import VERIFY_BYTES_PER_LOGIT, kv_bytes_per_block, step_activation_bytes
from specserve.errors import ConfigError
from specserve.executor.backends.factory import RunnerFactory
from specserve.executor.batch import SeqInput, StepBatch
from specserve.executor.loader import LoadedModel
from specserve.executor.models.llama import DecoderLayer, RMSNorm
from specserve.methods import SpeculativeConfig, TreeConfig
from specserve.proposers.base import DraftRequest, MemoryNeeds, Proposal, ProposerContext, TargetShape
from specserve.proposers.heads import (DraftColumns, FrontierMasks, OwnCacheHead, choose_nodes, fuse_layer,
                                       head_attention_bytes, narrow, read_tensor_shapes, read_tensors, round_depth,
                                       step_metadata, tree_levels)

log = logging.getLogger(__name__)


class MTPLayer(nn.Module):
    def __init__(self, a: Any, index: int, layout: str, own_head: bool):
        super().__init__()
        H = a.hidden_size
        self.layout = layout  # "deepseek" or "mimo"
        self.emb_norm = RMSNorm(H, a.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, a.rms_norm_eps)
        self.proj = nn.Linear(2 * H, H, bias=False)
        self.block = DecoderLayer(a, index)  # index: its layer in the proposer's KV cache
        self.out_norm = RMSNorm(H, a.rms_norm_eps)
        self.head = nn.Linear(H, a.vocab_size, bias=False) if own_head else None

    def forward(self, emb: Tensor, h: Tensor, cos, sin, meta, kv) -> tuple[Tensor, Tensor]:
        """-> (the next step's h, what the LM head reads)."""
        e, h = self.emb_norm(emb), self.hidden_norm(h)
        x = self.proj(torch.cat([e, h] if self.layout == "deepseek" else [h, e], dim=-1))
        x = self.block(x, cos, sin, meta, kv)
        y = self.out_norm(x)
        return (x if self.layout == "deepseek" else y), y


def find_mtp_layers(hf_dir, hf_config: Any, num_layers: int, read=read_tensors) -> tuple[str, int, dict[str, Tensor]]:
    """(layout, number of MTP layers, their tensors by checkpoint name); ConfigError if none.
    ``read``: how tensors are read (``read_tensor_shapes``: meta tensors from the headers)."""
    n_cfg = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
    sd = read(hf_dir, lambda k: k.startswith("model.mtp_layers.") or _deepseek_index(k, num_layers) is not None)
    mimo = sorted({int(k.split(".")[2]) for k in sd if k.startswith("model.mtp_layers.")})
    deep = sorted({i for k in sd if (i := _deepseek_index(k, num_layers)) is not None
                   and f"model.layers.{i}.eh_proj.weight" in sd})
    if mimo:
        n = n_cfg or len(mimo)
        layout = "mimo"
        have = mimo
    elif deep:
        n = n_cfg or len(deep)
        layout = "deepseek"
        have = [i - num_layers for i in deep]
    else:
        raise ConfigError(
            "method.method",
            f"mtp needs a target with MTP layers; {hf_dir} has none (num_nextn_predict_layers={n_cfg}, no "
            f"model.mtp_layers.* and no model.layers.{num_layers}.eh_proj tensors): pick another method",
        )
    missing = [k for k in range(n) if k not in have]
    if missing:
        raise ConfigError("method.method", f"mtp: num_nextn_predict_layers={n} but MTP layer(s) {missing} "
                                           f"are missing from {hf_dir}")
    return layout, n, sd


def _deepseek_index(name: str, num_layers: int) -> int | None:
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        i = int(parts[2])
        return i if i >= num_layers else None
    return None


def build_mtp_layers(layout: str, n: int, sd: dict[str, Tensor], a: Any, num_layers: int) -> nn.ModuleList:
    layers = nn.ModuleList()
    for k in range(n):
        if layout == "mimo":
            p = f"model.mtp_layers.{k}."
            names = {"emb_norm.weight": "token_layernorm.weight", "hidden_norm.weight": "hidden_layernorm.weight",
                     "proj.weight": "input_proj.weight", "out_norm.weight": "final_layernorm.weight"}
            block_prefix, own_head = p + "mtp_block.", False
        else:
            p = f"model.layers.{num_layers + k}."
            names = {"emb_norm.weight": "enorm.weight", "hidden_norm.weight": "hnorm.weight",
                     "proj.weight": "eh_proj.weight", "out_norm.weight": "shared_head.norm.weight"}
            block_prefix, own_head = p, p + "shared_head.head.weight" in sd
            if own_head:
                names["head.weight"] = "shared_head.head.weight"
        layer = MTPLayer(a, k, layout, own_head)
        weights = {ours: sd[p + theirs] for ours, theirs in names.items() if p + theirs in sd}
        absent = [p + theirs for ours, theirs in names.items() if p + theirs not in sd]
        if absent:
            raise ConfigError("method.method", f"mtp: the checkpoint lacks {absent[0]}")
        weights.update(fuse_layer(sd, block_prefix, a, "block."))
        layer.load_state_dict(weights, strict=True)
        layers.append(layer)
    return layers


@dataclass
class _State:
    num_computed: int = 0  # positions whose pairs are in the layers' caches
    block_table: list[int] = field(default_factory=list)


class MTPProposer(OwnCacheHead):
    def __init__(self, target: LoadedModel, layers: nn.ModuleList, num_spec_tokens: int, num_blocks: int,
                 block_size: int, probabilistic: bool, tree: TreeConfig | None = None):
        self.target = target
        self.model = target.model
        self.layers = layers.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.num_spec_tokens = num_spec_tokens  # K: the most drafts per request and step
        self.device = target.device
        self.block_size = block_size
        self.aux_layer_ids = (target.arch.num_layers,)  # the final-normed hidden state of every row
        a = target.arch
        self._init_cache(len(layers), a.num_kv_heads, a.head_dim, num_blocks, block_size, target, probabilistic)
        self.window = a.sliding_window
        self.attention: str | None = None  # the paged kernel's implementation on CUDA (RunnerFactory.head_attention)
        # method.tree (a static tree as its shape): trees for the requests that may take one, else chains
        self.tree = tree.expanded() if tree is not None and tree.enabled else None

    def _logits(self, layer: MTPLayer, y: Tensor) -> Tensor:
        if layer.head is not None:
            return layer.head(y).float()
        return self.model.compute_logits(y)

    def _run(self, j: int, seqs: list[SeqInput], h: Tensor, ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        batch = StepBatch.from_inputs(seqs, self.block_size)
        meta, tok, pos = step_metadata(batch, self.block_size, self.device, self.window, self.attention)
        emb = self.model.embed_tokens(tok if ids is None else ids)
        emb = emb.masked_fill((pos == 0)[:, None], 0)
        cos, sin = self.model.rotary.tables(pos, emb.dtype)
        nxt, y = self.layers[j](emb, h, cos, sin, meta, self.kv)
        rows = torch.tensor(batch.logits_rows, dtype=torch.int64, device=self.device)
        return nxt.index_select(0, rows), y.index_select(0, rows)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], step: Any = None) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        if step is None:
            return Proposal(token_ids=drafts)
        feats = step.aux[self.aux_layer_ids[0]]
        inputs: list[SeqInput] = []
        rows: list[int] = []
        drafting: list[tuple[int, int, _State]] = []  # (request index, position of its last pair, state)
        for i, r in enumerate(requests):
            if r.hidden_rows is None or len(r.hidden_rows) == 0:
                continue
            seq = r.seq
            st = self.states.setdefault(seq.request_id, _State())
            m = len(r.hidden_rows)
            q0 = seq.num_computed - m  # position of the first row fed in the step
            st.num_computed = q0  # a gap (prefix-cached blocks) stays empty
            want = r.max_drafts if r.max_drafts > 0 and self.num_spec_tokens > 0 else 0
            # drafting writes past the pairs: a chain's want - 1 steps, a tree's expanded nodes
            ahead = self._tree_nodes_run() if want and self._drafts_tree(r) else max(want - 1, 0)
            if not self.blocks.ensure(st.block_table, q0 + m + ahead):
                want = 0
                if not self.blocks.ensure(st.block_table, q0 + m):
                    self.remove(seq.request_id)
                    continue
            toks = seq.token_ids[q0 + 1 : q0 + m + 1]  # x_{t+1} for t = q0 .. q0 + m - 1
            inputs.append(SeqInput(toks, q0, st.block_table, [m - 1] if want else []))
            rows.extend(r.hidden_rows)
            st.num_computed = q0 + m
            if want:
                drafting.append((i, q0 + m - 1, st))
        if not inputs:
            return Proposal(token_ids=drafts)
        h = feats.index_select(0, torch.tensor(rows, dtype=torch.int64, device=feats.device))
        h = h.to(device=self.device, dtype=self.target.dtype)
        for j in range(len(self.layers) - 1, -1, -1):  # every layer's cache; layer 0 last: its outputs draft
            nxt, y = self._run(j, inputs, h)
        if not drafting:
            return Proposal(token_ids=drafts)
        trees = [n for n, (i, _, _) in enumerate(drafting) if self._drafts_tree(requests[i])]
        if not trees:
            return self._draft(requests, drafting, nxt, y, drafts)
        chains = [n for n in range(len(drafting)) if n not in set(trees)]
        prop = Proposal(token_ids=drafts)
        if chains:
            prop = self._draft(requests, [drafting[n] for n in chains], nxt[chains], y[chains], drafts)
        prop.parents = [None] * len(requests)
        self._draft_trees(requests, [drafting[n] for n in trees], nxt[trees], y[trees], drafts, prop.parents)
        return prop

    # ------------------------------------------------------------ trees
    def _drafts_tree(self, r: DraftRequest) -> bool:
        return self.tree is not None and r.tree

    def _tree_nodes_run(self) -> int:
        """Nodes a tree round runs the layers over (stored past the committed pairs)."""
        t = self.tree
        return t.topk * (min(t.depth, t.num_draft_tokens - 1) - 1)

    def _draft_trees(self, requests, drafting, h: Tensor, y: Tensor, drafts: list[list[int]],
                     parents: list[list[int] | None]) -> None:
        """Trees EAGLE-2 style (``heads.tree_levels``: dynamic, or a static tree's shape):
        level 1 is MTP layer 0's ``topk`` from the last committed pair; each further step s
        runs the chain's layer for step s (min(s, n - 1)) once over the frontier, each node
        (its parent's output h, its token) stored past the committed pairs in that layer's
        cache at position last + s and attending to the committed pairs and its ancestors
        (tree masks; the window as plain decoding's), and scores its ``topk`` children.
        Then the ``max_drafts`` best nodes, parents first (``heads.choose_nodes``)."""
        k, B = self.tree.topk, len(drafting)
        want = [min(self.num_spec_tokens, requests[i].max_drafts) for i, _, _ in drafting]
        depth = round_depth(self.tree, want, [requests[i] for i, _, _ in drafting])
        tree = tree_levels(self.tree, torch.log_softmax(self._logits(self.layers[0], y), dim=-1))
        front_h = h.repeat_interleave(k, dim=0)  # (B*k, H): each frontier node's parent output
        masks = FrontierMasks(B, k, self.window)
        parent_slot = None
        for s in range(1, depth):
            stored = masks.stored
            inputs = [SeqInput([0] * k, last + 1 + stored, st.block_table, list(range(k)),
                               positions=[last + s] * k, tree_base=last + 1, tree_masks=m)
                      for (_, last, st), m in zip(drafting, masks.add(parent_slot))]
            j = min(s, len(self.layers) - 1)
            nxt, y = self._run(j, inputs, front_h, ids=tree.frontier_tokens())
            tree.grow(*torch.log_softmax(self._logits(self.layers[j], y), dim=-1).topk(k, dim=-1))  # (B*k, k)
            if s + 1 < depth:  # the next frontier, each node with its parent's output
                slot = tree.advance()
                H = nxt.shape[-1]
                front_h = nxt.view(B, k, H).gather(1, slot[..., None].expand(B, k, H)).reshape(B * k, H)
                parent_slot = slot.tolist()
        score, tok, parent = tree.pool()
        choose_nodes([(i, w) for (i, _, _), w in zip(drafting, want)], score, tok, parent, drafts, parents)

    def _draft(self, requests, drafting, h: Tensor, y: Tensor, drafts: list[list[int]]) -> Proposal:
        want = [min(self.num_spec_tokens, requests[i].max_drafts) for i, _, _ in drafting]
        out = DraftColumns.of(self.sampler, requests, [i for i, _, _ in drafting], want)
        active = list(range(len(drafting)))
        s = 1
        while True:
            logits = self._logits(self.layers[min(s - 1, len(self.layers) - 1)], y)
            tokens = out.draw(logits, active, s - 1)
            active, (tokens, h) = narrow(active, want, s, tokens, h)
            if not active:
                break
            j = min(s, len(self.layers) - 1)
            step_in = [SeqInput([0], drafting[a][1] + s, drafting[a][2].block_table, [0]) for a in active]
            h, y = self._run(j, step_in, h, ids=tokens)
            s += 1
        return out.proposal(drafts)



def memory(spec: SpeculativeConfig, target: TargetShape, engine, draft) -> MemoryNeeds:
    """The MTP layers' weights (their tensors' headers in the target's checkpoint) and
    cache (one layer each, the target's attention shape), and the temporaries of a
    round: the layers over a step's committed rows (eagerly; their attention:
    ``heads.head_attention_bytes``) and a draft step's logits (with sampling and q when
    probabilistic; a tree's step: ``topk`` frontier rows per request)."""
    if target.hf_dir is None or spec.model:
        return MemoryNeeds()  # the builder refuses method.model
    hf_dir, a, dt = Path(target.hf_dir), target.arch, target.dtype_bytes
    config = json.loads((hf_dir / "config.json").read_text())
    L = a.num_layers
    layout, n, sd = find_mtp_layers(hf_dir, SimpleNamespace(**config), L, read=read_tensor_shapes)
    if layout == "mimo":
        used = [t for name, t in sd.items() if int(name.split(".")[2]) < n]
    else:
        used = [t for name, t in sd.items() if _deepseek_index(name, L) < L + n]
    k, B = spec.num_speculative_tokens, engine.max_num_seqs
    tokens = max(engine.max_num_batched_tokens, B * (k + 1))  # rows a step may commit
    max_len = target.max_model_len + k
    rounds = (step_activation_bytes(a, tokens, B, dt) + 2 * tokens * 2 * a.hidden_size * dt
              + head_attention_bytes(target, engine, tokens, max_len, k + 1, a.num_kv_heads, a.head_dim))
    probabilistic = spec.samples_drafts
    if probabilistic:
        rounds += VERIFY_BYTES_PER_LOGIT * B * a.vocab_size
    tree = spec.tree
    if tree is not None and tree.enabled:  # a tree step: topk frontier rows per request, their log-probabilities
        shape = tree.expanded()
        rows, ahead = B * shape.topk, shape.topk * (shape.depth - 1)
        rounds = max(rounds, step_activation_bytes(a, rows, B, dt) + rows * a.vocab_size * (8 + dt)
                     + head_attention_bytes(target, engine, rows, target.max_model_len + ahead, shape.topk,
                                            a.num_kv_heads, a.head_dim))
    return MemoryNeeds(
        kv_bytes_per_block=kv_bytes_per_block(n, engine.block_size, a.num_kv_heads, a.head_dim, dt),
        weight_bytes=sum(t.numel() for t in used) * dt, transient_bytes=rounds,
        draft_probs_bytes=B * k * a.vocab_size * 4 if probabilistic else 0, aux_layers=1,
    )


def build(spec: SpeculativeConfig, ctx: ProposerContext) -> MTPProposer:
    target = ctx.target
    if spec.model:
        raise ConfigError("method.model", "mtp uses the MTP layers inside the target's checkpoint; leave it unset")
    layout, n, sd = find_mtp_layers(target.hf_dir, target.hf_config, target.arch.num_layers)
    layers = build_mtp_layers(layout, n, sd, target.arch, target.arch.num_layers)
    e = ctx.engine
    log.info("mtp: %d MTP layer(s) in the %s layout; K=%d (steps beyond %d reuse the last layer)",
             n, layout, spec.num_speculative_tokens, n)
    proposer = MTPProposer(target, layers, spec.num_speculative_tokens, ctx.num_kv_blocks, e.block_size,
                           probabilistic=spec.samples_drafts, tree=spec.tree)
    proposer.attention = RunnerFactory.from_engine(e).head_attention(target)
    return proposer
