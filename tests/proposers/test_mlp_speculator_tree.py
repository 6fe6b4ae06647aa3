"""MLP speculator draft trees (``method.tree``): stage d runs over the frontier, each node
with its own state and token, EAGLE-2 style.  Greedy output equals plain decoding
whatever the tree's shape (topk 1 is a chain), beside chunked prefills and with the
drafts per step changing; the trees branch when topk > 1; a speculator that predicts a
bigram target is accepted, a tree at least as much as the chain verifying as many
tokens, and a tree's siblings recover where stage 0's first guess is wrong; requests that
need chain verification draft chains of at most n_predict tokens; sampled trees keep the
target's distribution; a depth past n_predict is a one-line error.  Checkpoints are
built by test_mlp_speculator's builder."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from eagle_heads import make_bigram_target  # noqa: E402
from engine_utils import draw_k_every_step, greedy, random_prompts, run, tiny_config  # noqa: E402
from engine_utils import one_thread  # noqa: E402, F401 (an autouse fixture: one torch thread)
from safetensors.torch import load_file, save_file  # noqa: E402
from specserve.errors import ConfigError  # noqa: E402
from specserve.methods import TreeConfig  # noqa: E402
from specserve.proposers.mlp_speculator import MLPSpeculatorProposer, load_mlp_speculator  # noqa: E402
from specserve.request import SamplingParams  # noqa: E402
from test_medusa import PROMPT, V_SMALL, bigram_map, exact_marginals, tv  # noqa: E402
from test_medusa_tree import (BY_HAND, MAX_TOKENS, SHAPES, _acceptance_length, _lossless,  # noqa: E402
                              check_frontiers, check_tree, engine, fake_requests, fake_target, record_trees,
                              reference_tree, tree)
from test_mlp_speculator import make_speculator  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

N_PREDICT = 4
INNER = 64


def oracle_speculator(out: Path, target_dir: Path, prompts, misled: bool = False) -> tuple[Path, list[list[int]]]:
    """A speculator whose every stage maps its input token v to f(v), the bigram target's
    next token, for the tokens the greedy runs of ``prompts`` read: proj zeroed (the
    state drops out), then each stage's head solved by least squares so that its logits
    are 10 at f(v) and 0 elsewhere.  ``misled``: stage 0 puts a decoy first (11) after
    even tokens, the right token second.  Also returns the greedy outputs f implies."""
    _, f = bigram_map(target_dir)
    chains = []
    for p in prompts:
        t, chain = p[-1], []
        for _ in range(MAX_TOKENS):
            t = int(f[t])
            chain.append(t)
        chains.append(chain)
    tokens = sorted({p[-1] for p in prompts} | {t for c in chains for t in c})
    assert len(tokens) <= INNER - 8, f"{len(tokens)} states in {INNER} dimensions: the least squares is not exact"
    make_speculator(out, n_predict=N_PREDICT, inner=INNER, seed=4)
    sd = load_file(str(out / "model.safetensors"))
    model_cfg = json.loads((out / "config.json").read_text())
    vocab = model_cfg["vocab_size"]
    state_weight = 0.5 ** (0.5 / N_PREDICT)
    emb_weight = ((1 - state_weight**2) * (INNER / 2)) ** 0.5
    v = torch.tensor(tokens)
    rows = torch.arange(len(tokens))
    for i in range(N_PREDICT):
        sd[f"proj.{i}.weight"] = torch.zeros_like(sd[f"proj.{i}.weight"])
        s = sd[f"emb.{i}.weight"][v].double() * (emb_weight / state_weight)
        z = F.gelu(F.layer_norm(s, (INNER,), sd[f"ln.{i}.weight"].double(), sd[f"ln.{i}.bias"].double(), 1e-6))
        y = torch.zeros(len(tokens), vocab, dtype=torch.float64)
        y[rows, f[v]] = 10.0
        if misled and i == 0:
            even = v % 2 == 0
            y[rows[even], ((f[v] + 1) % vocab)[even]] = 11.0
        sd[f"head.{i}.weight"] = torch.linalg.lstsq(z, y).solution.T.float().contiguous()
    save_file(sd, str(out / "model.safetensors"))
    return out, chains


@pytest.mark.parametrize("shape", BY_HAND, ids=[f"topk{s['topk']}-depth{s['depth']}-n{s['num_draft_tokens']}"
                                                for s in BY_HAND])
def test_trees_are_eagle2_by_hand(tmp_path, shape):
    """Every request's tree is the one built node by node, each node's stage run on its
    own path's state and token, whatever the others in the batch want."""
    model = load_mlp_speculator(str(make_speculator(tmp_path / "spec", seed=6)), "method.model", 64, 512)
    n = shape["num_draft_tokens"] - 1
    prop = MLPSpeculatorProposer(model, fake_target(2, 512), n, False, TreeConfig(**shape))
    want = [n, 3, n, 1, n, 2]
    feats = torch.randn(2 * len(want), 64, generator=torch.Generator().manual_seed(1))
    reqs, step = fake_requests(feats, want, [7, 8, 9, 10, 11, 12])
    out = prop.propose(reqs, step)
    depth = min(shape["depth"], max(want))
    frontiers: list[list[int]] = []

    def stage(d, state, token):
        state, logits = model.stage(d, state, torch.tensor([token]))
        return torch.log_softmax(logits[0], -1), state

    with torch.no_grad():
        for b, w in enumerate(want):
            first = model.first_state(feats[2 * b + 1 : 2 * b + 2])
            toks, parents = reference_tree(lambda: stage(0, first, reqs[b].seq.token_ids[-1]), stage,
                                           shape["topk"], depth, w, frontiers)
            assert out.token_ids[b] == toks and out.parents[b] == parents, b
    if n >= 10:
        check_frontiers(frontiers)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlp-tree")


@pytest.fixture(scope="module")
def exact_bigram(root) -> Path:
    return make_bigram_target(root / "bigram", leak=0.0)


@pytest.fixture(scope="module")
def leaky(root) -> Path:
    """The bigram target with a little attention and MLP: the oracle is partly right."""
    return make_bigram_target(root / "leaky", leak=0.05)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, seed=31)


@pytest.fixture(scope="module")
def oracle(root, exact_bigram, prompts) -> tuple[Path, list[list[int]]]:
    return oracle_speculator(root / "oracle", exact_bigram, prompts)


@pytest.fixture(scope="module")
def leaky_plain(leaky, prompts):
    return run(engine(tiny_config(leaky)), prompts, [greedy(MAX_TOKENS) for _ in prompts])



@pytest.mark.parametrize("shape", SHAPES, ids=[f"topk{s['topk']}-depth{s['depth']}-n{s['num_draft_tokens']}"
                                               for s in SHAPES])
def test_greedy_trees_equal_plain_decoding(leaky, prompts, leaky_plain, oracle, shape):
    eng = engine(tiny_config(leaky, "mlp_speculator", draft_dir=oracle[0], tree=shape))
    assert eng.num_spec_tokens == shape["num_draft_tokens"] - 1  # may exceed n_predict: a tree's node count
    seen = record_trees(eng)
    outs = _lossless(eng, prompts, leaky_plain)
    assert 0 < sum(o.spec.num_accepted_tokens for o in outs) < sum(o.spec.num_draft_tokens for o in outs)
    for toks, parents in seen:
        check_tree(toks, parents, shape)
    full = [p for t, p in seen if len(t) == shape["num_draft_tokens"] - 1]
    assert full
    assert any(max(p.count(n) for n in set(p)) > 1 for p in full) == (shape["topk"] > 1)  # branching iff topk > 1


def test_random_speculator_trees_equal_plain_decoding(root, leaky, prompts, leaky_plain):
    """Untrained stages (tied, scaled input): node states differ per branch, output is plain decoding's."""
    spec = make_speculator(root / "random", n_predict=3, tie=True, scale_input=True, seed=1)
    shape = tree(3, 3, 8)
    eng = engine(tiny_config(leaky, "mlp_speculator", draft_dir=spec, tree=shape))
    seen = record_trees(eng)
    _lossless(eng, prompts, leaky_plain)
    assert seen
    for toks, parents in seen:
        check_tree(toks, parents, shape)


def test_trees_beside_chunked_prefill_and_changing_drafts(leaky, oracle):
    """A ragged batch: long prompts prefill in chunks while others verify trees, and the
    drafts per step (the tree's node budget) change at random, down to none."""
    prompts = random_prompts(6, seed=8, lo=3, hi=60)
    expected = run(engine(tiny_config(leaky)), prompts, [greedy(MAX_TOKENS) for _ in prompts])
    shape = tree(2, 3, 7)
    cfg = tiny_config(leaky, "mlp_speculator", draft_dir=oracle[0], tree=shape)
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


def test_an_oracle_is_accepted_and_trees_accept_at_least_chains(exact_bigram, prompts, oracle):
    spec, chains = oracle
    expected = run(engine(tiny_config(exact_bigram)), prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert chains == expected  # the stages were built from the target's own greedy choices
    chain = _acceptance_length(engine(tiny_config(exact_bigram, "mlp_speculator", k=N_PREDICT, draft_dir=spec)),
                               prompts, expected)
    assert chain > 3
    as_chain = _acceptance_length(engine(tiny_config(exact_bigram, "mlp_speculator", draft_dir=spec,
                                                     tree=tree(1, 4, 5))), prompts, expected)
    assert as_chain == chain  # a topk-1 tree is the chain
    for shape in (tree(2, 4, 5), tree(3, 4, 5)):  # the same 5 verified tokens, siblings beside the chain
        wide = _acceptance_length(engine(tiny_config(exact_bigram, "mlp_speculator", draft_dir=spec, tree=shape)),
                                  prompts, expected)
        assert 1 < chain <= wide, (shape, chain, wide)


def test_siblings_recover_a_misled_stage(root, exact_bigram, prompts):
    """Stage 0's first guess is wrong after even tokens: a chain loses the round there, a
    tree keeps the right token as the root's second child, and its subtree from that
    node's own state."""
    spec, _ = oracle_speculator(root / "misled", exact_bigram, prompts, misled=True)
    expected = run(engine(tiny_config(exact_bigram)), prompts, [greedy(MAX_TOKENS) for _ in prompts])
    chain = _acceptance_length(engine(tiny_config(exact_bigram, "mlp_speculator", k=N_PREDICT, draft_dir=spec)),
                               prompts, expected)
    wide = _acceptance_length(engine(tiny_config(exact_bigram, "mlp_speculator", draft_dir=spec,
                                                 tree=tree(2, 4, 8))), prompts, expected)
    assert 1 < chain < wide, (chain, wide)


def test_requests_that_need_chain_verification_draft_chains(leaky, prompts, leaky_plain, oracle):
    """K = 7 > n_predict with a tree; a request with logprobs or logit_bias drafts a chain
    of at most n_predict tokens, beside trees."""
    eng = engine(tiny_config(leaky, "mlp_speculator", draft_dir=oracle[0], tree=tree(3, 2, 8)))
    assert eng.num_spec_tokens == 7
    seen = record_trees(eng)
    params = [greedy(MAX_TOKENS, logprobs=2), greedy(MAX_TOKENS, logit_bias={7: 0.0}), greedy(MAX_TOKENS)]
    _lossless(eng, prompts[:3], leaky_plain[:3], params)
    chains = [t for t, p in seen if p is None]
    assert chains and max(len(t) for t in chains) == N_PREDICT
    assert any(p is not None for _, p in seen)


def test_depth_past_n_predict_is_one_line(leaky, oracle):
    with pytest.raises(ConfigError) as e:
        engine(tiny_config(leaky, "mlp_speculator", draft_dir=oracle[0], tree=tree(1, 5, 6)))
    assert str(e.value) == "method.tree.depth: 5 exceeds the MLP speculator's n_predict (4); use depth <= 4"


N = 3000


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_sampled_trees_keep_the_target_distribution(root, method):
    """Trees carry no q: sampled requests verify them target-only under either method,
    and the output distribution is plain sampling's; a seeded request reproduces alone."""
    tdir = make_tiny_model(root / f"small-{method}", "llama", seed=5, vocab_size=V_SMALL, num_key_value_heads=4)
    hidden = json.loads((tdir / "config.json").read_text())["hidden_size"]
    spec = make_speculator(root / f"small-spec-{method}", n_predict=2, inner=32, emb_dim=hidden, vocab=V_SMALL,
                           seed=2)
    cfg = tiny_config(tdir, "mlp_speculator", draft_dir=spec, num_blocks=4096, tree=tree(3, 2, 6),
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
