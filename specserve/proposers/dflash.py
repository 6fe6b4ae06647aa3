"""DFlash (``+method=dflash method.model=<dir>``): a block-diffusion drafter; ONE draft
forward denoises a block [newest token, mask x (block_size - 1)] into drafts,
conditioned on the target's features.

Checkpoint: a Qwen3-style config with ``architectures: ["DFlashDraftModel"]``,
``block_size`` and ``dflash_config: {mask_token_id, target_layer_ids}``; tensors
``fc.weight [H, n * target_H]``, ``hidden_norm.weight``, ``norm.weight`` and Qwen3
decoder layers ``layers.{i}.*`` (q/k norms); the embedding and the LM head are the
target's (so the hidden sizes must agree).  A leading ``model.`` on names is accepted.

Context: the target's residual stream after each layer of ``target_layer_ids``
(HF's ``output_hidden_states[l + 1]``, the ids DFlash's reference code uses: the
stream ENTERING layer l + 1 here; ``l + 1 = num_layers`` is the final-normed
state) of every committed position, concatenated, then ``hidden_norm(fc(.))``.
Each draft layer projects it with its own k/v projections (k norm, rotary at the
context's positions) into the proposer's paged KV cache, once per position: the
context K/V of a request grow as its tokens are committed, like a KV cache.

Block: the embeddings of [x_p, mask x (block_size - 1)] at positions p ..
p + block_size - 1 go through the draft layers; each layer's queries attend to all
of the request's context K/V and to every block position (non-causal inside the
block); ``norm`` then the target's LM head at block positions 1..K give drafts
1..K (K <= block_size - 1; one line otherwise).  The block's own K/V are never
stored.  Drafts: argmax, or sampled with q for probabilistic verification
(``heads.HeadSampler``).  Torch path (eager on CUDA too).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specserve.engine.memory import VERIFY_BYTES_PER_LOGIT, kv_bytes_per_block, rotary_bytes, step_activation_bytes
from specserve.errors import ConfigError, ModelLoadError
from specserve.executor.models.llama import ArchConfig, DecoderLayer, RMSNorm, Rotary, apply_rotary
from specserve.methods import SpeculativeConfig
from specserve.proposers.base import DraftRequest, MemoryNeeds, Proposal, ProposerContext, TargetShape
from specserve.proposers.heads import DraftColumns, OwnCacheHead, fuse_layer, read_tensor_shapes, read_tensors

log = logging.getLogger(__name__)


class DFlashLayer(DecoderLayer):
    """A Qwen3 decoder layer (q/k norms always) whose attention reads context K/V plus the block's own."""

    def __init__(self, a: ArchConfig):
        super().__init__(dataclasses.replace(a, qk_norm=True), 0)  # no layer of a KV cache: layer id unused

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """K (normed, rotated) and V of x (T, H): (T, kv_heads, hd) each."""
        a, T = self.a, x.shape[0]
        _, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        k = apply_rotary(self.k_norm(k.reshape(T, a.num_kv_heads, a.head_dim)), cos, sin)
        return k, v.reshape(T, a.num_kv_heads, a.head_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: list[tuple[Tensor, Tensor]], block: int) -> Tensor:
        """x: (B * block, H), the blocks of B requests; ctx[b]: its context (K, V)."""
        a, T = self.a, x.shape[0]
        h = self.input_layernorm(x)
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(self.q_norm(q.reshape(T, a.num_heads, a.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(k.reshape(T, a.num_kv_heads, a.head_dim)), cos, sin)
        v = v.reshape(T, a.num_kv_heads, a.head_dim)
        rep = a.num_heads // a.num_kv_heads
        outs = []
        for b, (ck, cv) in enumerate(ctx):
            s = slice(b * block, (b + 1) * block)
            kk = torch.cat([ck, k[s]]).repeat_interleave(rep, dim=1)  # (ctx + block, heads, hd)
            vv = torch.cat([cv, v[s]]).repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q[s].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1))
            outs.append(o.transpose(0, 1).reshape(block, self.q_size))
        x = x + self.o_proj(torch.cat(outs))
        h = self.post_attention_layernorm(x)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class DFlashDraft(nn.Module):
    def __init__(self, a: ArchConfig, hf_config: Any, num_features: int, target_hidden: int, max_positions: int):
        super().__init__()
        self.a = a
        self.fc = nn.Linear(num_features * target_hidden, a.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(a) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rotary = Rotary(hf_config, max_positions)


@dataclass
class DFlashCheckpoint:
    model: DFlashDraft
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]


def load_dflash(path: str, key: str, target: Any) -> DFlashCheckpoint:
    from transformers import AutoConfig

    d = Path(path).expanduser()
    if not (d / "config.json").is_file():
        raise ModelLoadError(f"{key}: {d} has no config.json (a DFlash draft directory is expected)")
    raw = json.loads((d / "config.json").read_text())
    if "DFlashDraftModel" not in (raw.get("architectures") or []) or not isinstance(raw.get("dflash_config"), dict):
        raise ConfigError(key, f"{d} is not a DFlash draft (config.json needs architectures [\"DFlashDraftModel\"] "
                               "and dflash_config)")
    dc = raw["dflash_config"]
    mask, ids, block = dc.get("mask_token_id"), dc.get("target_layer_ids"), raw.get("block_size")
    L = target.arch.num_layers
    if not isinstance(mask, int) or not 0 <= mask < target.arch.vocab_size:
        raise ConfigError(key, f"dflash_config.mask_token_id {mask!r} is not a token id of the target")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < L for i in ids):
        raise ConfigError(key, f"dflash_config.target_layer_ids {ids!r} must be layer ids in [0, {L})")
    if not isinstance(block, int) or block < 2:
        raise ConfigError(key, f"block_size {block!r} must be an integer >= 2")
    hf = AutoConfig.from_pretrained(str(d), local_files_only=True)
    a = ArchConfig.from_hf(hf)
    if a.hidden_size != target.arch.hidden_size:
        raise ConfigError(key, f"the DFlash draft's hidden size {a.hidden_size} differs from the target's "
                               f"{target.arch.hidden_size} (it uses the target's embedding and LM head)")
    sd = {k.removeprefix("model."): v for k, v in read_tensors(d, lambda k: True).items()}
    model = DFlashDraft(a, hf, len(ids), target.arch.hidden_size, target.max_model_len + block)
    weights = {"fc.weight": sd.get("fc.weight"), "hidden_norm.weight": sd.get("hidden_norm.weight"),
               "norm.weight": sd.get("norm.weight")}
    for name, t in weights.items():
        if t is None:
            raise ModelLoadError(f"{key}: the DFlash checkpoint lacks {name!r}")
    qwen3 = dataclasses.replace(a, qk_norm=True)  # DFlash layers always norm q and k
    for i in range(a.num_layers):
        weights.update(fuse_layer(sd, f"layers.{i}.", qwen3, f"layers.{i}."))
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{key}: tensor shapes do not match config.json: {str(e).splitlines()[-1].strip()}") from None
    return DFlashCheckpoint(model, block, mask, ids)


@dataclass
class _State:
    num_ctx: int = 0  # context positions whose K/V are stored
    block_table: list[int] = field(default_factory=list)


class DFlashProposer(OwnCacheHead):
    def __init__(self, ck: DFlashCheckpoint, target: Any, num_spec_tokens: int, num_blocks: int, block_size: int,
                 probabilistic: bool):
        self.draft = ck.model.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        self.target = target
        self.num_spec_tokens = num_spec_tokens  # K: the most drafts per request and step
        self.block = ck.block_size
        self.mask = ck.mask_token_id
        self.device, self.dtype = target.device, target.dtype
        # the stream after layer l = the one entering l + 1 (num_layers: final-normed)
        self.aux_layer_ids = tuple(l + 1 for l in ck.target_layer_ids)
        a = ck.model.a
        self._init_cache(a.num_layers, a.num_kv_heads, a.head_dim, num_blocks, block_size, target, probabilistic)
        self.bs = block_size

    def _slots(self, table: list[int], start: int, end: int) -> Tensor:
        pos = torch.arange(start, end)
        t = torch.tensor(table, dtype=torch.int64)[pos // self.bs]
        return (t * self.bs + pos % self.bs).to(self.device)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], step: Any = None) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        if step is None:
            return Proposal(token_ids=drafts)
        # 1. context K/V of the positions the target just ran
        rows, slots, positions = [], [], []
        drafting: list[tuple[int, _State]] = []
        for i, r in enumerate(requests):
            if r.hidden_rows is None or len(r.hidden_rows) == 0:
                continue
            seq = r.seq
            st = self.states.setdefault(seq.request_id, _State())
            m = len(r.hidden_rows)
            q0 = seq.num_computed - m  # position of the first row fed in the step
            if not self.blocks.ensure(st.block_table, q0 + m):
                self.remove(seq.request_id)
                continue
            rows.extend(r.hidden_rows)
            slots.append(self._slots(st.block_table, q0, q0 + m))
            positions.extend(range(q0, q0 + m))
            st.num_ctx = q0 + m  # a gap (prefix-cached blocks) stays zero
            if r.max_drafts > 0 and self.num_spec_tokens > 0:
                drafting.append((i, st))
        if not rows:
            return Proposal(token_ids=drafts)
        idx = torch.tensor(rows, dtype=torch.int64, device=step.aux[self.aux_layer_ids[0]].device)
        feats = torch.cat([step.aux[l].index_select(0, idx) for l in self.aux_layer_ids], dim=-1)
        d = self.draft
        ctx = d.hidden_norm(d.fc(feats.to(device=self.device, dtype=self.dtype)))
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        cos, sin = d.rotary.tables(pos, ctx.dtype)
        slot = torch.cat(slots)
        for j, layer in enumerate(d.layers):
            k, v = layer.kv(ctx, cos, sin)
            kc, vc = self.kv.layer(j)
            kc.index_copy_(0, slot, k)
            vc.index_copy_(0, slot, v)
        if not drafting:
            return Proposal(token_ids=drafts)
        return self._draft(requests, drafting, drafts)

    def _draft(self, requests, drafting, drafts) -> Proposal:
        """2. one forward over every drafting request's block."""
        d, B, n = self.draft, len(drafting), self.block
        seqs = [requests[i].seq for i, _ in drafting]
        ids, pos = [], []
        for seq, (_, st) in zip(seqs, drafting):
            p = len(seq.token_ids) - 1  # the newest token's position (= the context length)
            ids += [seq.token_ids[-1]] + [self.mask] * (n - 1)
            pos += range(p, p + n)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(pos, dtype=torch.int64, device=self.device)
        x = self.target.model.embed_tokens(ids_t)
        cos, sin = d.rotary.tables(pos_t, x.dtype)
        for j, layer in enumerate(d.layers):
            kc, vc = self.kv.layer(j)
            ctx = []
            for seq, (_, st) in zip(seqs, drafting):
                s = self._slots(st.block_table, 0, st.num_ctx)
                ctx.append((kc.index_select(0, s), vc.index_select(0, s)))
            x = layer(x, cos, sin, ctx, n)
        h = d.norm(x).view(B, n, -1)
        want = [min(self.num_spec_tokens, requests[i].max_drafts, n - 1) for i, _ in drafting]
        logits = self.target.model.compute_logits(h[:, 1:].reshape(B * (n - 1), -1)).view(B, n - 1, -1)
        out = DraftColumns.of(self.sampler, requests, [i for i, _ in drafting], want)
        for j in range(max(want)):
            live = [b for b in range(B) if want[b] > j]
            out.draw(logits[live, j], live, j)
        return out.proposal(drafts)



def memory(spec: SpeculativeConfig, target: TargetShape, engine, draft) -> MemoryNeeds:
    """The draft's weights (tensor headers) and cache (its layers), one more layer's worth
    per block for a drafting forward's context gather (every drafting request's context
    K/V of one layer: at most that layer's cache), and the temporaries of a round: the
    context projection of a step's committed rows and the block forward with the logits
    of block - 1 positions per request (with sampling and q when probabilistic)."""
    path = spec.model or (draft.path if draft is not None else None)
    d = Path(path).expanduser() if path else None
    if d is None or not (d / "config.json").is_file():
        return MemoryNeeds()  # the builder says what is wrong
    from transformers import AutoConfig

    raw = json.loads((d / "config.json").read_text())
    dc = raw.get("dflash_config") or {}
    block, features = int(raw.get("block_size") or 2), len(dc.get("target_layer_ids") or [])
    a = ArchConfig.from_hf(AutoConfig.from_pretrained(str(d), local_files_only=True))
    t, dt = target.arch, target.dtype_bytes
    k, B = spec.num_speculative_tokens, engine.max_num_seqs
    weights = sum(x.numel() for x in read_tensor_shapes(d).values()) * dt
    weights += rotary_bytes(a.head_dim, target.max_model_len + block) * dt // 4  # its tables move to the dtype too
    tokens = max(engine.max_num_batched_tokens, B * (k + 1))  # rows a step may commit
    context = tokens * (2 * features * t.hidden_size + 4 * a.hidden_size) * dt
    layer = SimpleNamespace(hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, vocab_size=t.vocab_size)
    ctx_len = target.max_model_len + block  # one request's context and block, repeated to every query head
    repeat = 2 * ctx_len * (a.num_heads + a.num_kv_heads) * a.head_dim * dt
    blocks = step_activation_bytes(layer, B * block, B * (block - 1), dt) + repeat
    probabilistic = spec.samples_drafts
    if probabilistic:
        blocks += VERIFY_BYTES_PER_LOGIT * B * t.vocab_size
    per_layer = kv_bytes_per_block(1, engine.block_size, a.num_kv_heads, a.head_dim, dt)
    return MemoryNeeds(
        kv_bytes_per_block=a.num_layers * per_layer, scratch_bytes_per_block=per_layer, weight_bytes=weights,
        transient_bytes=context + blocks, draft_probs_bytes=B * k * t.vocab_size * 4 if probabilistic else 0,
        aux_layers=features,
    )


def build(spec: SpeculativeConfig, ctx: ProposerContext) -> DFlashProposer:
    path = spec.model or (ctx.draft_model.path if ctx.draft_model is not None else None)
    key = "method.model" if spec.model else "draft.path"
    ck = load_dflash(path, key, ctx.target)
    if spec.num_speculative_tokens > ck.block_size - 1:
        raise ConfigError(
            "method.num_speculative_tokens",
            f"{spec.num_speculative_tokens} exceeds what a DFlash block of {ck.block_size} drafts "
            f"({ck.block_size - 1}); use K <= {ck.block_size - 1}",
        )
    log.info("dflash: %d draft layers, block %d, target features after layers %s, K=%d", ck.model.a.num_layers,
             ck.block_size, ck.target_layer_ids, spec.num_speculative_tokens)
    e = ctx.engine
    return DFlashProposer(ck, ctx.target, spec.num_speculative_tokens, ctx.num_kv_blocks, e.block_size,
                          spec.samples_drafts)
