"""Tensor-parallel pieces of the Llama-family model.

A rank's model is the ordinary ``LlamaModel`` built from the rank's local
``ArchConfig`` (its attention heads, KV heads and MLP slice; vocabulary and
hidden size stay global), with four modules swapped:

- ``qkv_proj`` / ``gate_up_proj`` are column-parallel: plain ``nn.Linear``
  holding the rank's rows (the loader slices q, k, v and gate, up by heads /
  columns), so nothing changes in the layer's forward;
- ``o_proj`` / ``down_proj`` are ``RowParallelLinear``: the rank's input
  columns, then ONE all-reduce of the (T, H) partial sums -- one after
  attention and one after the MLP per layer;
- ``embed_tokens`` is ``VocabParallelEmbedding``: rows of the rank's vocabulary
  slice, zeros for ids outside it, one all-reduce;
- ``compute_logits`` multiplies by the rank's LM-head (or tied embedding) rows
  and gathers the slices on rank 0, the only rank that samples.

The residual stream and the final hidden states are identical on every rank.
fp32 results differ from one device's only by the summation order of the
all-reduces (well within 1e-5 relative).

Rank 0 also runs proposers that read the target's shared layers outside a
step (an EAGLE head embeds its tokens with the target's embedding and scores
them with its LM head); the vocabulary-parallel layers then first tell the
workers to join (``Shard.join``), so such callers need no change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from specserve.executor.models.llama import LlamaModel

if TYPE_CHECKING:
    from specserve.parallel.shard import Shard


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_r @ W_r^T: the rank's input columns, then an all-reduce."""

    def __init__(self, in_features: int, out_features: int, shard: "Shard"):
        super().__init__(in_features, out_features, bias=False)
        self.shard = shard

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.shard.group)
        return y


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + rows) of the embedding; ids elsewhere look up zeros, and an
    all-reduce sums the one non-zero contribution of each token (exact)."""

    def __init__(self, num_rows: int, dim: int, start: int, shard: "Shard"):
        super().__init__(num_rows, dim)
        self.start = start
        self.shard = shard

    def forward(self, ids: Tensor) -> Tensor:
        self.shard.join("embed", ids)  # rank 0 outside a step: the workers take part
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside[:, None], 0.0)
        dist.all_reduce(x, group=self.shard.group)
        return x


class TensorParallelLlama(LlamaModel):
    """``LlamaModel`` on one rank's shard (see the module docstring)."""

    def __init__(self, a: Any, hf_config: Any, max_positions: int, shard: "Shard"):
        super().__init__(a, hf_config, max_positions)
        p = shard.plan
        self.shard = shard
        self.vocab_size = a.vocab_size
        H = a.hidden_size
        self.embed_tokens = VocabParallelEmbedding(p.vocab_shard, H, p.vocab[0], shard)
        for layer in self.layers:
            layer.o_proj = RowParallelLinear(p.num_heads * a.head_dim, H, shard)
            layer.down_proj = RowParallelLinear(p.intermediate_size, H, shard)
        if self.lm_head is not None:
            self.lm_head = nn.Linear(H, p.vocab_shard, bias=False)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: (N, H), the same on every rank -> (N, V) float32 on rank 0 (an empty
        tensor on the workers, which never sample)."""
        shard = self.shard
        shard.join("logits", hidden)
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        local = F.linear(hidden, w).float().contiguous()  # (N, V/tp)
        if shard.rank == 0:
            parts = [torch.empty_like(local) for _ in range(shard.size)]
            dist.gather(local, parts, dst=0, group=shard.group)
            return torch.cat(parts, dim=-1)[:, : self.vocab_size]
        dist.gather(local, None, dst=0, group=shard.group)
        return local[:0]

    def prepack(self) -> None:
        """The bf16 pre-packed layout is a one-device optimisation; shards run plain F.linear."""
