"""The Granite Speech model family: a conformer CTC encoder, a windowed Q-Former projector,
and a text model the executor serves (``executor.models.llama``, Granite's multipliers
included), in the layout of transformers' ``GraniteSpeechForConditionalGeneration``.

* ``SpeechEncoder``: ``input_linear`` (160 -> hidden), conformer blocks (macaron
  feed-forward halves, block-local self-attention over ``context_size`` frames with
  Shaw relative position embeddings, a convolution module with a depthwise kernel and
  batch norm, a post layer norm) and self-conditioned CTC at the middle block: the
  CTC head ``out`` applied there, its softmax mapped back by ``out_mid`` and added.
  The same head applied to the final states gives the CTC posteriors used as drafts.
* ``SpeechProjector``: the encoder frames cut into windows of ``window_size`` (the last
  padded with zeros), ``window_size // downsample_rate`` learned queries per window
  run through a BLIP-2 Q-Former (self-attention over the queries, cross-attention to the
  window, a feed-forward; post layer norms), then a linear map to the text model's width.
* ``SpeechModel``: both, plus ``audio_embeddings(features)`` -> (embeddings, CTC log
  posteriors) in one pass, and the greedy CTC hypothesis helpers.

The weights keep transformers' names (``encoder.layers.0.attn.to_q.weight`` ...) under
the prefixes of either checkpoint layout (``encoder.`` / ``model.encoder.``); the
text model is loaded by the executor's own loader (``executor.loader``).  CTC labels are
Unicode code points with blank 0 (granite-4.0-1b-speech's convention): a hypothesis is
text.  Batched training pads recordings with silence; serving runs one recording at a
time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _get(c: Any, key: str, default: Any = None) -> Any:
    if isinstance(c, dict):
        return c.get(key, default)
    return getattr(c, key, default)


@dataclass(frozen=True)
class EncoderConfig:
    input_dim: int = 160
    num_layers: int = 10
    hidden_dim: int = 1024
    feedforward_mult: int = 4
    num_heads: int = 8
    dim_head: int = 128
    output_dim: int = 42
    context_size: int = 200
    max_pos_emb: int = 512
    conv_kernel_size: int = 15
    conv_expansion_factor: int = 2

    @classmethod
    def from_hf(cls, c: Any) -> "EncoderConfig":
        hidden = _get(c, "hidden_dim", 1024)
        heads = _get(c, "num_heads", 8)
        return cls(
            input_dim=_get(c, "input_dim", 160), num_layers=_get(c, "num_layers", 10), hidden_dim=hidden,
            feedforward_mult=_get(c, "feedforward_mult", 4), num_heads=heads,
            dim_head=_get(c, "dim_head", None) or hidden // heads, output_dim=_get(c, "output_dim", 42),
            context_size=_get(c, "context_size", 200), max_pos_emb=_get(c, "max_pos_emb", 512),
            conv_kernel_size=_get(c, "conv_kernel_size", 15),
            conv_expansion_factor=_get(c, "conv_expansion_factor", 2),
        )


@dataclass(frozen=True)
class ProjectorConfig:
    hidden_size: int = 1024
    num_hidden_layers: int = 2
    num_attention_heads: int = 16
    intermediate_size: int = 4096
    encoder_hidden_size: int = 1024
    cross_attention_frequency: int = 1
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    window_size: int = 15
    downsample_rate: int = 5
    text_hidden_size: int = 2048

    @property
    def num_queries(self) -> int:
        return self.window_size // self.downsample_rate

    @classmethod
    def from_hf(cls, c: Any, window_size: int, downsample_rate: int, text_hidden_size: int) -> "ProjectorConfig":
        return cls(
            hidden_size=_get(c, "hidden_size", 1024), num_hidden_layers=_get(c, "num_hidden_layers", 2),
            num_attention_heads=_get(c, "num_attention_heads", 16),
            intermediate_size=_get(c, "intermediate_size", 4096),
            encoder_hidden_size=_get(c, "encoder_hidden_size", 1024),
            cross_attention_frequency=_get(c, "cross_attention_frequency", 1),
            layer_norm_eps=_get(c, "layer_norm_eps", 1e-12), hidden_act=_get(c, "hidden_act", "gelu"),
            window_size=window_size, downsample_rate=downsample_rate, text_hidden_size=text_hidden_size,
        )


# ----------------------------------------------------------------------------- encoder
class FeedForward(nn.Module):
    def __init__(self, c: EncoderConfig, dropout: float = 0.0):
        super().__init__()
        self.pre_norm = nn.LayerNorm(c.hidden_dim)
        self.up_proj = nn.Linear(c.hidden_dim, c.hidden_dim * c.feedforward_mult)
        self.down_proj = nn.Linear(c.hidden_dim * c.feedforward_mult, c.hidden_dim)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        h = F.dropout(F.silu(self.up_proj(self.pre_norm(x))), self.dropout, self.training)
        return F.dropout(self.down_proj(h), self.dropout, self.training)


class BlockAttention(nn.Module):
    """Self-attention within blocks of ``context_size`` frames, with Shaw relative
    position embeddings (a learned vector per clamped distance, dotted with the query)."""

    def __init__(self, c: EncoderConfig, dropout: float = 0.0):
        super().__init__()
        if not 0 < c.context_size <= c.max_pos_emb:
            raise ValueError(f"encoder_config.context_size: must be in (0, max_pos_emb={c.max_pos_emb}], "
                             f"got {c.context_size}")
        inner = c.num_heads * c.dim_head
        self.c = c
        self.scale = c.dim_head ** -0.5
        self.pre_norm = nn.LayerNorm(c.hidden_dim)
        self.to_q = nn.Linear(c.hidden_dim, inner, bias=False)
        self.to_kv = nn.Linear(c.hidden_dim, 2 * inner, bias=False)
        self.to_out = nn.Linear(inner, c.hidden_dim)
        self.rel_pos_emb = nn.Embedding(2 * c.max_pos_emb + 1, c.dim_head)
        self.dropout = dropout
        idx = torch.arange(c.context_size)
        dist = (idx[:, None] - idx[None, :]).clamp(-c.context_size, c.context_size) + c.max_pos_emb
        self.register_buffer("dists", dist, persistent=False)

    def _attend(self, h: Tensor) -> Tensor:
        """Attention within each length-L block of ``h`` (N, L, hidden) -> (N, L, inner)."""
        c = self.c
        N, L, _ = h.shape
        q = self.to_q(h).view(N, L, c.num_heads, c.dim_head).transpose(1, 2)  # (N, H, L, d)
        k, v = self.to_kv(h).chunk(2, dim=-1)
        k = k.reshape(N, L, c.num_heads, c.dim_head).transpose(1, 2)
        v = v.reshape(N, L, c.num_heads, c.dim_head).transpose(1, 2)
        rel = self.rel_pos_emb(self.dists[:L, :L])  # (L, L, d)
        bias = torch.einsum("bhid,ijd->bhij", q, rel) * self.scale
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale + bias
        attn = F.dropout(scores.softmax(dim=-1), self.dropout, self.training)
        return torch.matmul(attn, v).transpose(1, 2).reshape(N, L, -1)

    def forward(self, x: Tensor) -> Tensor:
        # Full blocks of context_size frames, then the last, shorter block at its own length:
        # what padding it to a full block and masking the padding computes, without the padding.
        C = self.c.context_size
        h = self.pre_norm(x)
        B, n, hidden = h.shape
        full = n // C * C
        parts = []
        if full:
            parts.append(self._attend(h[:, :full].reshape(B * (full // C), C, hidden)).reshape(B, full, -1))
        if n > full:
            parts.append(self._attend(h[:, full:]))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return F.dropout(self.to_out(out), self.dropout, self.training)


class DepthwiseConv(nn.Module):
    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.padding = (kernel // 2, kernel // 2 - (kernel + 1) % 2)
        self.conv = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, self.padding))


class ConvModule(nn.Module):
    def __init__(self, c: EncoderConfig, dropout: float = 0.0):
        super().__init__()
        inner = c.hidden_dim * c.conv_expansion_factor
        self.norm = nn.LayerNorm(c.hidden_dim)
        self.up_conv = nn.Conv1d(c.hidden_dim, 2 * inner, 1)
        self.depth_conv = DepthwiseConv(inner, c.conv_kernel_size)
        self.batch_norm = nn.BatchNorm1d(inner)
        self.down_conv = nn.Conv1d(inner, c.hidden_dim, 1)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        # the pointwise (kernel 1) convolutions are matmuls over frames (torch's 1x1 conv1d
        # takes a slow path on the CPU); only the depthwise one convolves
        h = F.glu(F.linear(self.norm(x), self.up_conv.weight[:, :, 0], self.up_conv.bias), dim=-1)
        h = F.silu(self.batch_norm(self.depth_conv(h.transpose(1, 2)))).transpose(1, 2)
        return F.dropout(F.linear(h, self.down_conv.weight[:, :, 0], self.down_conv.bias), self.dropout, self.training)


class ConformerBlock(nn.Module):
    def __init__(self, c: EncoderConfig, dropout: float = 0.0):
        super().__init__()
        self.ff1 = FeedForward(c, dropout)
        self.attn = BlockAttention(c, dropout)
        self.conv = ConvModule(c, dropout)
        self.ff2 = FeedForward(c, dropout)
        self.post_norm = nn.LayerNorm(c.hidden_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + 0.5 * self.ff1(x)
        x = x + self.attn(x)
        x = x + self.conv(x)
        x = x + 0.5 * self.ff2(x)
        return self.post_norm(x)


class SpeechEncoder(nn.Module):
    """(B, frames, 160) -> final hidden states (B, frames, hidden), and the CTC logits of
    the middle block (the self-conditioning ones, for a training loss)."""

    def __init__(self, c: EncoderConfig, dropout: float = 0.0):
        super().__init__()
        self.c = c
        self.input_linear = nn.Linear(c.input_dim, c.hidden_dim)
        self.layers = nn.ModuleList(ConformerBlock(c, dropout) for _ in range(c.num_layers))
        self.out = nn.Linear(c.hidden_dim, c.output_dim)
        self.out_mid = nn.Linear(c.output_dim, c.hidden_dim)

    def forward(self, features: Tensor) -> tuple[Tensor, Tensor | None]:
        return self.blocks(self.input_linear(features), 0, len(self.layers))

    def blocks(self, x: Tensor, lo: int, hi: int) -> tuple[Tensor, Tensor | None]:
        """Conformer blocks ``lo`` .. ``hi - 1`` over states ``x`` (the middle block's
        self-conditioning included where it falls among them) -> (states, the middle
        block's CTC logits or None)."""
        mid_logits = None
        for i in range(lo, hi):
            x = self.layers[i](x)
            if i + 1 == self.c.num_layers // 2:
                mid_logits = self.out(x)
                x = x + self.out_mid(mid_logits.softmax(dim=-1))
        return x, mid_logits

    def ctc_logits(self, hidden: Tensor) -> Tensor:
        """The CTC head on the final states (the drafts' posteriors)."""
        return self.out(hidden)


# ----------------------------------------------------------------------------- projector
class QFormerAttention(nn.Module):
    """BLIP-2 Q-Former attention (self or cross) with its output dense + post layer norm."""

    def __init__(self, p: ProjectorConfig, cross: bool):
        super().__init__()
        kv_in = p.encoder_hidden_size if cross else p.hidden_size
        self.heads = p.num_attention_heads
        self.query = nn.Linear(p.hidden_size, p.hidden_size)
        self.key = nn.Linear(kv_in, p.hidden_size)
        self.value = nn.Linear(kv_in, p.hidden_size)
        self.dense = nn.Linear(p.hidden_size, p.hidden_size)
        self.norm = nn.LayerNorm(p.hidden_size, eps=p.layer_norm_eps)

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        ctx = x if context is None else context
        N = max(x.shape[0], ctx.shape[0])
        hd = x.shape[-1] // self.heads
        q = self.query(x).view(x.shape[0], x.shape[1], self.heads, hd).transpose(1, 2)
        k = self.key(ctx).view(ctx.shape[0], ctx.shape[1], self.heads, hd).transpose(1, 2)
        v = self.value(ctx).view(ctx.shape[0], ctx.shape[1], self.heads, hd).transpose(1, 2)
        att = (torch.matmul(q, k.transpose(-1, -2)) * hd ** -0.5).softmax(dim=-1)
        o = torch.matmul(att, v).transpose(1, 2).reshape(N, x.shape[1], -1)
        return self.norm(self.dense(o) + x)


class QFormerLayer(nn.Module):
    def __init__(self, p: ProjectorConfig, index: int):
        super().__init__()
        self.attention = QFormerAttention(p, cross=False)
        self.crossattention = QFormerAttention(p, cross=True) if index % p.cross_attention_frequency == 0 else None
        self.ff_in = nn.Linear(p.hidden_size, p.intermediate_size)
        self.ff_out = nn.Linear(p.intermediate_size, p.hidden_size)
        self.ff_norm = nn.LayerNorm(p.hidden_size, eps=p.layer_norm_eps)
        self.act = p.hidden_act

    def forward(self, x: Tensor, windows: Tensor) -> Tensor:
        x = self.attention(x)
        if self.crossattention is not None:
            x = self.crossattention(x, windows)
        h = self.ff_in(x)
        h = F.gelu(h) if self.act == "gelu" else F.gelu(h, approximate="tanh") if self.act == "gelu_new" else F.silu(h)
        return self.ff_norm(self.ff_out(h) + x)


class SpeechProjector(nn.Module):
    """(B, frames, enc_hidden) -> (B, windows * queries, text_hidden)."""

    def __init__(self, p: ProjectorConfig):
        super().__init__()
        if p.hidden_act not in ("gelu", "gelu_new", "silu"):
            raise ValueError(f"projector_config.hidden_act: {p.hidden_act!r} is not supported (gelu, gelu_new, silu)")
        self.p = p
        self.query = nn.Parameter(torch.zeros(1, p.num_queries, p.hidden_size))
        self.layernorm = nn.LayerNorm(p.hidden_size, eps=p.layer_norm_eps)
        self.layers = nn.ModuleList(QFormerLayer(p, i) for i in range(p.num_hidden_layers))
        self.linear = nn.Linear(p.hidden_size, p.text_hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        B, n, d = hidden.shape
        W = self.p.window_size
        nb = math.ceil(n / W)
        windows = F.pad(hidden, (0, 0, 0, nb * W - n)).reshape(B * nb, W, d)
        x = self.layernorm(self.query)  # (1, Q, h): shared by every window
        for layer in self.layers:
            x = layer(x, windows)
        x = x.expand(B * nb, -1, -1) if x.shape[0] == 1 else x
        return self.linear(x.reshape(B, nb * self.p.num_queries, -1))


# ----------------------------------------------------------------------------- the pair
class SpeechModel(nn.Module):
    """The encoder and the projector of a Granite-Speech-shaped checkpoint."""

    def __init__(self, enc: EncoderConfig, proj: ProjectorConfig, dropout: float = 0.0):
        super().__init__()
        self.encoder = SpeechEncoder(enc, dropout)
        self.projector = SpeechProjector(proj)

    def audio_embeddings(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """(frames, 160) features of one recording -> (audio tokens, text_hidden) embeddings
        and (frames, labels) float32 CTC log posteriors, from one encoder pass."""
        hidden, _ = self.encoder(features[None])
        logp = self.encoder.ctc_logits(hidden[0]).float().log_softmax(dim=-1)
        return self.projector(hidden)[0], logp


def state_dict_from_checkpoint(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """The encoder's and projector's tensors of a Granite Speech checkpoint (either
    prefix layout), renamed to ``SpeechModel``'s names."""
    out: dict[str, Tensor] = {}
    for key, value in sd.items():
        k = key.removeprefix("model.")
        if k.startswith("encoder."):
            out[k] = value
        elif k.startswith("projector."):
            rest = k.removeprefix("projector.")
            if rest.startswith("qformer."):
                rest = _qformer_name(rest.removeprefix("qformer."))
                if rest is None:
                    continue
            out["projector." + rest] = value
    return out


def _qformer_name(k: str) -> str | None:
    """A BLIP-2 Q-Former tensor name -> the projector's (None: unused by query-only inputs)."""
    if k.startswith("layernorm."):
        return k
    if not k.startswith("encoder.layer."):
        return None  # embeddings of the text branch, absent from query-only checkpoints
    parts = k.split(".")
    i, rest = parts[2], ".".join(parts[3:])
    table = {
        "attention.attention.": "attention.", "attention.output.dense.": "attention.dense.",
        "attention.output.LayerNorm.": "attention.norm.", "crossattention.attention.": "crossattention.",
        "crossattention.output.dense.": "crossattention.dense.",
        "crossattention.output.LayerNorm.": "crossattention.norm.", "intermediate_query.dense.": "ff_in.",
        "output_query.dense.": "ff_out.", "output_query.LayerNorm.": "ff_norm.",
    }
    for src, dst in table.items():
        if rest.startswith(src):
            return f"layers.{i}.{dst}{rest.removeprefix(src)}"
    return None  # the text branch's feed-forward (intermediate / output), unused


def checkpoint_state_dict(model: SpeechModel, prefix: str = "") -> dict[str, Tensor]:
    """``model``'s tensors under transformers' names (the inverse of
    ``state_dict_from_checkpoint``), ``prefix`` in front (``"model."`` for the current layout)."""
    inverse = {
        "attention.dense.": "attention.output.dense.", "attention.norm.": "attention.output.LayerNorm.",
        "crossattention.dense.": "crossattention.output.dense.",
        "crossattention.norm.": "crossattention.output.LayerNorm.", "attention.": "attention.attention.",
        "crossattention.": "crossattention.attention.", "ff_in.": "intermediate_query.dense.",
        "ff_out.": "output_query.dense.", "ff_norm.": "output_query.LayerNorm.",
    }
    out: dict[str, Tensor] = {}
    for k, v in model.state_dict().items():
        if k.startswith("projector.layers."):
            parts = k.split(".")
            i, rest = parts[2], ".".join(parts[3:])
            for src, dst in inverse.items():  # longest names first: dense/norm before their parent
                if rest.startswith(src):
                    k = f"projector.qformer.encoder.layer.{i}.{dst}{rest.removeprefix(src)}"
                    break
        elif k.startswith("projector.layernorm."):
            k = "projector.qformer." + k.removeprefix("projector.")
        out[prefix + k] = v.detach().contiguous()
    return out


# ----------------------------------------------------------------------------- CTC helpers
def ctc_greedy_labels(logp: Tensor, blank: int = 0) -> list[int]:
    """(frames, labels) posteriors -> the greedy path's labels: argmax per frame, repeats
    merged, blanks dropped."""
    best = logp.argmax(dim=-1).tolist()
    out: list[int] = []
    prev = -1
    for t in best:
        if t != prev and t != blank:
            out.append(t)
        prev = t
    return out


def ctc_text(labels: list[int]) -> str:
    """Code-point labels -> text (labels that are not valid code points are skipped)."""
    return "".join(chr(t) for t in labels if 0 < t < 0x110000 and not 0xD800 <= t < 0xE000)


def ctc_max_entropy(logp: Tensor) -> float:
    """The largest per-frame entropy (nats, every label incl. blank) of (frames, labels) log posteriors."""
    if logp.shape[0] == 0:
        return 0.0
    ent = -(logp.exp() * logp).sum(dim=-1)
    return float(ent.max())


@dataclass
class SpeechSpec:
    """What the engine and the doors need of a speech model: its parts' configs, the
    audio placeholder's token id, and the loaded ``SpeechModel`` (set by the loader)."""

    encoder: EncoderConfig
    projector: ProjectorConfig
    audio_token_index: int
    ctc_labels: str = "unicode"  # what CTC labels mean: Unicode code points (blank 0)
    # "normalized": the model writes transcripts as ``audio.text.normalize_transcript`` does
    # (the embedded model); "raw": as the checkpoint's training data had them.
    transcript: str = "raw"
    languages: tuple[str, ...] | None = None  # ISO-639-1 codes it transcribes (None: not declared)
    # The prompt it was trained with (config.json's specserve.prompt): None = Granite's
    # instruction and the chat template's default system turn.
    instruction: str | None = None
    system_prompt: str | None = None
    # Relaxed ctc's entropy gate chosen for this model on held-out recordings (config.json's
    # specserve.ctc_entropy_threshold, written by scripts/speech_gate_calibration.py): what
    # method.ctc_entropy_threshold: null means for it.  None: not calibrated.
    ctc_entropy_threshold: float | None = None
    # The word bigram model the ctc drafter spells with in context (config.json's
    # specserve.spelling_lm, an ``audio.word_lm.WordBigramLM`` set by the loader); None: none.
    word_lm: Any = None
    model: Any = None

    @property
    def window_size(self) -> int:
        return self.projector.window_size

    @property
    def downsample_rate(self) -> int:
        return self.projector.downsample_rate

    @classmethod
    def from_hf(cls, c: Any, extra: dict | None = None) -> "SpeechSpec":
        extra = extra or {}
        text_hidden = _get(c.text_config, "hidden_size")
        window, down = _get(c, "window_size", 15), _get(c, "downsample_rate", 5)
        if window % down:
            raise ValueError(f"downsample_rate ({down}) must divide window_size ({window})")
        gate = extra.get("ctc_entropy_threshold")
        if gate is not None and (isinstance(gate, bool) or not isinstance(gate, (int, float)) or not gate > 0):
            raise ValueError(f"specserve.ctc_entropy_threshold must be a positive number of nats, got {gate!r}")
        return cls(
            encoder=EncoderConfig.from_hf(c.encoder_config),
            projector=ProjectorConfig.from_hf(c.projector_config, window, down, text_hidden),
            audio_token_index=int(_get(c, "audio_token_index", _get(c, "audio_token_id", 0))),
            ctc_labels=str(extra.get("ctc_labels", "unicode")), transcript=str(extra.get("transcript", "raw")),
            languages=tuple(extra["languages"]) if extra.get("languages") else None,
            instruction=(extra.get("prompt") or {}).get("instruction"),
            system_prompt=(extra.get("prompt") or {}).get("system"),
            ctc_entropy_threshold=float(gate) if gate is not None else None,
        )
