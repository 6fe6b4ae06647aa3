"""MTP: tiny random targets carrying MTP layers in the DeepSeek-V3 naming (llama and
qwen3, own and shared head, one and two layers) and the MiMo layout (qwen2), built
here as checkpoints; greedy output equals plain decoding for K within and beyond
the number of MTP layers; KV blocks freed; sampled drafts under probabilistic
verification keep the target's distribution; a target without MTP layers is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_utils import (greedy, head_forwards, plain_outputs, random_prompts, record_drafts, sample_outputs,
                          tiny_config, total_variation)
from engine_utils import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from specserve.config import ConfigError
from specserve.engine.engine import LLMEngine
from specserve.request import SamplingParams

MAX_TOKENS = 16


def _layer(prefix: str, cfg: dict, g: torch.Generator, arch: str) -> dict[str, torch.Tensor]:
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def w(*shape):
        return torch.randn(*shape, generator=g) * 3 / shape[-1] ** 0.5

    t = {
        "input_layernorm.weight": torch.ones(H), "post_attention_layernorm.weight": torch.ones(H),
        "self_attn.q_proj.weight": w(q, H), "self_attn.k_proj.weight": w(kv, H), "self_attn.v_proj.weight": w(kv, H),
        "self_attn.o_proj.weight": w(H, q), "mlp.gate_proj.weight": w(I, H), "mlp.up_proj.weight": w(I, H),
        "mlp.down_proj.weight": w(H, I),
    }
    if arch == "qwen2":
        t.update({f"self_attn.{n}_proj.bias": torch.randn(s, generator=g) * 0.1 for n, s in (("q", q), ("k", kv), ("v", kv))})
    if arch == "qwen3":
        t.update({"self_attn.q_norm.weight": torch.ones(hd), "self_attn.k_norm.weight": torch.ones(hd)})
    return {prefix + k: v for k, v in t.items()}


def add_mtp_layers(model_dir: Path, arch: str, layout: str, n: int, own_head: bool = False, seed: int = 0) -> Path:
    """Write n MTP layers into a tiny checkpoint (DeepSeek-V3 naming or MiMo layout)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    H, V, N = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    sd = load_file(str(model_dir / "model.safetensors"))
    for k in range(n):
        if layout == "deepseek":
            p = f"model.layers.{N + k}."
            sd.update(_layer(p, cfg, g, arch))
            sd[p + "enorm.weight"] = torch.ones(H)
            sd[p + "hnorm.weight"] = torch.ones(H)
            sd[p + "eh_proj.weight"] = torch.randn(H, 2 * H, generator=g) * 3 / (2 * H) ** 0.5
            sd[p + "shared_head.norm.weight"] = torch.ones(H)
            if own_head:
                sd[p + "shared_head.head.weight"] = torch.randn(V, H, generator=g) * 3 / H**0.5
        else:
            p = f"model.mtp_layers.{k}."
            sd.update(_layer(p + "mtp_block.", cfg, g, arch))
            sd[p + "token_layernorm.weight"] = torch.ones(H)
            sd[p + "hidden_layernorm.weight"] = torch.ones(H)
            sd[p + "input_proj.weight"] = torch.randn(H, 2 * H, generator=g) * 3 / (2 * H) ** 0.5
            sd[p + "final_layernorm.weight"] = torch.ones(H)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(model_dir / "model.safetensors"))
    cfg["num_nextn_predict_layers"] = n
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir


CASES = {  # name: (arch, layout, MTP layers, own head)
    "deepseek-llama-1": ("llama", "deepseek", 1, False),
    "deepseek-llama-2-own-head": ("llama", "deepseek", 2, True),
    "deepseek-qwen3-1": ("qwen3", "deepseek", 1, True),
    "mimo-qwen2-1": ("qwen2", "mimo", 1, False),
    "mimo-qwen2-2": ("qwen2", "mimo", 2, False),
}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for name, (arch, layout, n, own) in CASES.items():
        d = make_tiny_model(root / name, arch, seed=11)
        out[name] = add_mtp_layers(d, arch, layout, n, own)
    return out


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, seed=21)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_equals_plain_decoding(targets, prompts, name):
    model = targets[name]
    ref = plain_outputs(model, prompts, MAX_TOKENS)
    n = CASES[name][2]
    for k in (n + 1,):  # K beyond the MTP layers: steps past the last one reuse it
        eng = LLMEngine(tiny_config(model, "mtp", k=k))
        outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
        assert [o.token_ids for o in outs] == ref, (name, k)
        assert sum(o.spec.num_draft_tokens for o in outs) > 0
        assert eng.blocks.num_free == eng.blocks.num_blocks
        assert eng.proposer.blocks.num_free == eng.proposer.blocks.num_blocks and not eng.proposer.states
        assert eng.proposer.layers[0].layout == CASES[name][1]


def test_chunked_prefill_and_preemption(targets, prompts):
    model = targets["mimo-qwen2-2"]
    ref = plain_outputs(model, prompts, MAX_TOKENS)
    cfg = tiny_config(model, "mtp", k=3, num_blocks=26, block_size=4)
    cfg.engine.max_num_batched_tokens = 16
    eng = LLMEngine(cfg)
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == ref
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_on_the_paged_kernel_a_prompt_chunk_beside_decode_rows_pads_nothing(targets, monkeypatch):
    """The MTP layers' forwards on the paged kernel (what CUDA runs: ``RunnerFactory.head_attention``;
    here the kernel's torch twin): a step that commits a prompt chunk beside another request's
    verified rows goes through the kernel, never the reference attention's padded group, and
    every round's drafts are those of the reference attention."""
    model, k = targets["deepseek-qwen3-1"], 2
    prompts = random_prompts(2, seed=5, lo=3, hi=6) + random_prompts(1, seed=6, lo=40, hi=41)
    ref = plain_outputs(model, prompts, MAX_TOKENS)
    cfg = tiny_config(model, "mtp", k=k)
    cfg.engine.max_num_batched_tokens = 16  # the long prompt runs in chunks beside the short ones' rows
    forwards = head_forwards(monkeypatch)
    runs = {}
    for attention in (None, "torch"):
        eng = LLMEngine(cfg)
        assert eng.proposer.attention is None  # the CPU's choice: the reference attention
        eng.proposer.attention = attention
        drafts = record_drafts(eng)
        forwards.clear()
        outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
        assert [o.token_ids for o in outs] == ref
        assert eng.proposer.blocks.num_free == eng.proposer.blocks.num_blocks
        runs[attention] = (drafts, list(forwards))
    assert runs["torch"][0] == runs[None][0] and any(any(d) for d in runs["torch"][0])
    assert {path for path, _, _ in runs[None][1]} == {"reference"}
    kernel = runs["torch"][1]
    assert {path for path, _, _ in kernel} == {"kernel"}
    # a chunk longer than any verification, with context before it, beside another request's rows
    assert any(len(q) > 1 and any(n > k + 1 and ctx > n for n, ctx in zip(q, lens)) for _, q, lens in kernel)


def test_probabilistic_sampled_drafts_keep_the_distribution(targets):
    """Drafts sampled from the MTP layer's q, verified with min(1, p/q): the target's
    distribution of output tokens 2..4 matches plain sampling (600 seeded requests;
    at 2000 the distance is at the noise level of two plain runs, ~0.03)."""
    model = targets["deepseek-llama-1"]
    n = 600
    # num_threads=1: hundreds of tiny attention calls, threads only contend
    base = sample_outputs(model, None, n, seed=7000, num_threads=1)
    spec = sample_outputs(model, "mtp", n, seed=7000, k=2, num_threads=1)
    assert sum(o.spec.num_draft_tokens for o in spec) > n  # drafts were sampled and verified
    for pos in (1, 2, 3):
        tv = total_variation(base, spec, pos)
        assert tv < 0.15, (pos, tv)


def test_head_sampler_q_is_what_it_samples_from():
    """The q handed to the rejection sampler is the distribution the drafts come from."""
    from specserve.proposers.heads import HeadSampler

    class Seq:
        def __init__(self, i, t):
            self.request_id, self.params = f"r{i}", SamplingParams(temperature=t, top_k=8, seed=i)
            self.seed = i  # the engine sets a sequence's Philox key at admission

    V, n = 12, 4000
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0)) * 2
    hs = HeadSampler(True, V, torch.device("cpu"))
    toks, q = hs.draw(logits.expand(n, V), [Seq(i, 0.9) for i in range(n)], [5] * n)  # one row per request
    assert torch.equal(q, q[:1].expand(n, V))
    q0 = q[0]
    counts = torch.bincount(toks, minlength=V).float()
    assert (q0 > 0).sum() == 8  # top-k applied
    assert 0.5 * (counts / n - q0).abs().sum() < 0.03
    tok, q = hs.draw(logits, [Seq(0, 0.0)], [5])  # greedy rows: argmax, one-hot q
    assert tok[0] == logits.argmax() and q is None


def test_target_without_mtp_layers_is_one_line(tiny_llama):
    with pytest.raises(ConfigError) as e:
        LLMEngine(tiny_config(tiny_llama, "mtp", k=2))
    msg = str(e.value)
    assert msg.startswith("method.method: mtp needs a target with MTP layers") and "\n" not in msg
