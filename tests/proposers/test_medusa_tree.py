"""Medusa draft trees (``method.tree``): head d's top-k tokens are the candidates at depth
d + 1, grown EAGLE-2 style from the one hidden state.  Greedy output equals plain
decoding whatever the tree's shape (topk 1 is a chain), with a truncated draft
vocabulary, beside chunked prefills and with the drafts per step changing; the trees
branch when topk > 1; heads that predict a bigram target are accepted, a tree at least
as much as the chain verifying as many tokens; requests that need chain verification
draft chains of at most one token per head; sampled trees under probabilistic
verification keep the target's distribution; a depth past the heads is a one-line
error.  Heads are built by test_medusa's builders."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from eagle_heads import make_bigram_target  # noqa: E402
from engine_utils import draw_k_every_step, greedy, random_prompts, run, tiny_config  # noqa: E402
from engine_utils import one_thread  # noqa: E402, F401 (an autouse fixture: one torch thread)
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.errors import ConfigError  # noqa: E402
from specserve.methods import TreeConfig  # noqa: E402
from specserve.proposers.base import DraftRequest  # noqa: E402
from specserve.proposers.medusa import MedusaProposer, load_medusa  # noqa: E402
from specserve.request import SamplingParams  # noqa: E402
from test_medusa import (PROMPT, V_SMALL, Head, bigram_map, exact_marginals, oracle_heads,  # noqa: E402
                         random_heads, residual_blocks, tv, write_layout, write_medusa)
from tiny_models import make_tiny_model  # noqa: E402
from tree_utils import engine, record_trees, tree  # noqa: E402

MAX_TOKENS = 20
NUM_HEADS = 4

def check_tree(toks: list[int], parents: list[int] | None, shape: dict) -> list[int]:
    """A well-formed tree of ``shape``: parents first, at most topk children per node, no
    deeper than depth.  Returns each node's depth."""
    assert parents is not None and len(parents) == len(toks) <= shape["num_draft_tokens"] - 1
    assert all(-1 <= p < i for i, p in enumerate(parents))
    assert max(Counter(parents).values()) <= shape["topk"]
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    assert max(depth) <= shape["depth"]
    return depth


def reference_tree(first, expand, k: int, depth: int, nodes: int,
                   frontiers: list[list[int]] | None = None) -> tuple[list[int], list[int]]:
    """EAGLE-2 by hand, one node at a time: ``first()`` -> (log-probabilities (V,), state)
    at the root, ``expand(d, state, token)`` -> the same for a node of depth d (its
    children carry the returned state).  The frontier of each level is its k best nodes;
    the kept nodes are the ``nodes`` best of all, listed in creation order.  Returns
    (tokens, parents); appends each frontier past level 1 (its nodes' parents, pool
    indices) to ``frontiers``."""
    pool: list[tuple[float, int, int, object]] = []  # (score, token, parent's pool index, state)
    lp, state = first()
    score, tok = lp.topk(k)
    level = list(range(k))
    pool += [(float(score[j]), int(tok[j]), -1, state) for j in range(k)]
    for d in range(1, depth):
        frontier = sorted(level, key=lambda n: -pool[n][0])[:k]
        if frontiers is not None and d > 1:
            frontiers.append([pool[n][2] for n in frontier])
        level = []
        for n in frontier:
            lp, state = expand(d, pool[n][3], pool[n][1])
            score, tok = lp.topk(k)
            for j in range(k):
                level.append(len(pool))
                pool.append((pool[n][0] + float(score[j]), int(tok[j]), n, state))
    keep = sorted(sorted(range(len(pool)), key=lambda n: -pool[n][0])[:nodes])
    where = {n: i for i, n in enumerate(keep)}
    return [pool[n][1] for n in keep], [where[pool[n][2]] if pool[n][2] >= 0 else -1 for n in keep]


def fake_target(num_layers: int, vocab: int) -> SimpleNamespace:
    arch = SimpleNamespace(num_layers=num_layers, vocab_size=vocab)
    return SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, arch=arch)


def fake_requests(feats: torch.Tensor, want: list[int], last_tokens: list[int]) -> tuple[list[DraftRequest], object]:
    """Requests whose last hidden row is row 2b + 1 of ``feats`` (T, H) (the target's final
    states, layer ``num_layers`` of the step's aux), and the step."""
    reqs = [DraftRequest(SimpleNamespace(token_ids=[3, t], num_output_tokens=1, request_id=str(b)), w,
                         hidden_rows=[2 * b, 2 * b + 1]) for b, (w, t) in enumerate(zip(want, last_tokens))]
    return reqs, SimpleNamespace(aux={2: feats})


BY_HAND = [tree(2, 3, 11), tree(3, 3, 12), tree(2, 3, 6), tree(3, 2, 8)]  # the first two keep the whole pool


def check_frontiers(frontiers: list[list[int]]) -> None:
    """The shapes exercised what a wrong frontier would change: some frontier past level 1
    holds siblings, some holds nodes of different parents."""
    assert any(len(set(f)) < len(f) for f in frontiers) and any(len(set(f)) > 1 for f in frontiers)


@pytest.mark.parametrize("shape", BY_HAND, ids=[f"topk{s['topk']}-depth{s['depth']}-n{s['num_draft_tokens']}"
                                                for s in BY_HAND])
def test_trees_are_eagle2_by_hand(root, shape):
    """Every request's tree is the one built node by node (head d's top-k under each
    frontier node; the best nodes kept), whatever the others in the batch want."""
    model, token_map = load_medusa(str(write_layout(root / "by-hand", "vllm-truncated-vocab",
                                                    random_heads(3, 1, seed=12))), "method.model", 64, 512)
    n = shape["num_draft_tokens"] - 1
    prop = MedusaProposer(model, token_map, fake_target(2, 512), n, False, TreeConfig(**shape))
    want = [n, 3, n, 1, n, 2]
    feats = torch.randn(2 * len(want), 64, generator=torch.Generator().manual_seed(1))
    reqs, step = fake_requests(feats, want, [7] * len(want))
    out = prop.propose(reqs, step)
    depth = min(shape["depth"], max(want))
    frontiers: list[list[int]] = []
    with torch.no_grad():
        for b, w in enumerate(want):
            h = feats[2 * b + 1 : 2 * b + 2]

            def head(d, *_):
                return torch.log_softmax(model(d, h)[0], -1), None

            toks, parents = reference_tree(lambda: head(0), head, shape["topk"], depth, w, frontiers)
            assert out.token_ids[b] == token_map[toks].tolist() and out.parents[b] == parents, b
    if n >= 10:
        check_frontiers(frontiers)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("medusa-tree")


@pytest.fixture(scope="module")
def exact_bigram(root) -> Path:
    return make_bigram_target(root / "bigram", leak=0.0)


@pytest.fixture(scope="module")
def leaky(root) -> Path:
    """The bigram target with a little attention and MLP: the oracle heads are partly right."""
    return make_bigram_target(root / "leaky", leak=0.05)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, seed=31)


@pytest.fixture(scope="module")
def oracle(exact_bigram, prompts):
    return oracle_heads(exact_bigram, prompts, num_heads=NUM_HEADS, num_layers=1)


@pytest.fixture(scope="module")
def leaky_plain(leaky, prompts):
    return run(engine(tiny_config(leaky)), prompts, [greedy(MAX_TOKENS) for _ in prompts])


def _lossless(eng, prompts, expected, params=None):
    outs = eng.generate(prompts, params or [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == expected
    assert eng.blocks.num_free == eng.blocks.num_blocks  # every KV block freed
    return outs


SHAPES = [tree(1, 4, 5), tree(2, 3, 6), tree(3, 2, 8), tree(2, 4, 8)]


@pytest.mark.parametrize("layout", ["medusa", "vllm-truncated-vocab"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"topk{s['topk']}-depth{s['depth']}-n{s['num_draft_tokens']}"
                                               for s in SHAPES])
def test_greedy_trees_equal_plain_decoding(root, leaky, prompts, leaky_plain, oracle, layout, shape):
    heads, _ = oracle
    head = write_layout(root / f"greedy-{layout}", layout, heads)
    eng = engine(tiny_config(leaky, "medusa", draft_dir=head, tree=shape))
    assert eng.num_spec_tokens == shape["num_draft_tokens"] - 1  # may exceed the heads: a tree's node count
    seen = record_trees(eng)
    outs = _lossless(eng, prompts, leaky_plain)
    assert 0 < sum(o.spec.num_accepted_tokens for o in outs) < sum(o.spec.num_draft_tokens for o in outs)
    for toks, parents in seen:
        depth = check_tree(toks, parents, shape)
        # Medusa: every node at one depth chose among the same head's top-k
        by_depth: dict[int, set[int]] = {}
        for t, d in zip(toks, depth):
            by_depth.setdefault(d, set()).add(t)
        assert all(len(ts) <= shape["topk"] for ts in by_depth.values())
    full = [p for t, p in seen if len(t) == shape["num_draft_tokens"] - 1]
    assert full
    assert any(max(Counter(p).values()) > 1 for p in full) == (shape["topk"] > 1)  # branching iff topk > 1


def test_trees_beside_chunked_prefill_and_changing_drafts(root, leaky, oracle):
    """A ragged batch: long prompts prefill in chunks while others verify trees, and the
    drafts per step (the tree's node budget) change at random, down to none."""
    prompts = random_prompts(6, seed=8, lo=3, hi=60)
    expected = run(engine(tiny_config(leaky)), prompts, [greedy(MAX_TOKENS) for _ in prompts])
    head = write_layout(root / "ragged", "vllm", oracle[0])
    shape = tree(2, 3, 7)
    cfg = tiny_config(leaky, "medusa", draft_dir=head, tree=shape)
    cfg.engine.max_num_batched_tokens = 24
    cfg.engine.long_prefill_token_threshold = 16
    eng = engine(cfg)
    draws = draw_k_every_step(eng, eng.num_spec_tokens, seed=5)
    seen = record_trees(eng)
    outs = _lossless(eng, prompts, expected)
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    assert {0, eng.num_spec_tokens} <= set(draws)
    for toks, parents in seen:
        check_tree(toks, parents, shape)
    assert any(len(t) < eng.num_spec_tokens for t, _ in seen)  # smaller trees when fewer drafts are allowed


def _acceptance_length(eng, prompts, expected) -> float:
    outs = _lossless(eng, prompts, expected)
    return 1 + sum(o.spec.num_accepted_tokens for o in outs) / sum(o.spec.num_drafts for o in outs)


def test_oracle_heads_are_accepted_and_trees_accept_at_least_chains(root, exact_bigram, prompts, oracle):
    heads, chains = oracle
    expected = run(engine(tiny_config(exact_bigram)), prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert chains == expected  # the heads were built from the target's own greedy choices
    head = write_layout(root / "oracle", "medusa", heads)
    chain = _acceptance_length(engine(tiny_config(exact_bigram, "medusa", k=4, draft_dir=head)), prompts, expected)
    assert chain > 3
    as_chain = _acceptance_length(engine(tiny_config(exact_bigram, "medusa", draft_dir=head, tree=tree(1, 4, 5))),
                                  prompts, expected)
    assert as_chain == chain  # a topk-1 tree is the chain
    for shape in (tree(2, 4, 5), tree(3, 4, 5)):  # the same 5 verified tokens, siblings beside the chain
        wide = _acceptance_length(engine(tiny_config(exact_bigram, "medusa", draft_dir=head, tree=shape)),
                                  prompts, expected)
        assert 1 < chain <= wide, (shape, chain, wide)


def misled_heads(target_dir: Path, prompts, heads: list[Head], chains: list[list[int]]) -> list[Head]:
    """The oracle heads with head 0 misled after even tokens: there its best guess is a
    decoy (logit 11) and the right token its second (10); the other heads stay exact."""
    h, f = bigram_map(target_dir)
    tokens = sorted({p[-1] for p in prompts} | {t for c in chains for t in c})  # the states the heads read
    z = residual_blocks(h[tokens], heads[0].blocks)
    want = f[f[torch.tensor(tokens)]]
    rows, vocab = torch.arange(len(tokens)), f.numel()
    y = torch.zeros(len(tokens), vocab, dtype=torch.float64)
    y[rows, want] = 10.0
    even = torch.tensor([t % 2 == 0 for t in tokens])
    y[rows[even], ((want + 1) % vocab)[even]] = 11.0
    return [Head(heads[0].blocks, torch.linalg.lstsq(z, y).solution.T.float().contiguous())] + heads[1:]


def test_siblings_recover_a_misled_head(root, exact_bigram, prompts, oracle):
    """Head 0's first guess is wrong after even tokens: a chain loses the round there, a
    tree keeps the right token as the root's second child and its subtree."""
    heads, chains = oracle
    expected = run(engine(tiny_config(exact_bigram)), prompts, [greedy(MAX_TOKENS) for _ in prompts])
    head = write_layout(root / "misled", "medusa", misled_heads(exact_bigram, prompts, heads, chains))
    chain = _acceptance_length(engine(tiny_config(exact_bigram, "medusa", k=NUM_HEADS, draft_dir=head)),
                               prompts, expected)
    wide = _acceptance_length(engine(tiny_config(exact_bigram, "medusa", draft_dir=head, tree=tree(2, 4, 8))),
                              prompts, expected)
    assert 1 < chain < wide, (chain, wide)


def test_requests_that_need_chain_verification_draft_chains(root, leaky, prompts, leaky_plain, oracle):
    """K = 7 > 4 heads with a tree; a request with logprobs or logit_bias drafts a chain,
    one token per head at most, beside trees."""
    head = write_layout(root / "chains", "medusa", oracle[0])
    eng = engine(tiny_config(leaky, "medusa", draft_dir=head, tree=tree(3, 2, 8)))
    assert eng.num_spec_tokens == 7
    seen = record_trees(eng)
    params = [greedy(MAX_TOKENS, logprobs=2), greedy(MAX_TOKENS, logit_bias={7: 0.0}), greedy(MAX_TOKENS)]
    _lossless(eng, prompts[:3], leaky_plain[:3], params)
    chains = [t for t, p in seen if p is None]
    assert chains and max(len(t) for t in chains) == NUM_HEADS
    assert any(p is not None for _, p in seen)  # the plain request drafted trees in the same steps


def test_depth_past_the_heads_is_one_line(root, leaky, oracle):
    head = write_layout(root / "depth", "medusa", oracle[0])
    with pytest.raises(ConfigError) as e:
        engine(tiny_config(leaky, "medusa", draft_dir=head, tree=tree(1, 5, 6)))
    assert str(e.value) == ("method.tree.depth: 5 exceeds the Medusa checkpoint's 4 heads (head d drafts depth "
                            "d + 1); use depth <= 4")


# --------------------------------------------------------------------------- sampling

N = 3000


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_sampled_trees_keep_the_target_distribution(root, method):
    """Trees carry no q: sampled requests verify them target-only under either method,
    and the output distribution is plain sampling's; a seeded request reproduces alone."""
    tdir = make_tiny_model(root / f"small-{method}", "llama", seed=5, vocab_size=V_SMALL, num_key_value_heads=4)
    head = write_medusa(root / f"small-head-{method}", "vllm", random_heads(2, 1, seed=8, rows=V_SMALL),
                        config_over={"vocab_size": V_SMALL})
    cfg = tiny_config(tdir, "medusa", draft_dir=head, num_blocks=4096, tree=tree(3, 2, 6),
                      rejection_sample_method=method)
    cfg.engine.max_num_seqs = 512
    eng = engine(cfg)
    seen = record_trees(eng)
    outs = eng.generate([PROMPT] * N, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i)
                                       for i in range(N)])
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert seen and all(p is not None for _, p in seen)
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    p2, p3 = exact_marginals(tdir, 1.0)
    for pos, p in ((1, p2), (2, p3)):
        c = torch.bincount(torch.tensor([o.token_ids[pos] for o in outs]), minlength=V_SMALL).double()
        assert tv(c, p) < 0.05, (pos, tv(c, p))  # sampling noise at N=3000 on 16 outcomes: about 0.03
    alone = eng.generate([PROMPT], [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=17)])
    assert alone[0].token_ids == outs[17].token_ids
