"""KV budget accounting that does not need a GPU to check."""

from __future__ import annotations

import torch
from engine_utils import tiny_config

from specserve.executor.batch import draft_sizes
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import load_model
from specserve.proposers.base import TargetShape, memory_needs


def test_a_draft_models_cache_is_counted_per_block(tiny_llama, tiny_draft):
    target = load_model(str(tiny_llama), "float32", torch.device("cpu"))
    cfg = tiny_config(tiny_llama, "draft_model", k=3, draft_dir=tiny_draft)
    d = load_model(str(tiny_draft), "float32", torch.device("cpu")).arch
    want = KVCache.bytes_per_block(d.num_layers, cfg.engine.block_size, d.num_kv_heads, d.head_dim, torch.float32)
    shape = TargetShape(target.arch, 4, target.max_model_len, target.hf_dir)
    assert memory_needs(cfg.method, shape, cfg.engine, cfg.draft).kv_bytes_per_block == want > 0
    assert memory_needs(tiny_config(tiny_llama, "ngram", k=3).method, shape, cfg.engine).kv_bytes_per_block == 0


def test_draft_sizes_are_the_captured_verification_sizes():
    assert draft_sizes(0) == ()
    assert draft_sizes(5) == (1, 2, 3, 4, 5)
    assert draft_sizes(40) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 40)
