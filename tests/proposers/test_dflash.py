"""DFlash: tiny random DFlash drafts (Qwen3-style config, fc/hidden_norm/norm, q/k-normed
layers, dflash_config) built here for a llama and a qwen3 target; greedy output equals
plain decoding; one draft forward (each draft layer once) per round; context K/V
freed; sampled drafts under probabilistic verification keep the target's
distribution; one-line errors (K beyond the block, not a DFlash draft, hidden size)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_utils import greedy, plain_outputs, random_prompts, sample_outputs, tiny_config, total_variation
from engine_utils import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from safetensors.torch import save_file

from specserve.config import ConfigError
from specserve.engine.engine import LLMEngine
from specserve.proposers.dflash import DFlashLayer

MAX_TOKENS = 20


def make_dflash(out: Path, target_layers: list[int], layers: int = 2, block: int = 4, hidden: int = 64,
                target_hidden: int = 64, mask: int = 511, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    heads, kvh, hd, inter = 4, 2, 16, 128

    def w(*shape):
        return torch.randn(*shape, generator=g) * 2 / shape[-1] ** 0.5

    sd = {"fc.weight": w(hidden, len(target_layers) * target_hidden), "hidden_norm.weight": torch.ones(hidden),
          "norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        sd.update({
            p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": w(heads * hd, hidden), p + "self_attn.k_proj.weight": w(kvh * hd, hidden),
            p + "self_attn.v_proj.weight": w(kvh * hd, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * hd),
            p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        })
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"))
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kvh, "head_dim": hd, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 512, "vocab_size": 512, "block_size": block,
           "dflash_config": {"mask_token_id": mask, "target_layer_ids": target_layers}}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    return {"two-features": make_dflash(root / "a", [0, 1]), "one-feature": make_dflash(root / "b", [0], layers=1,
                                                                                        block=6, seed=1)}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, seed=51)


@pytest.mark.parametrize("arch, draft, k", [("llama", "two-features", 3), ("llama", "one-feature", 2),
                                            ("qwen3", "two-features", 1), ("qwen3", "one-feature", 5)])
def test_greedy_equals_plain_with_one_forward_per_round(tiny_model_dirs, drafts, prompts, arch, draft, k, monkeypatch):
    model = tiny_model_dirs[arch]
    ref = plain_outputs(model, prompts, MAX_TOKENS)
    calls = []
    forward = DFlashLayer.forward
    monkeypatch.setattr(DFlashLayer, "forward", lambda self, *a, **kw: calls.append(1) or forward(self, *a, **kw))
    eng = LLMEngine(tiny_config(model, "dflash", k=k, draft_dir=drafts[draft]))
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == ref
    rounds = sum(o.spec.num_drafts for o in outs)
    assert rounds > 0
    assert len(calls) <= rounds * len(eng.proposer.draft.layers)  # one block forward per round (batched)
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.proposer.blocks.num_free == eng.proposer.blocks.num_blocks and not eng.proposer.states


def test_chunked_prefill_and_preemption(tiny_llama, drafts, prompts):
    ref = plain_outputs(tiny_llama, prompts, MAX_TOKENS)
    cfg = tiny_config(tiny_llama, "dflash", k=3, num_blocks=24, block_size=4, draft_dir=drafts["two-features"])
    cfg.engine.max_num_batched_tokens = 12
    eng = LLMEngine(cfg)
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == ref
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_probabilistic_sampled_drafts_keep_the_distribution(tiny_llama, drafts):
    n = 600
    base = sample_outputs(tiny_llama, None, n, seed=5000)
    spec = sample_outputs(tiny_llama, "dflash", n, seed=5000, k=3, draft_dir=drafts["two-features"])
    assert sum(o.spec.num_draft_tokens for o in spec) > n
    for pos in (1, 2, 3):
        tv = total_variation(base, spec, pos)
        assert tv < 0.15, (pos, tv)


def test_bad_combinations_are_one_line(tiny_llama, drafts, tmp_path):
    with pytest.raises(ConfigError) as e:
        LLMEngine(tiny_config(tiny_llama, "dflash", k=4, draft_dir=drafts["two-features"]))
    assert str(e.value) == ("method.num_speculative_tokens: 4 exceeds what a DFlash block of 4 drafts (3); "
                            "use K <= 3")
    with pytest.raises(ConfigError, match="is not a DFlash draft"):
        LLMEngine(tiny_config(tiny_llama, "dflash", k=2, draft_dir=tiny_llama))
    wide = make_dflash(tmp_path / "wide", [0], hidden=32)
    with pytest.raises(ConfigError, match="hidden size 32 differs from the target's 64"):
        LLMEngine(tiny_config(tiny_llama, "dflash", k=2, draft_dir=wide))
    far = make_dflash(tmp_path / "far", [0, 7])
    with pytest.raises(ConfigError, match=r"target_layer_ids \[0, 7\] must be layer ids in \[0, 2\)"):
        LLMEngine(tiny_config(tiny_llama, "dflash", k=2, draft_dir=far))
