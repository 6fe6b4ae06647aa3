"""Helpers to build engines on tiny models for tests."""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.config import Config, ModelConfig, SpeculativeConfig, validate_config
from specserve.engine.engine import LLMEngine
from specserve.request import SamplingParams


def tiny_config(model_dir: Path, method: str | None = None, k: int = 3, num_blocks: int = 256,
                block_size: int = 4, draft_dir: Path | None = None, **spec_kw) -> Config:
    cfg = Config(model=ModelConfig(name="tiny", path=str(model_dir), dtype="float32"))
    cfg.engine.num_kv_blocks = num_blocks
    cfg.engine.block_size = block_size
    if method is not None:
        spec_kw.setdefault("prompt_lookup_min", 1)
        spec_kw.setdefault("prompt_lookup_max", 3)
        cfg.method = SpeculativeConfig(method=method, num_speculative_tokens=k,
                                       model=str(draft_dir) if draft_dir else None, **spec_kw)
    return validate_config(cfg)


def random_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 24, vocab: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    # A small alphabet makes n-grams repeat, so drafts get both accepted and rejected.
    return [torch.randint(5, vocab, (m,), generator=g).tolist() for m in lens]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(engine: LLMEngine, prompts, params):
    return [o.token_ids for o in engine.generate(prompts, params)]
