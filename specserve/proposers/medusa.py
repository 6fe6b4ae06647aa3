"""Medusa (``+method=medusa method.model=<dir>``): heads over the target's last hidden
state, all K drafts of a round from that one state.

The target's LM head on the final-normed hidden state ``h`` of position p gives token
p + 1 (the token just committed); Medusa head k (0-based) gives token p + 2 + k::

    x = h;  for each of the head's num_layers blocks:  x = x + SiLU(W x + b)
    logits_k = lm_head_k(x) * logit_scale

Drafts are a chain: d_1 from head 0, ..., d_K from head K - 1, each the head's argmax,
or a sample from q = the head's distribution under the request's sampling settings
under probabilistic verification (``heads.HeadSampler``).  No KV cache and nothing
kept between rounds: a round runs K heads over the batch's hidden states
(num_layers + 1 matmuls each).  K <= the number of heads.

Trees (``method.tree``, ``depth`` <= the number of heads): every head reads the same
state, so a tree costs no more head forwards than a chain of ``depth`` drafts.  Head d's
``topk`` best tokens are the candidates at depth d + 1; the tree grows EAGLE-2 style
(``heads.TreeLevels``: each level's ``topk`` best nodes by cumulative log-probability
get head d's candidates as children, the same tokens under every parent) and keeps the
``num_draft_tokens - 1`` best nodes, parents first (``heads.choose_nodes``).  Tree nodes
are the heads' top-k whatever the verification (no q: trees are verified target-only);
a request that needs a chain (``DraftRequest.tree`` false) drafts one of at most
min(K, heads) tokens.

Checkpoints (a directory with ``config.json``), in either published layout:

* Medusa repo (FasterDecoding/Medusa): ``medusa_num_heads``, ``medusa_num_layers``;
  tensors ``medusa_head.{k}.{l}.linear.weight [H, H]`` and ``.bias [H]`` for
  l < num_layers, and ``medusa_head.{k}.{num_layers}.weight [V, H]`` (the LM head),
  in ``model.safetensors`` (or a sharded index, or ``pytorch_model*.bin``) of a whole
  model, or in ``medusa_lm_head.safetensors`` / ``medusa_lm_head.pt`` without the
  ``medusa_head.`` prefix.  (Its heads repeat one ResBlock object num_layers times: the
  state dict holds a copy under each index, which is what is read.)
* vLLM (``MedusaConfig``): ``num_heads``, ``num_hidden_layers``, ``hidden_size``,
  ``vocab_size``; tensors ``blocks.{k}.layers.{l}.weight`` (with ``.bias`` when
  ``medusa_fc_bias`` is set or the checkpoint holds them) and ``lm_heads.{k}.weight``,
  optionally prefixed ``medusa_heads.``; ``original_lm_head: true`` shares
  ``lm_heads.0.weight`` between the heads; ``truncated_vocab_size`` below
  ``vocab_size`` with a ``token_map`` tensor (the target id of each head row) drafts
  over that part of the vocabulary; ``logit_scale`` scales the logits.

Either config spelling is read with either tensor layout.  ``hidden_size`` and
``vocab_size``, where given, must be the target's; the tensors are checked against
the target in any case.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
from dataclasses import dataclass
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

_MEDUSA_KEY = re.compile(r"^(\d+)\.(\d+)\.")  # Medusa repo, prefix stripped: {k}.{l}.linear.* / {k}.{L}.weight
_HEAD_PREFIXES = ("medusa_head.", "medusa_heads.", "blocks.", "lm_heads.")


@dataclass(frozen=True)
class MedusaConfig:
    """What ``config.json`` says (either spelling), checked against the target."""

    num_heads: int
    num_layers: int  # residual blocks per head (0: the LM head alone)
    head_vocab: int  # rows of each LM head: truncated_vocab_size, else the target's vocabulary
    shared_lm_head: bool  # vLLM's original_lm_head: one LM head for every head
    fc_bias: bool  # vLLM's medusa_fc_bias
    logit_scale: float


def _int_key(cfg: dict, names: tuple[str, ...], where: str, key: str, least: int) -> int:
    for name in names:
        if name in cfg:
            value = cfg[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(key, f"{where}: {name} must be an integer >= {least}, got {value!r}")
            return value
    spelled = " or ".join(repr(n) for n in names)
    raise ConfigError(key, f"{where} lacks {spelled}: not a Medusa checkpoint")


def read_config(d: Path, key: str, target_hidden: int, target_vocab: int) -> MedusaConfig:
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{key}: {d} has no config.json (a Medusa heads directory is expected)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise ModelLoadError(f"{key}: {cfg_file} is not JSON: {e}") from None
    where = f"{d}/config.json"
    heads = _int_key(cfg, ("medusa_num_heads", "num_heads"), where, key, 1)
    layers = _int_key(cfg, ("medusa_num_layers", "num_hidden_layers"), where, key, 0)
    hidden = cfg.get("hidden_size")
    if hidden is not None and hidden != target_hidden:
        raise ConfigError(key, f"the Medusa heads' hidden_size {hidden} differs from the target's hidden size "
                               f"{target_hidden}")
    vocab = cfg.get("vocab_size")
    if vocab is not None and vocab != target_vocab:
        raise ConfigError(key, f"the Medusa heads' vocab_size {vocab} differs from the target's {target_vocab}")
    head_vocab = cfg.get("truncated_vocab_size") or target_vocab
    if isinstance(head_vocab, bool) or not isinstance(head_vocab, int) or not 0 < head_vocab <= target_vocab:
        raise ConfigError(key, f"{where}: truncated_vocab_size must be an integer in 1..{target_vocab} (the "
                               f"target's vocabulary), got {head_vocab!r}")
    scale = cfg.get("logit_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ConfigError(key, f"{where}: logit_scale must be a number, got {scale!r}")
    return MedusaConfig(heads, layers, head_vocab, bool(cfg.get("original_lm_head", False)),
                        bool(cfg.get("medusa_fc_bias", False)), float(scale))


class MedusaHeads(nn.Module):
    """``num_heads`` heads: ``blocks[k]`` (residual blocks) then ``lm_heads[k]`` (one
    LM head for all when shared)."""

    def __init__(self, hidden: int, c: MedusaConfig, bias: bool):
        super().__init__()
        self.num_heads = c.num_heads
        self.logit_scale = c.logit_scale
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(c.num_layers))
            for _ in range(c.num_heads)
        )
        self.lm_heads = nn.ModuleList(
            nn.Linear(hidden, c.head_vocab, bias=False) for _ in range(1 if c.shared_lm_head else c.num_heads)
        )

    def forward(self, k: int, hidden: Tensor) -> Tensor:
        """Head k's logits (B, head_vocab) float32 from final-normed hidden states (B, H)."""
        x = hidden
        for layer in self.blocks[k]:
            x = x + F.silu(layer(x))
        logits = self.lm_heads[k if len(self.lm_heads) > 1 else 0](x).float()
        return logits * self.logit_scale if self.logit_scale != 1.0 else logits


def _wanted(name: str) -> bool:
    return name.startswith(_HEAD_PREFIXES) or name == "token_map" or _MEDUSA_KEY.match(name) is not None


def read_checkpoint(d: Path, key: str) -> dict[str, Tensor]:
    """The head tensors of ``d``, from whichever file of the two layouts holds them."""
    if (d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file():
        return read_tensors(d, _wanted)
    if (d / "medusa_lm_head.safetensors").is_file():
        from safetensors.torch import load_file

        return {k: v for k, v in load_file(str(d / "medusa_lm_head.safetensors")).items() if _wanted(k)}
    files = sorted(d.glob("pytorch_model*.bin")) or sorted(d.glob("medusa_lm_head.pt"))
    if not files:
        raise ModelLoadError(f"{key}: {d} holds no Medusa weights (model.safetensors, medusa_lm_head.safetensors, "
                             "pytorch_model*.bin or medusa_lm_head.pt)")
    sd: dict[str, Tensor] = {}
    for f in files:
        try:
            part = torch.load(f, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError) as e:
            raise ModelLoadError(f"{key}: {f} is not a plain state dict of tensors "
                                 f"({str(e).splitlines()[0]})") from None
        sd.update({k: v for k, v in part.items() if isinstance(k, str) and _wanted(k)})
    return sd


def _layout_names(sd: dict[str, Tensor], key: str, d: Path) -> tuple[str, Any, Any, Any]:
    """(layout, block weight name(k, l), block bias name(k, l), LM head name(k, L)) in the
    checkpoint's own spelling."""
    if any(n.startswith(("blocks.", "lm_heads.", "medusa_heads.")) for n in sd):
        p = "medusa_heads." if any(n.startswith("medusa_heads.") for n in sd) else ""
        return ("vllm", lambda k, l: f"{p}blocks.{k}.layers.{l}.weight", lambda k, l: f"{p}blocks.{k}.layers.{l}.bias",
                lambda k, L: f"{p}lm_heads.{k}.weight")
    if any(n.startswith("medusa_head.") or _MEDUSA_KEY.match(n) for n in sd):
        p = "medusa_head." if any(n.startswith("medusa_head.") for n in sd) else ""
        return ("medusa", lambda k, l: f"{p}{k}.{l}.linear.weight", lambda k, l: f"{p}{k}.{l}.linear.bias",
                lambda k, L: f"{p}{k}.{L}.weight")
    raise ModelLoadError(f"{key}: {d} holds no Medusa head tensors (medusa_head.{{k}}.* or blocks.{{k}}.* / "
                         "lm_heads.{k}.*)")


def load_medusa(path: str, key: str, target_hidden: int, target_vocab: int) -> tuple[MedusaHeads, Tensor | None]:
    """The heads in ``path`` and, when they draft over part of the vocabulary, the target
    id of each LM head row (``token_map``), else None."""
    d = Path(path).expanduser()
    c = read_config(d, key, target_hidden, target_vocab)
    sd = read_checkpoint(d, key)
    layout, w_name, b_name, head_name = _layout_names(sd, key, d)
    L = c.num_layers
    bias = layout == "medusa" or c.fc_bias or (L > 0 and b_name(0, 0) in sd)

    def take(name: str) -> Tensor:
        if name not in sd:
            raise ModelLoadError(f"{key}: the Medusa checkpoint lacks {name!r} (config.json: {c.num_heads} heads of "
                                 f"{L} layers)")
        return sd[name]

    token_map = None
    if c.head_vocab < target_vocab:
        name = next((n for n in ("token_map", "medusa_heads.token_map") if n in sd), "token_map")
        token_map = take(name).to(torch.int64).flatten()
        if token_map.numel() != c.head_vocab or int(token_map.min()) < 0 or int(token_map.max()) >= target_vocab:
            raise ConfigError(key, f"token_map must hold {c.head_vocab} target ids (truncated_vocab_size) in "
                                   f"0..{target_vocab - 1}")
    shared = c.shared_lm_head and layout == "vllm"
    if c.shared_lm_head and not shared:
        raise ConfigError(key, "original_lm_head is a vLLM-layout key (lm_heads.0.weight); this checkpoint has "
                               "the Medusa repo's layout")
    weights: dict[str, Tensor] = {}
    for k in range(c.num_heads):
        for l in range(L):
            w = take(w_name(k, l))
            if w.dim() != 2 or w.shape[0] != w.shape[1] or w.shape[1] != target_hidden:
                raise ConfigError(key, f"the Medusa heads' hidden size ({w_name(k, l)} is {list(w.shape)}) differs "
                                       f"from the target's hidden size {target_hidden}")
            weights[f"blocks.{k}.{l}.weight"] = w
            if bias:
                weights[f"blocks.{k}.{l}.bias"] = take(b_name(k, l))
        if k == 0 or not shared:
            lm = take(head_name(k, L))
            if lm.dim() == 2 and token_map is not None and lm.shape[0] == target_vocab:
                lm = lm[token_map]  # a full LM head stored with a token map: its rows for the mapped ids
            if lm.dim() != 2 or lm.shape[1] != target_hidden:
                raise ConfigError(key, f"the Medusa heads' hidden size ({head_name(k, L)} is {list(lm.shape)}) "
                                       f"differs from the target's hidden size {target_hidden}")
            if lm.shape[0] != c.head_vocab:
                raise ConfigError(key, f"the Medusa LM head {head_name(k, L)} has {lm.shape[0]} rows; the target's "
                                       f"vocabulary has {target_vocab}" +
                                       (f" (truncated_vocab_size {c.head_vocab})" if token_map is not None else ""))
            weights[f"lm_heads.{k}.weight"] = lm
    model = MedusaHeads(target_hidden, c, bias)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{key}: Medusa tensor shapes do not match: {str(e).splitlines()[-1].strip()}") from None
    return model, token_map


class MedusaProposer:
    def __init__(self, model: MedusaHeads, token_map: Tensor | None, target: Any, num_spec_tokens: int,
                 probabilistic: bool, tree: TreeConfig | None = None):
        self.model = model.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.num_spec_tokens = num_spec_tokens  # K: the most drafts (a tree: nodes) per request and step
        self.tree = tree.expanded() if tree is not None and tree.enabled else None  # method.tree, else chains only
        self.device = target.device
        self.dtype = target.dtype
        self.aux_layer_ids = (target.arch.num_layers,)  # final-normed hidden state of every row
        d2t = token_map.to(target.device) if token_map is not None else None
        self.sampler = HeadSampler(probabilistic, target.arch.vocab_size, target.device, draft_to_target=d2t)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], step: Any = None) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, r in enumerate(requests) if r.max_drafts > 0 and r.hidden_rows and step is not None]
        if not active:
            return Proposal(token_ids=drafts)
        feats = step.aux[self.aux_layer_ids[0]]  # (T, H)
        last = torch.tensor([requests[i].hidden_rows[-1] for i in active], dtype=torch.int64, device=feats.device)
        hidden = feats.index_select(0, last).to(device=self.device, dtype=self.dtype)  # (B, H): one state per request
        trees = [n for n, i in enumerate(active) if self.tree is not None and requests[i].tree]
        if not trees:
            return self._chains(requests, active, hidden, drafts)
        chains = sorted(set(range(len(active))) - set(trees))
        prop = Proposal(token_ids=drafts)
        if chains:
            prop = self._chains(requests, [active[n] for n in chains], hidden[chains], drafts)
        prop.parents = [None] * len(requests)
        self._trees(requests, [active[n] for n in trees], hidden[trees], drafts, prop.parents)
        return prop

    def _chains(self, requests: list[DraftRequest], active: list[int], hidden: Tensor,
                drafts: list[list[int]]) -> Proposal:
        """Head k's draft (argmax, or drawn from q) at column k; at most one per head."""
        want = [min(self.num_spec_tokens, self.model.num_heads, requests[i].max_drafts) for i in active]
        out = DraftColumns.of(self.sampler, requests, active, want)
        rows = list(range(len(active)))  # positions in `active` still drafting
        for k in range(max(want)):
            rows, (hidden,) = narrow(rows, want, k, hidden)
            out.draw(self.model(k, hidden), rows, k)
        return out.proposal(drafts)

    def _trees(self, requests: list[DraftRequest], active: list[int], hidden: Tensor, drafts: list[list[int]],
               parents: list[list[int] | None]) -> None:
        """EAGLE-2 dynamic trees from the heads' top-k: head d's candidates (B, topk) are
        the children of every frontier node at depth d, so nothing is run per node."""
        k = self.tree.topk
        want = [min(self.num_spec_tokens, requests[i].max_drafts) for i in active]
        depth = round_depth(self.tree, want, [requests[i] for i in active])  # <= the heads (build checks it)
        tree = tree_levels(self.tree, torch.log_softmax(self.model(0, hidden), dim=-1))
        for d in range(1, depth):
            if d > 1:
                tree.advance()  # the next frontier: the newest level's k best nodes
            lp, tok = torch.log_softmax(self.model(d, hidden), dim=-1).topk(k, dim=-1)  # (B, k)
            tree.grow(lp.repeat_interleave(k, dim=0), tok.repeat_interleave(k, dim=0))  # the same under each parent
        score, tok, parent = tree.pool()
        d2t = self.sampler.draft_to_target
        choose_nodes(list(zip(active, want)), score, tok if d2t is None else d2t[tok], parent, drafts, parents)

    def on_verified(self, seq, num_tokens_before: int, num_drafts: int, num_accepted: int) -> None:
        pass  # stateless between rounds

    def remove(self, request_id: str) -> None:
        pass  # nothing per request


def memory(spec: SpeculativeConfig, target: TargetShape, engine, draft) -> MemoryNeeds:
    """The heads' weights from config.json (block biases counted always: an upper bound by
    num_heads x num_layers x H elements), and one head's logits per draft position (with
    sampling and q when probabilistic)."""
    path = spec.model or (draft.path if draft is not None else None)
    if not path:
        return MemoryNeeds()  # the builder says what is wrong
    H, V = target.arch.hidden_size, target.arch.vocab_size
    try:
        c = read_config(Path(path).expanduser(), "method.model", H, V)
    except (ConfigError, ModelLoadError):
        return MemoryNeeds()
    dt, B, k = target.dtype_bytes, engine.max_num_seqs, spec.num_speculative_tokens
    lm_heads = 1 if c.shared_lm_head else c.num_heads
    params = c.num_heads * c.num_layers * (H * H + H) + lm_heads * c.head_vocab * H
    probabilistic = spec.samples_drafts
    step = B * c.head_vocab * (4 + dt) + (VERIFY_BYTES_PER_LOGIT * B * V if probabilistic else 0)
    return MemoryNeeds(weight_bytes=params * dt, transient_bytes=step,
                       draft_probs_bytes=B * k * V * 4 if probabilistic else 0, aux_layers=1)


def build(spec: SpeculativeConfig, ctx: ProposerContext) -> MedusaProposer:
    path = spec.model or (ctx.draft_model.path if ctx.draft_model is not None else None)
    key = "method.model" if spec.model else "draft.path"
    target = ctx.target
    model, token_map = load_medusa(path, key, target.arch.hidden_size, target.arch.vocab_size)
    tree = spec.tree.expanded() if spec.tree is not None and spec.tree.enabled else None  # a static tree's shape
    if tree is not None and tree.depth > model.num_heads:
        raise ConfigError("method.tree.depth", f"{tree.depth} exceeds the Medusa checkpoint's {model.num_heads} "
                                               f"heads (head d drafts depth d + 1); use depth <= {model.num_heads}")
    if tree is None and spec.num_speculative_tokens > model.num_heads:
        raise ConfigError(
            "method.num_speculative_tokens",
            f"{spec.num_speculative_tokens} exceeds the Medusa checkpoint's {model.num_heads} heads; use K <= "
            f"{model.num_heads}",
        )
    log.info("medusa: %d heads of %d blocks, K=%d%s", model.num_heads, len(model.blocks[0]),
             spec.num_speculative_tokens, f", {len(token_map)}-token draft vocabulary" if token_map is not None else "")
    return MedusaProposer(model, token_map, target, spec.num_speculative_tokens,
                          spec.samples_drafts, tree)
