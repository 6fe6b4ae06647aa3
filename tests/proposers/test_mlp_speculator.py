"""IBM's MLP speculator: tiny random checkpoints in its format (untied, tied, with
scale_input) built here; greedy output equals plain decoding for K up to n_predict;
the stage formula against a direct computation; sampled drafts under probabilistic
verification keep the target's distribution; one-line errors (K > n_predict, not an
MLP speculator, mismatched sizes)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from engine_utils import greedy, plain_outputs, random_prompts, sample_outputs, tiny_config, total_variation
from engine_utils import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from safetensors.torch import save_file

from specserve.config import ConfigError
from specserve.engine.engine import LLMEngine
from specserve.proposers.mlp_speculator import load_mlp_speculator
from specserve.request import SamplingParams

MAX_TOKENS = 20
H, V = 64, 512  # the tiny targets' hidden size and vocabulary


def make_speculator(out: Path, n_predict: int = 3, inner: int = 48, tie: bool = False, scale_input: bool = False,
                    emb_dim: int = H, vocab: int = V, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    stages = 1 if tie else n_predict
    for i in range(n_predict):
        if i < stages or (not tie):
            sd[f"emb.{i}.weight"] = torch.randn(vocab, inner, generator=g)
            sd[f"head.{i}.weight"] = torch.randn(vocab, inner, generator=g) * 3 / inner**0.5
            sd[f"ln.{i}.weight"] = 1 + 0.1 * torch.randn(inner, generator=g)
            sd[f"ln.{i}.bias"] = 0.1 * torch.randn(inner, generator=g)
        if not tie or i <= 1:
            sd[f"proj.{i}.weight"] = torch.randn(inner, emb_dim if i == 0 else inner, generator=g) / inner**0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"))
    cfg = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "emb_dim": emb_dim,
           "inner_dim": inner, "n_predict": n_predict, "vocab_size": vocab, "tie_weights": tie,
           "scale_input": scale_input, "top_k_tokens_per_head": [1] * n_predict}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def speculators(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlp")
    return {
        "untied": make_speculator(root / "untied"),
        "tied-scaled": make_speculator(root / "tied", n_predict=4, tie=True, scale_input=True, seed=1),
    }


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, seed=31)


@pytest.fixture(scope="module")
def plain(tiny_llama, prompts):
    return plain_outputs(tiny_llama, prompts, MAX_TOKENS)


@pytest.mark.parametrize("name, k", [("untied", 1), ("untied", 3), ("tied-scaled", 4)])
def test_greedy_equals_plain_decoding(tiny_llama, speculators, prompts, plain, name, k):
    eng = LLMEngine(tiny_config(tiny_llama, "mlp_speculator", k=k, draft_dir=speculators[name]))
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == plain
    assert sum(o.spec.num_draft_tokens for o in outs) > 0
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_stage_formula(speculators):
    m = load_mlp_speculator(str(speculators["tied-scaled"]), "method.model", H, V)
    sw = 0.5 ** (0.5 / 4)
    ew = math.sqrt((1 - sw**2) * (48 / 2))
    h = torch.randn(2, H)
    tok = torch.tensor([3, 9])
    x = torch.nn.functional.layer_norm(h, (H,), eps=1e-6) / math.sqrt(2)
    assert torch.allclose(m.first_state(h), x)
    s = x @ m.proj[0].weight.T + m.emb[0].weight[tok] * (ew / sw)
    ln = m.ln[0]
    s = (s - s.mean(-1, keepdim=True)) / torch.sqrt(s.var(-1, unbiased=False, keepdim=True) + 1e-6) * ln.weight + ln.bias
    state = 0.5 * s * (1 + torch.erf(s / math.sqrt(2)))
    got_state, logits = m.stage(0, x, tok)
    assert torch.allclose(got_state, state, atol=1e-5) and torch.allclose(logits, state @ m.head[0].weight.T, atol=1e-4)
    assert torch.equal(m.emb[3].weight, m.emb[0].weight) and torch.equal(m.proj[3].weight, m.proj[1].weight)


def test_probabilistic_sampled_drafts_keep_the_distribution(tiny_llama, speculators):
    n = 600
    base = sample_outputs(tiny_llama, None, n, seed=3000)
    spec = sample_outputs(tiny_llama, "mlp_speculator", n, seed=3000, k=2, draft_dir=speculators["untied"])
    assert sum(o.spec.num_draft_tokens for o in spec) > n
    for pos in (1, 2, 3):
        tv = total_variation(base, spec, pos)
        assert tv < 0.15, (pos, tv)


def test_bad_combinations_are_one_line(tiny_llama, speculators, tmp_path):
    with pytest.raises(ConfigError) as e:
        LLMEngine(tiny_config(tiny_llama, "mlp_speculator", k=4, draft_dir=speculators["untied"]))
    assert str(e.value) == ("method.num_speculative_tokens: 4 exceeds the MLP speculator's n_predict (3); "
                            "use K <= 3")
    with pytest.raises(ConfigError, match="is not an MLP speculator"):
        LLMEngine(tiny_config(tiny_llama, "mlp_speculator", k=2, draft_dir=tiny_llama))
    wrong = make_speculator(tmp_path / "wide", emb_dim=32)
    with pytest.raises(ConfigError, match="emb_dim 32 differs from the target's hidden size 64"):
        LLMEngine(tiny_config(tiny_llama, "mlp_speculator", k=2, draft_dir=wrong))


def test_predictions_compose_with_sampled_drafts(tiny_llama, speculators, prompts, plain):
    """Predicted Outputs next to a method whose drafts carry q (probabilistic): requests
    with a prediction draft from it (one-hot q), the others from the speculator."""
    cfg = tiny_config(tiny_llama, "mlp_speculator", k=3, draft_dir=speculators["untied"],
                      rejection_sample_method="probabilistic")
    eng = LLMEngine(cfg)
    params = []
    for i, ref in enumerate(plain):
        pred = ref[:6] + [400, 401] + ref[6:] if i % 2 else None
        params.append(greedy(MAX_TOKENS, prediction_token_ids=pred) if i < 3 else
                      SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, seed=i, ignore_eos=True,
                                     prediction_token_ids=pred))
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs[:3]] == plain[:3]
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    assert outs[1].spec.num_accepted_prediction_tokens > 0
    assert eng.blocks.num_free == eng.blocks.num_blocks
