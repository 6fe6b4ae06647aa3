"""IBM's MLP speculator (``+method=mlp_speculator method.model=<dir>``): n_predict small
MLP stages on the target's last hidden state; stage i drafts token i + 1.

Checkpoint (IBM fms-extras / vLLM format): ``config.json`` with ``model_type:
mlp_speculator``, ``emb_dim`` (= the target's hidden size), ``inner_dim``,
``n_predict``, ``vocab_size``, ``tie_weights``, ``scale_input``; tensors per stage i:
``emb.i.weight [V, inner]``, ``proj.i.weight`` ([inner, emb_dim] for i = 0, else
[inner, inner]), ``head.i.weight [V, inner]``, ``ln.i.weight`` / ``ln.i.bias``.
With ``tie_weights`` the stages share emb, head and ln (and proj from stage 2 on);
tensors a checkpoint stores once are read from stage 0 (proj: stage 1).

Stage i (the reference's formula)::

    s = proj_i(state) + emb_i(token) * (emb_weight / state_weight)
    state = GELU(ln_i(s));  logits_i = head_i(state)
    state_weight = 0.5 ** (0.5 / n_predict)
    emb_weight = sqrt((1 - state_weight ** 2) * (inner_dim / 2))

The first state is the target's final-normed hidden state of the last token it ran
(scaled by ``LayerNorm(no affine) / sqrt(2)`` when ``scale_input``), the first token
the token just committed after it.  ``ln`` is a LayerNorm with weight and bias (eps
1e-6); GELU is the exact (erf) one.  K must be <= n_predict.  No KV cache: each
round is n_predict small matmuls per request.  Drafts: argmax, or sampled with q for
probabilistic verification (``heads.HeadSampler``).

Trees (``method.tree``, ``depth`` <= n_predict): EAGLE-2 dynamic trees
(``heads.TreeLevels``).  Stage 0 on the request's state gives the first level (its
``topk`` best tokens); stage d runs once over the frontier (the ``topk`` best nodes of
the newest level by cumulative log-probability), each node with its own state (the
state its parent's stage produced) and token, and each node's ``topk`` best tokens join
as its children.  The ``num_draft_tokens - 1`` best nodes are kept, parents first
(``heads.choose_nodes``).  Tree nodes are the stages' top-k whatever the verification
(no q: trees are verified target-only); a request that needs a chain
(``DraftRequest.tree`` false) drafts one of at most min(K, n_predict) tokens.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specserve.engine.memory import VERIFY_BYTES_PER_LOGIT
from specserve.errors import ConfigError, ModelLoadError
from specserve.methods import SpeculativeConfig, TreeConfig
from specserve.proposers.base import DraftRequest, MemoryNeeds, Proposal, ProposerContext, TargetShape
from specserve.proposers.heads import (DraftColumns, HeadSampler, choose_nodes, narrow, read_tensors, round_depth,
                                       tree_levels)

log = logging.getLogger(__name__)

LN_EPS = 1e-6


class MLPSpeculator(nn.Module):
    def __init__(self, emb_dim: int, inner_dim: int, vocab_size: int, n_predict: int, scale_input: bool):
        super().__init__()
        self.n_predict = n_predict
        self.scale_input = scale_input
        self.emb = nn.ModuleList(nn.Embedding(vocab_size, inner_dim) for _ in range(n_predict))
        self.proj = nn.ModuleList(
            nn.Linear(emb_dim if i == 0 else inner_dim, inner_dim, bias=False) for i in range(n_predict)
        )
        self.head = nn.ModuleList(nn.Linear(inner_dim, vocab_size, bias=False) for _ in range(n_predict))
        self.ln = nn.ModuleList(nn.LayerNorm(inner_dim, eps=LN_EPS) for _ in range(n_predict))
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (inner_dim / 2))

    def first_state(self, hidden: Tensor) -> Tensor:
        if self.scale_input:
            return F.layer_norm(hidden, hidden.shape[-1:], eps=LN_EPS) / math.sqrt(2)
        return hidden

    def stage(self, i: int, state: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """-> (the next state, logits (B, V) float32)."""
        s = self.proj[i](state) + self.emb[i](tokens) * (self.emb_weight / self.state_weight)
        state = F.gelu(self.ln[i](s))
        return state, self.head[i](state).float()


def load_mlp_speculator(path: str, key: str, target_hidden: int, target_vocab: int) -> MLPSpeculator:
    d = Path(path).expanduser()
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{key}: {d} has no config.json (an MLP speculator directory is expected)")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("model_type") != "mlp_speculator":
        raise ConfigError(key, f"{d} is not an MLP speculator (config.json model_type is {cfg.get('model_type')!r}, "
                               "expected 'mlp_speculator')")
    try:
        emb_dim, inner, n, vocab = (int(cfg[k]) for k in ("emb_dim", "inner_dim", "n_predict", "vocab_size"))
    except KeyError as e:
        raise ConfigError(key, f"{d}/config.json lacks {e.args[0]!r}") from None
    inner = inner or emb_dim  # inner_dim 0 means emb_dim in IBM's code
    if emb_dim != target_hidden:
        raise ConfigError(key, f"the speculator's emb_dim {emb_dim} differs from the target's hidden size {target_hidden}")
    if vocab != target_vocab:
        raise ConfigError(key, f"the speculator's vocab_size {vocab} differs from the target's {target_vocab}")
    tie = bool(cfg.get("tie_weights", False))
    sd = read_tensors(d, lambda k: k.split(".")[0] in ("emb", "proj", "head", "ln"))
    model = MLPSpeculator(emb_dim, inner, vocab, n, bool(cfg.get("scale_input", False)))
    weights: dict[str, Tensor] = {}
    for i in range(n):
        for name in ("emb.{}.weight", "proj.{}.weight", "head.{}.weight", "ln.{}.weight", "ln.{}.bias"):
            k = name.format(i)
            if k not in sd and tie:  # tied stages: emb/head/ln as stage 0, proj as stage 1
                k = name.format(1 if name.startswith("proj") and i >= 2 else 0)
            if k not in sd:
                raise ModelLoadError(f"{key}: the speculator checkpoint lacks {name.format(i)!r}")
            weights[name.format(i)] = sd[k]
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{key}: tensor shapes do not match config.json: {str(e).splitlines()[-1].strip()}") from None
    return model


class MLPSpeculatorProposer:
    def __init__(self, model: MLPSpeculator, target: Any, num_spec_tokens: int, probabilistic: bool,
                 tree: TreeConfig | None = None):
        self.model = model.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.num_spec_tokens = num_spec_tokens  # K: the most drafts (a tree: nodes) per request and step
        self.tree = tree.expanded() if tree is not None and tree.enabled else None  # method.tree, else chains only
        self.device = target.device
        self.dtype = target.dtype
        self.aux_layer_ids = (target.arch.num_layers,)  # final-normed hidden state of every row
        self.sampler = HeadSampler(probabilistic, target.arch.vocab_size, target.device)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], step: Any = None) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, r in enumerate(requests) if r.max_drafts > 0 and r.hidden_rows and step is not None]
        if not active:
            return Proposal(token_ids=drafts)
        feats = step.aux[self.aux_layer_ids[0]]
        last = torch.tensor([requests[i].hidden_rows[-1] for i in active], dtype=torch.int64, device=feats.device)
        state = self.model.first_state(feats.index_select(0, last).to(device=self.device, dtype=self.dtype))
        tokens = torch.tensor([requests[i].seq.token_ids[-1] for i in active], dtype=torch.int64, device=self.device)
        trees = [n for n, i in enumerate(active) if self.tree is not None and requests[i].tree]
        if not trees:
            return self._chains(requests, active, state, tokens, drafts)
        chains = sorted(set(range(len(active))) - set(trees))
        prop = Proposal(token_ids=drafts)
        if chains:
            prop = self._chains(requests, [active[n] for n in chains], state[chains], tokens[chains], drafts)
        prop.parents = [None] * len(requests)
        self._trees(requests, [active[n] for n in trees], state[trees], tokens[trees], drafts, prop.parents)
        return prop

    def _chains(self, requests: list[DraftRequest], active: list[int], state: Tensor, tokens: Tensor,
                drafts: list[list[int]]) -> Proposal:
        """Stage s's draft (argmax, or drawn from q) at column s, fed to stage s + 1."""
        want = [min(self.num_spec_tokens, self.model.n_predict, requests[i].max_drafts) for i in active]
        out = DraftColumns.of(self.sampler, requests, active, want)
        rows = list(range(len(active)))  # positions in `active` still drafting
        for s in range(max(want)):
            rows, (state, tokens) = narrow(rows, want, s, state, tokens)
            state, logits = self.model.stage(s, state, tokens)
            tokens = out.draw(logits, rows, s)
        return out.proposal(drafts)

    def _trees(self, requests: list[DraftRequest], active: list[int], state: Tensor, tokens: Tensor,
               drafts: list[list[int]], parents: list[list[int] | None]) -> None:
        """EAGLE-2 dynamic trees: stage d runs over the frontier (B * topk rows), each node
        carrying the state its parent's stage left (level 1: stage 0's one state)."""
        k, B = self.tree.topk, len(active)
        want = [min(self.num_spec_tokens, requests[i].max_drafts) for i in active]
        depth = round_depth(self.tree, want, [requests[i] for i in active])  # <= n_predict (build checks it)
        state, logits = self.model.stage(0, state, tokens)
        tree = tree_levels(self.tree, torch.log_softmax(logits, dim=-1))
        front_state = state.repeat_interleave(k, dim=0)  # (B*k, inner): level 1's parent state
        for d in range(1, depth):
            state, logits = self.model.stage(d, front_state, tree.frontier_tokens())
            tree.grow(*torch.log_softmax(logits, dim=-1).topk(k, dim=-1))  # (B*k, k)
            if d + 1 < depth:  # the next frontier: the best k children, each with its parent's new state
                slot = tree.advance()
                S = state.shape[-1]
                front_state = state.view(B, k, S).gather(1, slot[..., None].expand(B, k, S)).reshape(B * k, S)
        score, tok, parent = tree.pool()
        choose_nodes(list(zip(active, want)), score, tok, parent, drafts, parents)

    def on_verified(self, seq, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        pass  # stateless between rounds

    def remove(self, request_id: str) -> None:
        pass  # nothing per request


def memory(spec: SpeculativeConfig, target: TargetShape, engine, draft) -> MemoryNeeds:
    """The stages' weights from config.json (each stage holds its own tensors, tied ones
    copied), and a stage's logits per round (a tree's stage: ``topk`` rows per request; with
    sampling and q when probabilistic)."""
    path = spec.model or (draft.path if draft is not None else None)
    cfg_file = Path(path).expanduser() / "config.json" if path else None
    if cfg_file is None or not cfg_file.is_file():
        return MemoryNeeds()  # the builder says what is wrong
    cfg = json.loads(cfg_file.read_text())
    try:
        emb, inner, n, V = (int(cfg[k]) for k in ("emb_dim", "inner_dim", "n_predict", "vocab_size"))
    except (KeyError, TypeError, ValueError):
        return MemoryNeeds()
    inner = inner or emb
    dt, B, k = target.dtype_bytes, engine.max_num_seqs, spec.num_speculative_tokens
    params = n * (2 * V * inner + 2 * inner) + emb * inner + (n - 1) * inner * inner  # emb, head, ln; proj
    probabilistic = spec.samples_drafts
    tree = spec.tree
    rows = B * tree.expanded().topk if tree is not None and tree.enabled else B  # a tree stage runs over the frontier
    step = rows * V * (4 + dt) + (VERIFY_BYTES_PER_LOGIT * B * V if probabilistic else 0)
    return MemoryNeeds(weight_bytes=params * dt, transient_bytes=step,
                       draft_probs_bytes=B * k * V * 4 if probabilistic else 0, aux_layers=1)


def build(spec: SpeculativeConfig, ctx: ProposerContext) -> MLPSpeculatorProposer:
    path = spec.model or (ctx.draft_model.path if ctx.draft_model is not None else None)
    key = "method.model" if spec.model else "draft.path"
    target = ctx.target
    model = load_mlp_speculator(path, key, target.arch.hidden_size, target.arch.vocab_size)
    tree = spec.tree.expanded() if spec.tree is not None and spec.tree.enabled else None  # a static tree's shape
    if tree is not None and tree.depth > model.n_predict:
        raise ConfigError("method.tree.depth", f"{tree.depth} exceeds the MLP speculator's n_predict "
                                               f"({model.n_predict}); use depth <= {model.n_predict}")
    if tree is None and spec.num_speculative_tokens > model.n_predict:
        raise ConfigError(
            "method.num_speculative_tokens",
            f"{spec.num_speculative_tokens} exceeds the MLP speculator's n_predict ({model.n_predict}); use K <= "
            f"{model.n_predict}",
        )
    log.info("mlp_speculator: %d stages, inner_dim %d, K=%d", model.n_predict, model.proj[0].out_features,
             spec.num_speculative_tokens)
    return MLPSpeculatorProposer(model, target, spec.num_speculative_tokens,
                                 spec.samples_drafts, tree)
