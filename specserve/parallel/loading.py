"""Load only this rank's slices of a checkpoint.

safetensors files are opened lazily (``safe_open``) and each tensor is read
through ``get_slice``, so a rank reads its rows of q/k/v, gate/up and the
vocabulary and its columns of o_proj/down from disk, never the whole tensor.
A GGUF model (the embedded one included) is converted once into an HF
directory of safetensors under the cache dir (``executor.loader``); ranks
slice that.  ``pytorch_model*.bin`` checkpoints cannot be read by parts: each
rank memory-maps the whole file and keeps its slices.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specserve.errors import ModelLoadError
from specserve.executor.models.llama import ArchConfig
from specserve.parallel.layers import TensorParallelLlama
from specserve.parallel.plan import ShardPlan, plan_shard
from specserve.parallel.shard import Shard


class SliceReader:
    """Tensors of an HF directory by name, read by row or column ranges."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open

        self._handles: dict[str, Any] = {}
        self._where: dict[str, Any] = {}
        single, index = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json"
        if single.is_file() or index.is_file():
            files = [single.name] if single.is_file() else sorted(set(json.loads(index.read_text())["weight_map"].values()))
            for f in files:
                h = safe_open(str(hf_dir / f), framework="pt")
                self._handles[f] = h
                for name in h.keys():
                    self._where[name] = h
            return
        bins = sorted(hf_dir.glob("pytorch_model*.bin"))
        if not bins:
            raise ModelLoadError(f"{hf_dir} holds no weights (model.safetensors, a sharded index or pytorch_model*.bin)")
        for b in bins:  # no partial reads for pickles: memory-map, keep the slices
            sd = torch.load(b, map_location="cpu", weights_only=True, mmap=True)
            self._where.update(sd)

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> Tensor:
        src = self._where.get(name)
        if src is None:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        if isinstance(src, Tensor):
            t = src
            if rows is not None:
                t = t[rows[0] : rows[1]]
            if cols is not None:
                t = t[:, cols[0] : cols[1]]
            return t.clone()
        part = src.get_slice(name)
        if rows is not None and cols is not None:
            return part[rows[0] : rows[1], cols[0] : cols[1]]
        if rows is not None:
            return part[rows[0] : rows[1]]
        if cols is not None:
            return part[:, cols[0] : cols[1]]
        return src.get_tensor(name)


def _padded_rows(t: Tensor, rows: int) -> Tensor:
    """The last vocabulary slice is short by V mod tp rows: pad with zeros (their logits
    are cut off after the gather and no id looks them up)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def shard_weights(r: SliceReader, a: ArchConfig, p: ShardPlan) -> dict[str, Tensor]:
    """This rank's tensors under the model's (fused) names; see ``loader.fuse_llama_weights``."""
    hd = a.head_dim
    q = (p.q_heads[0] * hd, p.q_heads[1] * hd)
    kv = (p.kv_heads[0] * hd, p.kv_heads[1] * hd)
    vocab = _padded_rows(r.get("model.embed_tokens.weight", rows=p.vocab), p.vocab_shard)
    out = {"embed_tokens.weight": vocab, "norm.weight": r.get("model.norm.weight")}
    if not a.tie_word_embeddings:
        out["lm_head.weight"] = _padded_rows(r.get("lm_head.weight", rows=p.vocab), p.vocab_shard)
    for i in range(a.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        att, mlp = src + "self_attn.", src + "mlp."
        out[dst + "input_layernorm.weight"] = r.get(src + "input_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = r.get(src + "post_attention_layernorm.weight")
        out[dst + "qkv_proj.weight"] = torch.cat(
            [r.get(att + "q_proj.weight", rows=q), r.get(att + "k_proj.weight", rows=kv),
             r.get(att + "v_proj.weight", rows=kv)]
        )  # fmt: skip
        if a.attention_bias:
            out[dst + "qkv_proj.bias"] = torch.cat(
                [r.get(att + "q_proj.bias", rows=q), r.get(att + "k_proj.bias", rows=kv),
                 r.get(att + "v_proj.bias", rows=kv)]
            )  # fmt: skip
        out[dst + "o_proj.weight"] = r.get(att + "o_proj.weight", cols=q)
        if a.qk_norm:
            out[dst + "q_norm.weight"] = r.get(att + "q_norm.weight")
            out[dst + "k_norm.weight"] = r.get(att + "k_norm.weight")
        out[dst + "gate_up_proj.weight"] = torch.cat(
            [r.get(mlp + "gate_proj.weight", rows=p.inter), r.get(mlp + "up_proj.weight", rows=p.inter)]
        )
        out[dst + "down_proj.weight"] = r.get(mlp + "down_proj.weight", cols=p.inter)
    return out


class ShardSpec:
    """What ``executor.loader.load_model(tp=...)`` needs to build one rank's model."""

    def __init__(self, rank: int, size: int, group: Any, model_id: int, link: Any = None, what: str = "model"):
        self.rank, self.size, self.group, self.model_id, self.link, self.what = rank, size, group, model_id, link, what

    def build(self, hf_dir: Path, hf_config: Any, arch: ArchConfig, dtype: torch.dtype) -> tuple[Any, ArchConfig]:
        """(this rank's model with its weights, its local ArchConfig)."""
        plan = plan_shard(arch.num_heads, arch.num_kv_heads, arch.intermediate_size, arch.vocab_size,
                          self.rank, self.size, self.what)  # fmt: skip
        local = dataclasses.replace(
            arch, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads, intermediate_size=plan.intermediate_size
        )
        shard = Shard(plan, self.group, self.model_id, self.link)
        with torch.device("meta"):
            model = TensorParallelLlama(local, hf_config, 1, shard)
        weights = shard_weights(SliceReader(hf_dir), arch, plan)
        model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=True, assign=True)
        return model, local
