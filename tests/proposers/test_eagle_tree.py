"""EAGLE / EAGLE-3 draft trees (``method.tree``): EAGLE-2 dynamic trees verified in one
target forward.  Greedy output equals plain decoding whatever the tree's shape (topk 1
is a chain), beside chunked prefills and with the drafts per step changing; heads that
predict well are accepted, and a tree accepts at least what a chain does; sampled
output keeps the target's distribution; after each step the target's cache holds
exactly plain decoding's K/V at the committed positions (the accepted path moved
into place); requests that need chain verification draft chains."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from eagle_heads import make_bigram_target, write_head  # noqa: E402
from engine_utils import draw_k_every_step, greedy, random_prompts, run, tiny_config  # noqa: E402
from engine_utils import one_thread  # noqa: E402, F401 (an autouse fixture: one torch thread)
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.executor.batch import SeqInput  # noqa: E402
from specserve.request import SamplingParams  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402
from tree_utils import engine, record_trees, tree  # noqa: E402

@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eagle-tree")


@pytest.fixture(scope="module")
def target(root) -> Path:
    """A leaky bigram model: an oracle head's best guess is often right, often not."""
    return make_bigram_target(root / "target", leak=0.3)


@pytest.fixture(scope="module")
def heads(root, target) -> dict[str, Path]:
    """Oracle heads of the bigram part; EAGLE-3's over a reduced draft vocabulary."""
    from safetensors.torch import load_file

    lm = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    return {"eagle": write_head(root / "head-eagle", "eagle", oracle=True),
            "eagle3": write_head(root / "head-eagle3", "eagle3", oracle=True, aux_ids=[0, 1, 1], draft_vocab=300,
                                 target_lm_head=lm)}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, seed=3)


@pytest.fixture(scope="module")
def plain(target, prompts):
    return run(engine(tiny_config(target)), prompts, [greedy(24) for _ in prompts])


def _check_lossless(eng, prompts, expected, params=None):
    outs = eng.generate(prompts, params or [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == expected
    assert eng.blocks.num_free == eng.blocks.num_blocks  # every KV block freed
    assert not eng.proposer.states
    return outs


SHAPES = [tree(1, 4, 5), tree(2, 3, 6), tree(3, 2, 8), tree(4, 4, 12)]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"topk{s['topk']}-depth{s['depth']}-n{s['num_draft_tokens']}"
                                               for s in SHAPES])
def test_greedy_trees_equal_plain_decoding(target, heads, prompts, plain, method, shape):
    eng = engine(tiny_config(target, method, draft_dir=heads[method], tree=shape))
    assert eng.num_spec_tokens == shape["num_draft_tokens"] - 1
    seen = record_trees(eng)
    outs = _check_lossless(eng, prompts, plain)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert 0 < accepted < sum(o.spec.num_draft_tokens for o in outs)
    k = shape["topk"]
    for toks, parents in seen:
        assert parents is not None and len(parents) == len(toks) <= shape["num_draft_tokens"] - 1
        assert all(-1 <= p < i for i, p in enumerate(parents))  # parents first
        kids = Counter(parents)
        assert max(kids.values()) <= k
        depth = [0] * len(parents)
        for i, p in enumerate(parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        assert max(depth) <= shape["depth"]
    # the trees branch where topk > 1 (a full round keeps num_draft_tokens - 1 nodes)
    full = [p for t, p in seen if len(t) == shape["num_draft_tokens"] - 1]
    assert full
    assert any(max(Counter(p).values()) > 1 for p in full) == (k > 1)


def test_trees_beside_chunked_prefill_and_changing_drafts(target, heads):
    """A ragged batch: long prompts prefill in chunks while others verify trees, and the
    drafts per step (the tree's node budget) change at random, down to none."""
    prompts = random_prompts(6, seed=8, lo=3, hi=60)
    expected = run(engine(tiny_config(target)), prompts, [greedy(20) for _ in prompts])
    cfg = tiny_config(target, "eagle3", draft_dir=heads["eagle3"], tree=tree(2, 3, 7))
    cfg.engine.max_num_batched_tokens = 24
    cfg.engine.long_prefill_token_threshold = 16
    eng = engine(cfg)
    draws = draw_k_every_step(eng, eng.num_spec_tokens, seed=5)
    seen = record_trees(eng)
    _check_lossless(eng, prompts, expected, [greedy(20) for _ in prompts])
    assert {0, eng.num_spec_tokens} <= set(draws)
    assert any(len(t) < eng.num_spec_tokens for t, _ in seen)  # smaller trees when fewer drafts are allowed


# --------------------------------------------------------------------------- acceptance


@pytest.fixture(scope="module")
def oracles(root) -> dict[str, Path]:
    return {"eagle": write_head(root / "oracle-eagle", "eagle", oracle=True),
            "eagle3": write_head(root / "oracle-eagle3", "eagle3", oracle=True, aux_ids=[0, 1, 1])}


def _acceptance_length(eng, prompts, expected) -> float:
    outs = _check_lossless(eng, prompts, expected)
    return 1 + sum(o.spec.num_accepted_tokens for o in outs) / sum(o.spec.num_drafts for o in outs)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_oracle_head_is_accepted_and_trees_accept_at_least_chains(root, oracles, prompts, method):
    # An exact bigram target: the oracle's chains are all accepted; a topk-1 tree is that chain.
    exact = make_bigram_target(root / "bigram", leak=0.0)
    expected = run(engine(tiny_config(exact)), prompts, [greedy(24) for _ in prompts])
    chain = _acceptance_length(engine(tiny_config(exact, method, k=4, draft_dir=oracles[method])), prompts, expected)
    assert chain > 4
    as_tree = engine(tiny_config(exact, method, draft_dir=oracles[method], tree=tree(1, 4, 5)))
    assert _acceptance_length(as_tree, prompts, expected) == chain
    # A leaky target: the oracle's guess is often wrong, and a tree's siblings catch some of it.
    leaky = make_bigram_target(root / "leaky", leak=0.3)  # the module's target, another copy
    expected = run(engine(tiny_config(leaky)), prompts, [greedy(24) for _ in prompts])
    chain = _acceptance_length(engine(tiny_config(leaky, method, k=4, draft_dir=oracles[method])), prompts, expected)
    wide = _acceptance_length(engine(tiny_config(leaky, method, draft_dir=oracles[method], tree=tree(3, 3, 5))),
                              prompts, expected)
    assert 1 < chain < wide, (chain, wide)


def test_adaptive_speculation_switches_between_chains_and_trees_losslessly(target, oracles, prompts, plain):
    """engine.speculation=adaptive with a tree: each step picks off, a chain or a tree.
    Costs are injected (the engine's measured seconds are ignored): proposing a tree is
    cheap for six steps, then dear for six, and so on, so the choice flips between tree
    rounds and chain rounds; greedy output stays plain decoding's, every block freed."""
    from specserve.engine.spec_control import _Ema

    eng = engine(tiny_config(target, "eagle3", draft_dir=oracles["eagle3"], tree=tree(2, 3, 7),
                             speculation="adaptive"))
    c = eng.spec_control
    assert c.adaptive and c.trees
    c.warmup_rounds = 4.0
    steps, picks = [0], []
    choose = c.choose

    def observe_step(batch_size, q, step_s, propose_s):  # injected costs: no clock involved
        steps[0] += 1
        dear = (steps[0] // 6) % 2 == 1
        buckets = {c.bucket(n) for n in range(1, len(prompts) + 1)}  # verifying costs what decoding does
        c.step_cost = {(b, n): _Ema(0.010) for b in buckets for n in range(1, c.num_spec_tokens + 2)}
        c.propose_cost = {k: _Ema(0.001) for k in c.candidates}
        c.tree_propose_cost = {(k, d): _Ema(1.0 if dear else 0.001) for k in c.candidates for d in c.tree_depths}

    def recording_choose(batch_size):
        pick = choose(batch_size)
        picks.append((int(pick), pick.tree))
        return pick

    c.observe_step, c.choose = observe_step, recording_choose
    seen = record_trees(eng)
    gauges = []  # what the metrics' gauges are set from: (drafts, trees) chosen per step

    class Listener:
        def on_step(self, stats):
            gauges.append((stats.num_speculative_tokens, stats.draft_trees))

        def on_request_finished(self, stats):
            pass

    eng.listeners.append(Listener())
    _check_lossless(eng, prompts, plain)
    shapes = [tree for k, tree in picks if k > 0]
    assert True in shapes and False in shapes
    assert sum(a != b for a, b in zip(shapes, shapes[1:])) >= 3  # switched back and forth
    assert any(p is None for _, p in seen) and any(p is not None for _, p in seen)  # both drafted
    assert sum(c.tree_rounds.values()) > 0 and c.reached[0] > 0  # each shape learned from its own rounds
    # exported with each step: the choice behind its latest proposals (the previous step's)
    assert gauges[0] == (eng.num_spec_tokens, True) and gauges[1:] == picks[: len(gauges) - 1]


# --------------------------------------------------------------------------- the target's cache


def _committed_kv(eng, rid: str, n: int) -> torch.Tensor:
    """The target layers' K/V of positions 0..n-1 of request ``rid`` (by its block table)."""
    seq = eng.requests[rid].seq
    bs = eng.kv.block_size
    slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(n)])
    return eng.kv.data[: eng.target.arch.num_layers, :, slots].clone()


def test_the_accepted_path_leaves_no_stale_kv(target, heads, prompts):
    """After every tree step the target's K/V at the committed positions are plain
    decoding's (the accepted nodes moved to the positions after their root)."""
    prompt = prompts[0]
    eng = engine(tiny_config(target, "eagle", draft_dir=heads["eagle"], tree=tree(3, 3, 8)))
    ref = engine(tiny_config(target))
    eng.add_request("t", prompt, greedy(40))
    ref.add_request("r", prompt, greedy(40))
    moved = checked = 0
    compact = eng._compact_trees

    def spy(scheduled):
        nonlocal moved
        moved += sum(1 for s in scheduled if s.verified is not None and s.verified.path
                     and s.verified.path != list(range(len(s.verified.path))))
        compact(scheduled)

    eng._compact_trees = spy
    while eng.has_unfinished() and checked < 10:
        eng.step()
        if not eng.has_unfinished():
            break
        n = eng.requests["t"].seq.num_computed
        while ref.requests["r"].seq.num_computed < n:
            ref.step()
        assert ref.requests["r"].seq.token_ids[:n] == eng.requests["t"].seq.token_ids[:n]
        torch.testing.assert_close(_committed_kv(eng, "t", n), _committed_kv(ref, "r", n), atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked == 10 and moved > 0  # some accepted path sat off the first slots and was moved


# --------------------------------------------------------------------------- chains where needed


def test_requests_that_need_chain_verification_draft_chains(target, heads, prompts, plain):
    eng = engine(tiny_config(target, "eagle3", draft_dir=heads["eagle3"], tree=tree(2, 3, 6)))
    seen = record_trees(eng)
    outs = eng.generate(prompts[:2], [greedy(24, logprobs=2), greedy(24, logit_bias={7: 0.0})])
    assert [o.token_ids for o in outs] == plain[:2]
    assert seen and all(parents is None for _, parents in seen)
    assert len(seen[0][0]) == eng.num_spec_tokens  # a chain of K = num_draft_tokens - 1
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_padded_tree_steps_on_the_step_runner(target, heads):
    """The GPU data path's shape on the CPU: the persistent-buffer step runner (the paged
    kernel's torch twin) with uniform steps padded to one length, trees and chains (a
    request with logprobs) in the same steps, the head's forwards on the kernel twin."""
    from specserve.executor.backends.cuda_graphs import CudaGraphRunner
    from specserve.executor.static_runner import StaticStepRunner

    prompts = random_prompts(4, seed=9, hi=40)
    params = [greedy(20, logprobs=1) if i == 1 else greedy(20) for i in range(len(prompts))]
    expected = run(engine(tiny_config(target)), prompts, [greedy(20) for _ in prompts])
    cfg = tiny_config(target, "eagle", draft_dir=heads["eagle"], tree=tree(3, 3, 8))
    cfg.engine.max_num_batched_tokens = 16
    eng = engine(cfg)
    K = eng.num_spec_tokens
    eng.runner = CudaGraphRunner(StaticStepRunner(
        eng.target, eng.kv, max_num_seqs=8, max_num_tokens=64, graph_query_lens=tuple(range(1, K + 2)),
        tree_query_lens=tuple(range(2, K + 2)), aux_layer_ids=eng.aux_layer_ids, attention_impl="torch",
        use_graphs=False))
    eng.uniform_steps = True
    eng.proposer.attention = "torch"
    seen = record_trees(eng)
    outs = _check_lossless(eng, prompts, expected, params)
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    assert any(p is None for _, p in seen) and any(p is not None for _, p in seen)


# --------------------------------------------------------------------------- sampling

V = 16
PROMPT = [5, 9, 3, 12, 7]


@pytest.fixture(scope="module")
def small(root):
    tdir = make_tiny_model(root / "small", "llama", seed=5, vocab_size=V, num_key_value_heads=4)
    head = write_head(root / "small-head", "eagle3", seed=3, aux_ids=[0, 1, 1], vocab=V, draft_vocab=12)
    return tdir, head


def _marginals(eng, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """P(token 2) and P(token 3) of plain sampling after PROMPT, by enumeration."""
    t = eng.target
    runner, blocks = eng.runner, eng.blocks

    def dist(ids):
        table: list[int] = []
        blocks.ensure(table, len(ids))
        try:
            logits = runner.forward([SeqInput(ids, 0, table, [len(ids) - 1])]).logits[0]
        finally:
            blocks.free(table)
        return torch.softmax(logits.double() / temperature, -1)

    assert t.arch.vocab_size == V
    p1 = dist(PROMPT)
    p2 = torch.zeros(V, dtype=torch.float64)
    p3 = torch.zeros(V, dtype=torch.float64)
    for t1 in range(V):
        c2 = dist(PROMPT + [t1])
        p2 += p1[t1] * c2
        for t2 in range(V):
            p3 += p1[t1] * c2[t2] * dist(PROMPT + [t1, t2])
    return p2, p3


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_sampled_trees_follow_the_target(small, method):
    tdir, head = small
    cfg = tiny_config(tdir, "eagle3", draft_dir=head, num_blocks=4096, tree=tree(3, 2, 6),
                      rejection_sample_method=method)
    cfg.engine.max_num_seqs = 512
    eng = engine(cfg)
    n = 3000
    outs = eng.generate([PROMPT] * n, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i)
                                       for i in range(n)])
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    p2, p3 = _marginals(eng, 1.0)
    for pos, p in ((1, p2), (2, p3)):
        c = torch.bincount(torch.tensor([o.token_ids[pos] for o in outs]), minlength=V).double()
        tv = 0.5 * float((c / c.sum() - p).abs().sum())
        assert tv < 0.05, (pos, tv)  # sampling noise at n=3000 on 16 outcomes: about 0.03
    # seeded: a request reproduces alone
    alone = eng.generate([PROMPT], [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=17)])
    assert alone[0].token_ids == outs[17].token_ids


def test_trees_deeper_than_a_sliding_window_equal_plain_decoding(root, prompts):
    """A target with a sliding window of 2 (the bigram target read as Mistral) and trees 4
    deep: a node sees only the ancestors inside the window, as plain decoding does, so the
    greedy output and, after every step, the committed K/V are plain decoding's."""
    import json
    import shutil

    windowed = root / "windowed"
    shutil.copytree(make_bigram_target(root / "windowed-src", leak=0.05), windowed)
    cfg = json.loads((windowed / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=2)
    (windowed / "config.json").write_text(json.dumps(cfg))
    head = write_head(root / "head-windowed", "eagle", oracle=True)
    eng = engine(tiny_config(windowed, "eagle", draft_dir=head, tree=tree(2, 4, 8)))
    ref = engine(tiny_config(windowed))
    assert eng.target.arch.sliding_window == 2
    eng.add_request("t", prompts[0], greedy(40))
    ref.add_request("r", prompts[0], greedy(40))
    deep = checked = 0
    seq = eng.requests["t"].seq
    while eng.has_unfinished() and checked < 12:
        before = seq.spec_stats.num_accepted_tokens
        eng.step()
        if not eng.has_unfinished():
            break
        deep += seq.spec_stats.num_accepted_tokens - before >= 2  # a node its root's window leaves out
        n = seq.num_computed
        while ref.requests["r"].seq.num_computed < n:
            ref.step()
        assert ref.requests["r"].seq.token_ids[:n] == seq.token_ids[:n]
        torch.testing.assert_close(_committed_kv(eng, "t", n), _committed_kv(ref, "r", n), atol=1e-5, rtol=1e-5)
        checked += 1
    assert checked == 12 and deep > 0  # paths longer than the window were accepted


# --------------------------------------------------------------------------- the depth adaptive speculation chose


@pytest.mark.parametrize("depth", [2, 3])
def test_a_round_drafts_no_deeper_than_the_depth_chosen(target, heads, prompts, plain, depth):
    """Adaptive speculation may give a tree fewer levels than method.tree.depth
    (``DraftRequest.tree_depth``): the trees drafted stop there, and output stays plain
    decoding's."""
    from specserve.engine.spec_control import Choice

    eng = engine(tiny_config(target, "eagle3", draft_dir=heads["eagle3"], tree=tree(2, 5, 8)))
    c = eng.spec_control
    assert c.tree_depths == (2, 3, 4, 5)
    c.choose = lambda batch_size: Choice(eng.num_spec_tokens, True, depth)
    seen = record_trees(eng)
    _check_lossless(eng, prompts, plain)
    deepest = []
    for _, parents in seen:
        d = [0] * len(parents)
        for i, p in enumerate(parents):
            d[i] = 1 if p < 0 else d[p] + 1
        deepest.append(max(d))
    assert max(deepest) == depth


def test_round_depth():
    from types import SimpleNamespace

    from specserve.methods import TreeConfig
    from specserve.proposers.heads import round_depth

    t = TreeConfig(topk=4, num_draft_tokens=8, depth=5)
    r = lambda d: SimpleNamespace(tree_depth=d)  # noqa: E731
    assert round_depth(t, [7], [r(None)]) == 5  # as configured
    assert round_depth(t, [7, 3], [r(2), r(2)]) == 2  # as chosen
    assert round_depth(t, [3], [r(None)]) == 3  # no deeper than the drafts wanted
    assert round_depth(t, [7], [r(9)]) == 5  # never past the configuration
