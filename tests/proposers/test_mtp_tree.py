"""MTP draft trees (``method.tree``): EAGLE-2 trees over the MTP layers' own KV cache,
verified in one target forward.  Greedy output equals plain decoding for several tree
shapes, layouts and layer counts, beside chunked prefills and with the drafts per step
changing; a topk-1 tree drafts exactly the chain (the chain's layer schedule); the trees
branch when topk > 1; the target's and the proposer's KV blocks are all freed; after
every step the MTP cache holds a chain run's K/V at the committed positions; a static
tree is followed node for node.  Targets: test_mtp's random MTP layers, and oracle MTP
layers of a leaky bigram target (often right, often not: paths get accepted and moved)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))

from eagle_heads import make_bigram_target  # noqa: E402
from engine_utils import draw_k_every_step, greedy, plain_outputs, random_prompts, record_drafts  # noqa: E402
from engine_utils import tiny_config  # noqa: E402
from engine_utils import one_thread  # noqa: E402, F401 (an autouse fixture: one torch thread)
from test_mtp import CASES, add_mtp_layers  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from specserve.engine.engine import LLMEngine  # noqa: E402
from tree_utils import engine, follow_chain_cache, record_trees, tree  # noqa: E402

MAX_TOKENS = 20
def oracle_mtp(model_dir: Path, n: int) -> Path:
    """n MTP layers (DeepSeek naming, the target's LM head) that predict a bigram target:
    eh_proj passes the normed token embedding, the block adds nothing (o_proj and
    down_proj zero) and shared_head.norm is the target's final norm, so each layer's logits
    are the target's given the token alone."""
    add_mtp_layers(model_dir, "llama", "deepseek", n)
    f = model_dir / "model.safetensors"
    sd = load_file(str(f))
    N = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    H = sd["model.norm.weight"].shape[0]
    for k in range(n):
        p = f"model.layers.{N + k}."
        sd[p + "eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
        sd[p + "self_attn.o_proj.weight"] = torch.zeros_like(sd[p + "self_attn.o_proj.weight"])
        sd[p + "mlp.down_proj.weight"] = torch.zeros_like(sd[p + "mlp.down_proj.weight"])
        sd[p + "shared_head.norm.weight"] = sd["model.norm.weight"].clone()
    save_file(sd, str(f), metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-tree")
    out = {f"oracle-{n}": oracle_mtp(make_bigram_target(root / f"oracle-{n}", leak=0.3), n) for n in (1, 2)}
    for name in ("mimo-qwen2-1", "deepseek-qwen3-1"):
        arch, layout, n, own = CASES[name]
        out[name] = add_mtp_layers(make_tiny_model(root / name, arch, seed=11), arch, layout, n, own)
    return out


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, seed=21)


@pytest.fixture(scope="module")
def plain(targets, prompts):
    return {name: plain_outputs(model, prompts, MAX_TOKENS) for name, model in targets.items()}


def check_lossless(eng, prompts, expected, params=None):
    outs = eng.generate(prompts, params or [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == expected
    assert eng.blocks.num_free == eng.blocks.num_blocks  # the target's blocks
    p = eng.proposer
    assert p.blocks.num_free == p.blocks.num_blocks and not p.states  # the MTP cache's own blocks
    return outs


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


SHAPES = [tree(1, 3, 4), tree(2, 3, 6), tree(3, 2, 7), tree(2, 4, 8)]


@pytest.mark.parametrize("name", ["oracle-2", "mimo-qwen2-1"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"topk{s['topk']}-depth{s['depth']}-n{s['num_draft_tokens']}"
                                               for s in SHAPES])
def test_greedy_trees_equal_plain_decoding(targets, prompts, plain, name, shape):
    eng = engine(tiny_config(targets[name], "mtp", tree=shape))
    assert eng.num_spec_tokens == shape["num_draft_tokens"] - 1
    seen = record_trees(eng)
    outs = check_lossless(eng, prompts, plain[name])
    assert sum(o.spec.num_draft_tokens for o in outs) > 0
    if name.startswith("oracle"):  # drafts accepted, and some rejected
        assert 0 < sum(o.spec.num_accepted_tokens for o in outs) < sum(o.spec.num_draft_tokens for o in outs)
    k = shape["topk"]
    for toks, parents in seen:
        assert parents is not None and len(parents) == len(toks) <= shape["num_draft_tokens"] - 1
        assert all(-1 <= p < i for i, p in enumerate(parents))  # parents first
        assert max(Counter(parents).values()) <= k
        assert max(depths(parents)) <= shape["depth"]
    full = [p for t, p in seen if len(t) == shape["num_draft_tokens"] - 1]
    assert full
    assert any(max(Counter(p).values()) > 1 for p in full) == (k > 1)  # trees branch where topk > 1


def test_a_topk1_tree_drafts_the_chain_and_a_wider_one_accepts_more(targets, prompts, plain):
    """A topk-1 tree drafts what the chain of as many drafts does, round for round; the
    oracle's guess is often wrong, and a topk-3 tree's siblings catch some of it."""
    model = targets["oracle-2"]
    runs = {}
    for label, kw in (("chain", {"k": 3}), ("tree", {"tree": tree(1, 3, 4)}), ("wide", {"tree": tree(3, 3, 8)})):
        cfg = tiny_config(model, "mtp", **kw)
        eng = engine(cfg)
        drafts = record_drafts(eng)
        outs = check_lossless(eng, prompts, plain["oracle-2"])
        runs[label] = (drafts, sum(o.spec.num_accepted_tokens for o in outs))
    assert runs["tree"] == runs["chain"] and runs["chain"][1] > 0
    assert runs["wide"][1] > runs["chain"][1]


def test_trees_beside_chunked_prefill_and_changing_drafts(targets):
    """A ragged batch: long prompts prefill in chunks while others verify trees, and the
    drafts per step (the tree's node budget) change at random, down to none."""
    model = targets["deepseek-qwen3-1"]
    prompts = random_prompts(6, seed=8, lo=3, hi=60)
    expected = plain_outputs(model, prompts, MAX_TOKENS)
    cfg = tiny_config(model, "mtp", tree=tree(2, 3, 7))
    cfg.engine.max_num_batched_tokens = 24
    cfg.engine.long_prefill_token_threshold = 16
    eng = engine(cfg)
    draws = draw_k_every_step(eng, eng.num_spec_tokens, seed=5)
    seen = record_trees(eng)
    check_lossless(eng, prompts, expected)
    assert {0, eng.num_spec_tokens} <= set(draws)
    assert any(len(t) < eng.num_spec_tokens for t, _ in seen)  # smaller trees when fewer drafts are allowed
    assert any(p is not None and max(Counter(p).values()) > 1 for _, p in seen)


def _mtp_kv(eng, rid: str, n: int) -> torch.Tensor:
    """Every MTP layer's K/V of positions 0..n-1 of request ``rid`` (the proposer's block table)."""
    p = eng.proposer
    table, bs = p.states[rid].block_table, p.kv.block_size
    slots = torch.tensor([table[q // bs] * bs + q % bs for q in range(n)])
    return p.kv.data[:, :, slots].clone()


def test_the_mtp_cache_holds_the_chains_kv_at_committed_positions(targets, prompts):
    """After every tree step (nodes stored past the committed pairs), both MTP layers' K/V at
    the committed positions are those of a chain run committed as far."""
    model = targets["oracle-2"]
    eng = engine(tiny_config(model, "mtp", tree=tree(3, 3, 8)))
    ref = engine(tiny_config(model, "mtp", k=3))
    checked, moved = follow_chain_cache(eng, ref, prompts[1], greedy(40), _mtp_kv)
    assert checked == 10 and moved > 0  # some accepted path sat off the first nodes


STATIC = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"


def test_a_static_tree_is_followed(targets, prompts, plain):
    """``method.tree.static``: every full round drafts exactly the static tree's shape
    (paths in level order, parents first), and greedy output is plain decoding's."""
    name = "oracle-2"
    eng = engine(tiny_config(targets[name], "mtp", tree={"static": STATIC}))
    assert eng.num_spec_tokens == 7
    seen = record_trees(eng)
    outs = check_lossless(eng, prompts, plain[name])
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    full = [p for t, p in seen if len(t) == 7]
    assert full and all(p == [-1, -1, -1, 0, 0, 1, 3] for p in full)


def test_under_a_sliding_window_a_topk1_tree_drafts_the_chain(tmp_path, prompts):
    """A target with a sliding window of 2 (read as Mistral) and random MTP layers whose
    attention counts: a topk-1 tree 4 deep drafts the chain's tokens round for round, so
    each node sees only the ancestors inside the window, as the chain's positions do, and
    runs the chain's layer at each depth (the layers differ here, unlike the oracle's)."""
    model = add_mtp_layers(make_tiny_model(tmp_path / "windowed", "llama", seed=11), "llama", "deepseek", 2, seed=3)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=2)
    (model / "config.json").write_text(json.dumps(cfg))
    expected = plain_outputs(model, prompts, MAX_TOKENS)
    runs = []
    for kw in ({"k": 4}, {"tree": tree(1, 4, 5)}):
        eng = engine(tiny_config(model, "mtp", **kw))
        assert eng.proposer.window == 2
        drafts = record_drafts(eng)
        check_lossless(eng, prompts, expected)
        runs.append(drafts)
    assert runs[0] == runs[1] and len({tuple(d) for r in runs[0] for d in r if d}) > 3
