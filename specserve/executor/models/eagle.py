"""EAGLE draft heads: one decoder layer that drafts from the target's own features.

Two kinds share one module (``EagleHead``), selected by ``HeadConfig.kind``:

* ``eagle`` (EAGLE-1/2): ``h = fc(cat(embed(token), feature))`` -> one Llama
  layer (its input RMSNorm is not applied in the published heads) -> the
  target's LM head (or the head's own).  ``feature`` is the target's final
  hidden state AFTER the final norm (what the LM head reads; EAGLE's training
  data is HF's ``hidden_states[-1]``), then the head's own output on later steps.
* ``eagle3`` (EAGLE-3): the target's low/mid/high features (the residual
  stream ENTERING three target layers) are fused by ``fc`` into one hidden
  state ``g``; the layer's q/k/v read ``cat(input_layernorm(embed(token)),
  hidden_norm(g))`` (2H wide) and its residual is ``g``; logits are
  ``lm_head(norm(out))`` over a reduced draft vocabulary, mapped to target ids
  by ``d2t`` (target_id = draft_id + d2t[draft_id]).  Later steps feed the
  layer's pre-norm output back as ``g`` (no fc).

Row alignment (both kinds): the head's row at position p reads the feature
of target position p and the embedding of token p + 1, and predicts token
p + 2.  Its K/V for position p live in one paged-cache layer indexed by the
sequence's block table, exactly like a target layer.

The pieces (``step_input``, ``HeadLayer.qkv``, ``HeadLayer.output``) are
shared by serving (paged attention, ``forward``) and training (the unrolled
training-time-test attention in ``specserve.train``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specserve.executor.attention import AttentionMetadata, write_and_attend
from specserve.executor.models.llama import RMSNorm, Rotary, apply_rotary

KINDS = ("eagle", "eagle3")


@dataclass
class HeadConfig:
    kind: str  # "eagle" (EAGLE-1/2) or "eagle3"
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's vocabulary (embedding rows; d2t maps into it)
    draft_vocab_size: int  # rows of the head's LM head (== vocab_size without a reduced vocabulary)
    target_hidden_size: int
    # eagle3: target layers whose INPUT residual stream is fused (low, mid, high);
    # eagle: (num_target_layers,), the target's final-normed hidden state.
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool = False  # eagle3: residual = hidden_norm(g) instead of g
    fc_bias: bool = False
    attention_bias: bool = False
    input_layernorm: bool = False  # eagle: apply the layer's input norm (speculators "layernorms")
    embed_norm: bool = False  # eagle: RMSNorm on the embeddings (speculators "layernorms")
    pre_head_norm: bool = False  # eagle: RMSNorm before the LM head (speculators "layernorms")
    rope_config: Any = None  # an HF config object for the rotary tables (rope_theta, scaling, head_dim)

    @property
    def fc_in(self) -> int:
        return 3 * self.target_hidden_size if self.kind == "eagle3" else 2 * self.hidden_size

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size


class HeadLayer(nn.Module):
    """The head's single decoder layer (q/k/v fused, gate/up fused, as in ``llama.DecoderLayer``)."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.c = c
        H = c.hidden_size
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        eagle3 = c.kind == "eagle3"
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps) if (eagle3 or c.input_layernorm) else None
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps) if eagle3 else None
        self.qkv_proj = nn.Linear(2 * H if eagle3 else H, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.q_size, H, bias=False)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.gate_up_proj = nn.Linear(H, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: (T, in) attention input -> rotated q (T, nh, hd), k (T, nkv, hd), v (T, nkv, hd)."""
        c = self.c
        T = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = apply_rotary(qk.reshape(T, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        return q, k, v.reshape(T, c.num_kv_heads, c.head_dim)

    def output(self, residual: Tensor, attn: Tensor) -> Tensor:
        """attn: (T, nh * hd) attention output -> the layer's output (T, H), before any final norm."""
        x = residual + self.o_proj(attn)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class EagleHead(nn.Module):
    """An EAGLE / EAGLE-3 head.  Embeddings and LM head are the target's unless the
    checkpoint brings its own (``attach_target`` wires the shared ones)."""

    def __init__(self, c: HeadConfig, max_positions: int):
        super().__init__()
        if c.kind not in KINDS:
            raise ValueError(f"kind: must be one of {', '.join(KINDS)}, got {c.kind!r}")
        self.c = c
        H = c.hidden_size
        self.embed_tokens: nn.Embedding | None = None  # own embeddings, when the checkpoint has them
        self.enorm = RMSNorm(H, c.rms_norm_eps) if c.embed_norm else None
        self.fc = nn.Linear(c.fc_in, H, bias=c.fc_bias)
        self.layer = HeadLayer(c)
        self.norm = RMSNorm(H, c.rms_norm_eps) if (c.kind == "eagle3" or c.pre_head_norm) else None
        self.lm_head: nn.Linear | None = None  # own LM head (draft vocabulary rows), when present
        # target id of each draft id (None: the draft vocabulary is the target's)
        self.register_buffer("draft_to_target", None)
        self.rotary = Rotary(c.rope_config, max_positions)
        self._target: Any = None  # the target's LlamaModel, for shared embeddings / LM head
        # The head on the fused CPU decoder (``kernels.cpu_decoder.FusedHead``), set by the
        # backend factory: a step whose metadata says ``fused`` runs its layer there, and
        # its logits come from there when it holds the LM head.
        self.fused: Any = None

    # ------------------------------------------------------------ wiring
    def attach_target(self, target_model: Any) -> None:
        """Share the target's embeddings and LM head where the head has none.

        Kept out of the module tree (a plain attribute) so state_dict, .to() and
        the optimizer never see the target's weights."""
        object.__setattr__(self, "_target", target_model)

    def embed(self, ids: Tensor) -> Tensor:
        e = self.embed_tokens(ids) if self.embed_tokens is not None else self._target.embed_tokens(ids)
        e = e.to(self.fc.weight.dtype)  # (a float32 head trained on a bf16 target)
        return self.enorm(e) if self.enorm is not None else e

    def project(self, features: Tensor) -> Tensor:
        """Target features -> the head's hidden input: eagle3 fuses (T, 3*tH) with fc;
        eagle passes the target's final hidden state through (fc runs with the embedding)."""
        return self.fc(features) if self.c.kind == "eagle3" else features

    def step_input(self, ids: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(residual, attention input) of one head step; hidden: (T, H)."""
        emb = self.embed(ids)  # (T, H)
        layer = self.layer
        if self.c.kind == "eagle3":
            if self.c.norm_before_residual:
                hidden = layer.hidden_norm(hidden)
                normed = hidden
            else:
                normed = layer.hidden_norm(hidden)
            return hidden, torch.cat([layer.input_layernorm(emb), normed], dim=-1)  # (T, H), (T, 2H)
        x = self.fc(torch.cat([emb, hidden], dim=-1))  # (T, H)
        return x, (layer.input_layernorm(x) if layer.input_layernorm is not None else x)

    # ------------------------------------------------------------ serving
    def forward(
        self, ids: Tensor, hidden: Tensor, positions: Tensor, meta: AttentionMetadata, kv: tuple[Tensor, Tensor]
    ) -> Tensor:
        """One paged step over a flattened batch: ids (T,), hidden (T, H) -> the
        layer's output (T, H) (pre-norm: what the next step feeds back)."""
        if meta.fused is not None and self.fused.eagle3 is not None:  # input and layer in one fused call
            return self.fused.eagle3_layer(ids, hidden, meta.fused).to(hidden.dtype)
        residual, x = self.step_input(ids, hidden)
        if meta.fused is not None:  # the layer in one call on the fused CPU decoder
            return self.fused(x, residual, meta.fused).to(x.dtype)
        cos, sin = self.rotary.tables(positions, x.dtype)
        q, k, v = self.layer.qkv(x, cos, sin)
        attn = write_and_attend(q, k, v, kv[0], kv[1], meta)  # (T, nh, hd)
        return self.layer.output(residual, attn.reshape(attn.shape[0], -1))

    def logits(self, out: Tensor) -> Tensor:
        """(N, H) layer outputs -> (N, draft_vocab) float32 logits."""
        if self.fused is not None and self.fused.has_logits:
            return self.fused.logits(out)
        h = self.norm(out) if self.norm is not None else out
        if self.lm_head is not None:
            return self.lm_head(h).float()
        return self._target.compute_logits(h)  # the target's LM head (full vocabulary)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]


def num_parameters(head: EagleHead) -> int:
    return sum(p.numel() for p in head.parameters())
