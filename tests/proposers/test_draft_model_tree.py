"""Draft-model trees (``method.tree``): EAGLE-2 trees expanded by a separate draft LM over
its own KV cache, verified in one target forward.  Greedy output equals plain decoding
for several tree shapes and a static tree, beside chunked prefills with the drafts per
step changing; a topk-1 tree drafts exactly the chain; trees branch when topk > 1; with
the target as its own draft every node of the best path is accepted; the target's and
the draft's KV blocks are all freed; after every step the draft cache holds a chain
run's K/V at the committed positions.  Models: a leaky bigram target with the pure
bigram as its draft (often right, often not: paths get accepted and moved), and the
shared random tiny llama with a weaker random draft."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from eagle_heads import make_bigram_target  # noqa: E402
from engine_utils import draw_k_every_step, greedy, plain_outputs, random_prompts, record_drafts  # noqa: E402
from engine_utils import tiny_config  # noqa: E402
from engine_utils import one_thread  # noqa: E402, F401 (an autouse fixture: one torch thread)

from specserve.engine.engine import LLMEngine  # noqa: E402
from tree_utils import engine, follow_chain_cache, record_trees, tree  # noqa: E402

MAX_TOKENS = 20
@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama, tiny_draft):
    root = tmp_path_factory.mktemp("draft-tree")
    return {
        "bigram": (make_bigram_target(root / "target", leak=0.3), make_bigram_target(root / "draft", leak=0.0)),
        "random": (tiny_llama, tiny_draft),
    }


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, seed=21)


@pytest.fixture(scope="module")
def plain(models, prompts):
    return {name: plain_outputs(target, prompts, MAX_TOKENS) for name, (target, _) in models.items()}


def config(models, name: str, **kw):
    target, draft = models[name]
    return tiny_config(target, "draft_model", draft_dir=draft, **kw)


def check_lossless(eng, prompts, expected):
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == expected
    assert eng.blocks.num_free == eng.blocks.num_blocks  # the target's blocks
    p = eng.proposer
    assert p.blocks.num_free == p.blocks.num_blocks and not p.states  # the draft cache's blocks
    return outs


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


SHAPES = [tree(1, 3, 4), tree(2, 3, 6), tree(3, 2, 7), tree(2, 4, 8)]


@pytest.mark.parametrize("name", ["bigram", "random"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"topk{s['topk']}-depth{s['depth']}-n{s['num_draft_tokens']}"
                                               for s in SHAPES])
def test_greedy_trees_equal_plain_decoding(models, prompts, plain, name, shape):
    eng = engine(config(models, name, tree=shape))
    assert eng.num_spec_tokens == shape["num_draft_tokens"] - 1
    seen = record_trees(eng)
    outs = check_lossless(eng, prompts, plain[name])
    assert sum(o.spec.num_draft_tokens for o in outs) > 0
    if name == "bigram":  # drafts accepted, and some rejected
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


def test_a_topk1_tree_drafts_the_chain_and_a_wider_one_accepts_more(models, prompts, plain):
    """A topk-1 tree drafts what the chain of as many drafts does, round for round; the
    bigram draft is often wrong, and a topk-3 tree's siblings catch some of it."""
    runs = {}
    for label, kw in (("chain", {"k": 3}), ("tree", {"tree": tree(1, 3, 4)}), ("wide", {"tree": tree(3, 3, 8)})):
        eng = engine(config(models, "bigram", **kw))
        drafts = record_drafts(eng)
        outs = check_lossless(eng, prompts, plain["bigram"])
        runs[label] = (drafts, sum(o.spec.num_accepted_tokens for o in outs))
    assert runs["tree"] == runs["chain"] and runs["chain"][1] > 0
    assert runs["wide"][1] > runs["chain"][1]


def test_a_static_tree_is_followed(models, prompts, plain):
    eng = engine(config(models, "bigram", tree={"static": "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"}))
    assert eng.num_spec_tokens == 7
    seen = record_trees(eng)
    outs = check_lossless(eng, prompts, plain["bigram"])
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    full = [p for t, p in seen if len(t) == 7]
    assert full and all(p == [-1, -1, -1, 0, 0, 1, 3] for p in full)


def test_trees_beside_chunked_prefill_and_changing_drafts(models):
    """A ragged batch: long prompts prefill in chunks while others verify trees, and the
    drafts per step (the tree's node budget) change at random, down to none."""
    target, _ = models["bigram"]
    prompts = random_prompts(6, seed=8, lo=3, hi=60)
    expected = plain_outputs(target, prompts, MAX_TOKENS)
    cfg = config(models, "bigram", tree=tree(2, 3, 7))
    cfg.engine.max_num_batched_tokens = 24
    cfg.engine.long_prefill_token_threshold = 16
    eng = engine(cfg)
    draws = draw_k_every_step(eng, eng.num_spec_tokens, seed=5)
    seen = record_trees(eng)
    check_lossless(eng, prompts, expected)
    assert {0, eng.num_spec_tokens} <= set(draws)
    assert any(len(t) < eng.num_spec_tokens for t, _ in seen)  # smaller trees when fewer drafts are allowed
    assert any(p is not None and max(Counter(p).values()) > 1 for _, p in seen)


def best_path(parents: list[int]) -> int:
    """Nodes on a tree's best path: from the root, each level's first kept child (the
    drafter's argmax: ``choose_nodes`` keeps creation order, children ranked best first)."""
    n, cur = 0, -1
    while cur in parents:
        cur = parents.index(cur)
        n += 1
    return n


@pytest.mark.parametrize("shape", [tree(2, 5, 6), tree(2, 3, 4), tree(3, 3, 8)])
def test_the_target_as_its_own_draft_accepts_the_whole_best_path(models, prompts, plain, shape):
    """Self-draft: the draft's argmax is the target's, so every round accepts exactly its
    tree's best path (the argmax child at every level), never less and never a sibling's;
    the tokens per step are that path + 1."""
    target, _ = models["random"]
    eng = engine(tiny_config(target, "draft_model", draft_dir=target, tree=shape))
    trees: dict[str, list] = {}
    propose, verified = eng.proposer.propose, eng.proposer.on_verified

    def spy_propose(reqs, step=None):
        prop = propose(reqs, step)
        for i, r in enumerate(reqs):
            if prop.token_ids[i]:
                trees.setdefault(r.seq.request_id, []).append(prop.parents[i])
        return prop

    accepted: dict[str, list[int]] = {}

    def spy_verified(seq, before, n, a):
        if n:
            accepted.setdefault(seq.request_id, []).append(a)
        verified(seq, before, n, a)

    eng.proposer.propose, eng.proposer.on_verified = spy_propose, spy_verified
    check_lossless(eng, prompts, plain["random"])
    rounds = 0
    for rid, got in accepted.items():
        expect = [best_path(p) for p in trees[rid][: len(got)]]
        assert got[:-1] == expect[:-1]  # the last round may stop at max_tokens
        assert got[-1] <= expect[-1]
        rounds += len(got)
    assert rounds > 10 and max(max(v) for v in accepted.values()) >= 2


def _draft_kv(eng, rid: str, n: int) -> torch.Tensor:
    p = eng.proposer
    table, bs = p.states[rid].block_table, p.runner.kv.block_size
    slots = torch.tensor([table[q // bs] * bs + q % bs for q in range(n)])
    return p.runner.kv.data[:, :, slots].clone()


def test_the_draft_cache_holds_the_chains_kv_at_committed_positions(models, prompts):
    """After every tree step (nodes stored past the committed tokens, accepted paths off
    the first nodes), the draft's K/V at the committed positions are a chain run's."""
    eng = engine(config(models, "bigram", tree=tree(3, 3, 8)))
    ref = engine(config(models, "bigram", k=3))
    checked, moved = follow_chain_cache(eng, ref, prompts[1], greedy(40), _draft_kv)
    assert checked == 10 and moved > 0


@pytest.mark.parametrize("calibrate", [False, True])
def test_layer_skip_drafts_trees(tiny_model_dirs, prompts, calibrate):
    """layer_skip's draft (the target without some layers) expands trees the same way:
    greedy output is plain decoding's, the trees branch, every block is freed."""
    model = tiny_model_dirs["llama"]
    expected = plain_outputs(model, prompts, MAX_TOKENS)
    kw = {"skip_ratio": 0.5, "skip_calibration_tokens": 16} if calibrate else {"skip_layers": [1]}
    eng = engine(tiny_config(model, "layer_skip", tree=tree(2, 3, 6), **kw))
    seen = record_trees(eng)
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == expected
    p = eng.proposer
    assert eng.blocks.num_free == eng.blocks.num_blocks and p.blocks.num_free == p.blocks.num_blocks
    assert p.inner.tree is not None and sum(o.spec.num_accepted_tokens for o in outs) > 0
    assert any(p is not None and max(Counter(p).values()) > 1 for _, p in seen)


def test_trees_beside_chains_in_one_batch_with_pard(models, prompts, plain, tmp_path):
    """Requests that need chains (logprobs) draft PARD's one-forward chains while their
    neighbours draft trees in the same rounds: greedy output is plain decoding's, chain
    rows carry no parents and tree rows do."""
    from test_pard import with_pard_token

    target, draft = models["random"]
    pard = with_pard_token(draft, tmp_path / "pard")
    eng = engine(tiny_config(target, "draft_model", draft_dir=pard, parallel_drafting=True, tree=tree(2, 3, 5)))
    assert eng.proposer.mask_token_id is not None
    shapes: dict[bool, int] = {True: 0, False: 0}
    mixed = 0
    propose = eng.proposer.propose

    def recording(reqs, step=None):
        nonlocal mixed
        prop = propose(reqs, step)
        kinds = set()
        for i, r in enumerate(reqs):
            if prop.token_ids[i]:
                is_tree = prop.parents is not None and prop.parents[i] is not None
                assert is_tree == r.tree
                shapes[is_tree] += 1
                kinds.add(is_tree)
        mixed += len(kinds) == 2
        return prop

    eng.proposer.propose = recording
    params = [greedy(MAX_TOKENS, logprobs=1) if n % 2 else greedy(MAX_TOKENS) for n in range(len(prompts))]
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain["random"]
    assert shapes[True] > 0 and shapes[False] > 0 and mixed > 0
    p = eng.proposer
    assert eng.blocks.num_free == eng.blocks.num_blocks and p.blocks.num_free == p.blocks.num_blocks


@pytest.fixture(scope="module")
def windowed_draft(tmp_path_factory):
    """A draft with a sliding window of 2 (Mistral): its keys outside the window must not count."""
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("windowed") / "draft", "mistral", seed=5, sliding_window=2)


def test_under_a_draft_window_a_topk1_tree_drafts_the_chain(models, prompts, plain, windowed_draft):
    """A windowed draft: a topk-1 tree 4 deep drafts the chain's tokens round for round, so
    each frontier node sees only the committed keys and ancestors inside the window, as the
    chain's positions do; a topk-2 tree under the window stays lossless."""
    target, _ = models["random"]
    runs = []
    for kw in ({"k": 4}, {"tree": tree(1, 4, 5)}, {"tree": tree(2, 4, 7)}):
        eng = engine(tiny_config(target, "draft_model", draft_dir=windowed_draft, **kw))
        assert eng.proposer.window == 2
        drafts = record_drafts(eng)
        check_lossless(eng, prompts, plain["random"])
        runs.append(drafts)
    assert runs[0] == runs[1] and len({tuple(d) for r in runs[0] for d in r if d}) > 3


def test_bf16_layer_skip_trees_on_the_fused_decoder_equal_plain(tiny_model_dirs, prompts):
    """bf16 on the CPU: layer_skip's draft runs on the fused decoder, its tree steps too (the
    decoder takes tree masks), and greedy output is plain bf16 decoding's exactly."""
    from specserve.executor.loader import default_cache_dir
    from specserve.kernels.cpu_decoder import KernelUnavailable, load_library

    try:
        load_library(default_cache_dir())
    except KernelUnavailable as e:
        pytest.skip(f"fused CPU decoder unavailable here: {e}")
    from specserve.config import validate_config

    def bf16(**kw):
        cfg = tiny_config(tiny_model_dirs["llama"], **kw)
        cfg.model.dtype = "bfloat16"
        cfg.engine.cpu_kernel = "fused"
        cfg.engine.num_prediction_tokens = 0
        return LLMEngine(validate_config(cfg))

    ref = bf16().generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    eng = bf16(method="layer_skip", skip_layers=[1], tree=tree(2, 3, 6))
    seen = record_trees(eng)
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert eng.proposer.fused is not None and eng.proposer.inner.runner.fused is not None
    assert any(p is not None and max(Counter(p).values()) > 1 for _, p in seen)
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    p = eng.proposer
    assert eng.blocks.num_free == eng.blocks.num_blocks and p.blocks.num_free == p.blocks.num_blocks
