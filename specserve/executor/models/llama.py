"""specserve's own Llama-family transformer (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Granite).

Granite's multipliers (``attention_multiplier``, ``residual_multiplier``,
``embedding_multiplier``, ``logits_scaling``) are folded into the weights at load time
(``executor.loader.fold_granite_multipliers``), so every backend runs them unchanged;
``ArchConfig.embedding_multiplier`` stays for input embeddings given from elsewhere
(a speech projector's rows), scaled like the token embeddings they replace.

One forward runs a flattened batch of ragged sequences: prefill chunks, decode
tokens and the K+1 verification positions of many requests, all as one token
axis T.  Attention reads and writes the paged KV cache through the
``AttentionMetadata`` the runner builds.  Projections are fused (qkv, gate_up)
at load time so that a decode step is a handful of large matmuls per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specserve.executor.attention import AttentionMetadata, write_and_attend


@dataclass
class ArchConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q/k/v
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k
    sliding_window: int | None
    model_type: str
    # Granite: the token embeddings' multiplier (folded into embed_tokens at load time; rows
    # given as input embeddings are multiplied by it when they replace token embeddings).
    embedding_multiplier: float = 1.0

    @classmethod
    def from_hf(cls, c: Any) -> "ArchConfig":
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        model_type = c.model_type
        window = getattr(c, "sliding_window", None)
        if model_type in ("qwen2", "qwen3") and not getattr(c, "use_sliding_window", False):
            window = None
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=c.rms_norm_eps,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(c, "attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            model_type=model_type,
            embedding_multiplier=float(getattr(c, "embedding_multiplier", 1.0) or 1.0),
        )


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite")


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # One fused kernel (it accumulates in float32 for bf16 inputs).
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding with the rotate-half layout of HF checkpoints.

    ``inv_freq`` and the attention scaling come from transformers' rope
    initialisers so that every rope_type (default, llama3, linear, yarn, ...)
    matches the reference model exactly.
    """

    def __init__(self, hf_config: Any, max_positions: int):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
            dim = int(dim * params.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # (P, hd/2)
        self.register_buffer("cos", (freqs.cos() * scaling), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scaling), persistent=False)

    def tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(T, 1, hd) tables, built once per forward: cos repeated over both halves,
        and sin with the first half negated, so that rotate-half is a roll."""
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        cos_full = torch.cat((cos, cos), dim=-1).to(dtype)
        sin_signed = torch.cat((-sin, sin), dim=-1).to(dtype)
        return cos_full[:, None, :], sin_signed[:, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (T, heads, hd); cos/sin from ``Rotary.tables``: (T, 1, hd).

    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) = x * cos + roll(x, hd/2) * sin_signed."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class PackedLinear(nn.Module):
    """A bf16 linear whose weight is pre-packed in oneDNN's blocked layout.

    On CPUs with AMX / AVX512-BF16 the stock bf16 GEMV reads weights at about
    half the memory bandwidth; the packed layout is what torch.compile's CPU
    freezing pass uses.  Results are identical to ``F.linear`` for decode-sized
    inputs (a few rows)."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.out_features = weight.shape[0]
        self.weight_bytes = weight.numel() * weight.element_size()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class DecoderLayer(nn.Module):
    def __init__(self, a: ArchConfig, layer_id: int):
        super().__init__()
        self.a = a
        self.layer_id = layer_id
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.q_size, self.kv_size = q, kv
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.qkv_proj = nn.Linear(a.hidden_size, q + 2 * kv, bias=a.attention_bias)
        self.o_proj = nn.Linear(q, a.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, kv: Any) -> Tensor:
        a = self.a
        T = x.shape[0]
        h = self.input_layernorm(x)
        qkv = self.qkv_proj(h)  # (T, q + 2kv)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        v = v.view(T, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = qk.split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(T, a.num_heads, a.head_dim))
            k = self.k_norm(k.reshape(T, a.num_kv_heads, a.head_dim))
            qk = torch.cat([q, k], dim=1)
        else:
            qk = qk.view(T, a.num_heads + a.num_kv_heads, a.head_dim)
        # Rotate q and k heads together: one set of elementwise kernels per layer.
        qk = apply_rotary(qk, cos, sin)
        q, k = qk.split([a.num_heads, a.num_kv_heads], dim=1)
        k_cache, v_cache = kv.layer(self.layer_id)
        attn = write_and_attend(q, k, v, k_cache, v_cache, meta)  # (T, heads, hd)
        x = x + self.o_proj(attn.reshape(T, self.q_size))
        h = self.post_attention_layernorm(x)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaModel(nn.Module):
    """Decoder stack + LM head.  ``forward`` returns the final hidden states
    (pre-norm is applied) and, on request, the residual stream ENTERING the
    layers listed in ``aux_layer_ids`` (EAGLE-3 / MTP inputs); the id
    ``num_layers`` asks for the final-normed hidden state of every token (what
    the LM head reads: EAGLE-1's feature)."""

    def __init__(self, a: ArchConfig, hf_config: Any, max_positions: int):
        super().__init__()
        self.a = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = None if a.tie_word_embeddings else nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.rotary = Rotary(hf_config, max_positions)

    def forward(
        self,
        input_ids: Tensor,  # (T,) int64
        positions: Tensor,  # (T,) int64
        meta: AttentionMetadata,
        kv: Any,
        aux_layer_ids: tuple[int, ...] = (),
        input_embeds: list[tuple[int, Tensor]] | None = None,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """``input_embeds``: (first row on T, (n, H) embeddings) pairs whose rows replace
        the token embeddings of those rows (``StepBatch.input_embeds``)."""
        x = self.embed_tokens(input_ids)  # (T, H)
        if input_embeds:
            x = x.clone()
            m = self.a.embedding_multiplier
            for row, rows in input_embeds:
                src = rows.to(device=x.device, dtype=x.dtype)
                x[row : row + src.shape[0]] = src * m if m != 1.0 else src
        cos, sin = self.rotary.tables(positions, x.dtype)
        aux: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layer_ids:
                aux[i] = x
            x = layer(x, cos, sin, meta, kv)
        x = self.norm(x)
        if len(self.layers) in aux_layer_ids:
            aux[len(self.layers)] = x
        return x, aux

    def compute_logits(self, hidden: Tensor, out: Tensor | None = None) -> Tensor:
        """hidden: (N, H) -> logits (N, V) in float32; written into ``out`` (N, V) float32
        when given (a persistent buffer: no float32 temporary)."""
        if isinstance(self.lm_head, PackedLinear):
            logits = self.lm_head(hidden)
        else:
            w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, w)
        return logits.float() if out is None else out.copy_(logits)

    def prepack(self) -> None:
        """Swap every projection (and the LM head) for a PackedLinear (CPU bf16)."""
        if isinstance(self.layers[0].qkv_proj, PackedLinear):
            return  # already packed (runners of one process share a model)
        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                lin = getattr(layer, name)
                setattr(layer, name, PackedLinear(lin.weight, lin.bias))
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_head = PackedLinear(w, None)
