"""The EAGLE-3 head shipped for the embedded SmolLM2 (slow: the real model)."""

from __future__ import annotations

import pytest

from specserve.config import Config, SpeculativeConfig, validate_config
from specserve.engine.engine import LLMEngine
from specserve.executor.eagle_loader import ASSETS, EMBEDDED_HEADS
from specserve.request import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short Python function that reverses a string.",
    "Give three tips for staying productive when working from home.",
    "Explain what a hash table is to a beginner.",
]


def test_shipped_head_is_in_the_package():
    d = ASSETS / EMBEDDED_HEADS["smollm2-135m-instruct-eagle3"]
    assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
    assert (d / "model.safetensors").stat().st_size < 32 << 20


def test_plus_method_eagle3_alone_uses_it_losslessly():
    base = Config()
    base.model.dtype = "float32"
    base.engine.cpu_kernel = "torch"
    plain = LLMEngine(validate_config(base))
    tok = plain.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=64) for _ in prompts]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    cfg = Config(model=base.model, engine=base.engine, method=SpeculativeConfig(method="eagle3", num_speculative_tokens=4))
    eng = LLMEngine(validate_config(cfg), target=plain.target)
    assert cfg.method.model == "embedded:smollm2-135m-instruct-eagle3"
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    drafts = sum(o.spec.num_drafts for o in outs)
    al = 1 + sum(o.spec.num_accepted_tokens for o in outs) / drafts
    # the shipped head's drafts are accepted (1.42 on these prompts; a head that is not the
    # trained one, or features from the wrong layers, give about 1.0)
    assert al > 1.3, al
    assert eng.blocks.num_free == eng.blocks.num_blocks
