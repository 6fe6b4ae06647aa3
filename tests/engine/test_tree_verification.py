"""Draft trees: verification on hand-built trees (``sampling.tree``), moving an accepted
path's K/V (``KVCache.move``) and the ``method.tree`` config checks.

Trees here: drafts with parents (-1 = the root, the pending token); node 0 is the root,
draft i is node i + 1, and the logits row of node n is ``rows[b] + n``."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specserve.config import Config, ModelConfig, validate_config
from specserve.errors import ConfigError
from specserve.executor.kv_cache import KVCache
from specserve.methods import method_options
from specserve.sampling.filters import sample_from_probs
from specserve.sampling.philox import SAMPLE, keyed_uniforms
from specserve.sampling.sampler import RequestTensors
from specserve.sampling.tree import greedy_tree_paths, node_argmax, tree_inputs, unpack_trees, verify_trees

V = 8


def _peaked(*tokens: int) -> torch.Tensor:
    """One logits row per token, each with its argmax at that token."""
    rows = torch.zeros(len(tokens), V)
    for i, t in enumerate(tokens):
        rows[i, t] = 5.0
    return rows


def _verify(logits, drafts, parents, temps, seeds=None, positions=None, method="strict", rows=None):
    B = len(drafts)
    rows = rows if rows is not None else [sum(len(d) + 1 for d in drafts[:b]) for b in range(B)]
    req = RequestTensors.build(temps, [0] * B, [1.0] * B, [0.0] * B, seeds or list(range(B)), positions or [0] * B)
    packed = verify_trees(logits, tree_inputs(rows, drafts, parents), req, method=method)
    return unpack_trees(packed, drafts), packed


# --------------------------------------------------------------------------- greedy


def test_greedy_takes_the_longest_path_the_target_agrees_with():
    # root -> [5 (node 1), 3 (node 2)]; node 2 -> [1 (node 3), 6 (node 4)]; node 4 -> [2 (node 5)]
    drafts, parents = [5, 3, 1, 6, 2], [-1, -1, 1, 1, 3]
    # the target: 3 after the root, 6 after node 2, 7 after node 4 (so node 5's 2 is rejected)
    logits = _peaked(3, 0, 6, 0, 7, 0)
    (out,), packed = _verify(logits, [drafts], [parents], [0.0])
    assert out == ([3, 6, 7], 2, [1, 3])
    assert packed.shape == (1, len(drafts) + 2)


def test_greedy_all_rejected_emits_the_roots_argmax():
    logits = _peaked(4, 0, 0)
    (out,), _ = _verify(logits, [[1, 2]], [[-1, -1]], [0.0])
    assert out == ([4], 0, [])


def test_greedy_all_accepted_ends_with_the_leafs_token():
    # a chain (topk 1) the target agrees with everywhere: the bonus comes from the leaf
    logits = _peaked(1, 2, 3, 4)
    (out,), _ = _verify(logits, [[1, 2, 3]], [[-1, 0, 1]], [0.0])
    assert out == ([1, 2, 3, 4], 3, [0, 1, 2])


def test_greedy_trees_walked_on_the_host_decide_as_on_the_device():
    """``node_argmax`` + ``greedy_tree_paths`` (what the engine runs for a step of greedy
    trees) against ``verify_trees``' greedy rule, on random trees whose drafts often hold
    the target's argmax (so paths run deep), ragged batches included."""
    import random

    rng = random.Random(7)
    for trial in range(200):
        B = rng.randint(1, 4)
        drafts, parents = [], []
        for _ in range(B):
            n = rng.randint(0, 9)
            par = [rng.randint(-1, i - 1) for i in range(n)]
            drafts.append([rng.randrange(4) for _ in range(n)])  # a small alphabet: siblings repeat
            parents.append(par)
        rows = [sum(len(d) + 1 for d in drafts[:b]) + 2 * b for b in range(B)]  # gaps between trees
        logits = torch.randn(rows[-1] + len(drafts[-1]) + 1, 4, generator=torch.Generator().manual_seed(trial))
        device, _ = _verify(logits, drafts, parents, [0.0] * B, rows=rows)
        host = greedy_tree_paths(node_argmax(logits, rows, drafts).tolist(), drafts, parents)
        assert host == device
    with pytest.raises(ValueError, match=r"parents\[0\]\[1\]"):
        greedy_tree_paths([[0, 0, 0]], [[1, 2]], [[-1, 1]])


def test_a_tree_without_drafts_and_ragged_batches():
    # request 0: no drafts; request 1: two drafts of which the second is accepted
    logits = torch.cat([_peaked(6), _peaked(2, 0, 5)])
    outs, _ = _verify(logits, [[], [7, 2]], [[], [-1, -1]], [0.0, 0.0])
    assert outs == [([6], 0, []), ([2, 5], 1, [1])]


def test_bad_trees_name_the_field():
    with pytest.raises(ValueError, match=r"parents\[0\]\[1\]: must be in \[-1, 1\)"):
        tree_inputs([0], [[1, 2]], [[-1, 1]])
    with pytest.raises(ValueError, match=r"parents\[0\]: 1 parents for 2 drafts"):
        tree_inputs([0], [[1, 2]], [[-1]])
    req = RequestTensors.build([0.0], [0], [1.0], [0.0], [0], [0])
    with pytest.raises(ValueError, match="method: trees are verified by one of strict, probabilistic"):
        verify_trees(_peaked(1, 1), tree_inputs([0], [[1]], [[-1]]), req, method="synthetic")


# --------------------------------------------------------------------------- sampling


# A tree over 8 tokens: root -> [2 (node 1), 0 (node 2)]; node 1 -> [3 (node 3)].
DRAFTS, PARENTS = [2, 0, 3], [-1, -1, 0]


def _node_logits(g: torch.Generator) -> torch.Tensor:
    return torch.randn(4, V, generator=g)  # root, node 1, node 2, node 3


def _samples(logits: torch.Tensor, method: str, n: int, seed0: int = 0):
    """n requests of one tree (seeds seed0 ..), verified in one batch."""
    big = logits.repeat(n, 1)
    outs, _ = _verify(big, [DRAFTS] * n, [PARENTS] * n, [1.0] * n, seeds=list(range(seed0, seed0 + n)),
                      positions=[3] * n, method=method)
    return outs


def _tv(counts: Counter, p: torch.Tensor, n: int) -> float:
    return 0.5 * sum(abs(counts[t] / n - float(p[t])) for t in range(V))


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_sampled_trees_are_lossless(method):
    """The first token follows the root's distribution; after an accepted child, the
    second follows that child's node (node 2 has no children: its token is the bonus)."""
    logits = _node_logits(torch.Generator().manual_seed(7))
    p = torch.softmax(logits.double(), -1)
    n = 20000
    outs = _samples(logits, method, n)
    first = Counter(toks[0] for toks, _, _ in outs)
    assert _tv(first, p[0], n) < 0.02
    for child, node in ((2, 1), (0, 2)):
        second = Counter(toks[1] for toks, _, _ in outs if toks[0] == child)
        m = sum(second.values())
        assert m > 1000 and _tv(second, p[node], m) < 0.04, (child, _tv(second, p[node], m))
    # the accept rates: a child is accepted with its probability under the target
    accepted = sum(1 for _, a, _ in outs if a > 0) / n
    assert abs(accepted - float(p[0, 2] + p[0, 0])) < 0.015


def test_strict_trees_emit_plain_decodings_token_for_the_seed():
    logits = _node_logits(torch.Generator().manual_seed(3))
    n = 500
    outs = _samples(logits, "strict", n, seed0=40)
    seeds = torch.arange(40, 40 + n, dtype=torch.int64)
    u = keyed_uniforms(seeds, torch.full((n,), 3, dtype=torch.int64), 1, SAMPLE)[:, 0]
    plain = sample_from_probs(torch.softmax(logits[:1], -1).expand(n, V), u).tolist()
    assert [toks[0] for toks, _, _ in outs] == plain


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_seeded_trees_reproduce_in_any_batch(method):
    logits = _node_logits(torch.Generator().manual_seed(11))
    n = 64
    outs = _samples(logits, method, n, seed0=500)
    again = _samples(logits, method, n, seed0=500)
    assert outs == again
    # request 500 alone, and behind other requests with another tree: the same result
    alone = _samples(logits, method, 1, seed0=500)[0]
    other = _peaked(1, 2)
    mixed, _ = _verify(torch.cat([other, logits]), [[1], DRAFTS], [[-1], PARENTS], [1.0, 1.0], seeds=[9, 500],
                       positions=[0, 3], method=method)
    assert alone == outs[0] == mixed[1]
    assert len({tuple(toks) for toks, _, _ in outs}) > 5  # the seeds do decide


def test_greedy_rows_beside_sampled_ones_follow_the_argmax():
    logits = torch.cat([_peaked(2, 3, 0, 4), _node_logits(torch.Generator().manual_seed(1))])
    for method in ("strict", "probabilistic"):
        outs, _ = _verify(logits, [DRAFTS, DRAFTS], [PARENTS, PARENTS], [0.0, 1.0], seeds=[1, 2], method=method)
        assert outs[0] == ([2, 3, 4], 2, [0, 2])


def test_the_first_nodes_of_a_tree_are_a_tree():
    from specserve.engine.requests import Drafts

    d = Drafts([5, 6, 7, 8], parents=[-1, -1, 0, 2]).first(3)
    assert (d.token_ids, d.parents) == ([5, 6, 7], [-1, -1, 0])
    assert Drafts([5, 6]).first(1).parents is None  # a chain stays a chain


# --------------------------------------------------------------------------- the accepted path's K/V


def test_kv_move_copies_every_layer_and_reads_before_it_writes():
    kv = KVCache(3, 4, 4, 2, 8, torch.float32, torch.device("cpu"))
    kv.data.copy_(torch.randn_like(kv.data))
    before = kv.data.clone()
    # slots 5 <- 7 and 6 <- 5: the second reads slot 5 as it was
    kv.move(torch.tensor([7, 5]), torch.tensor([5, 6]), num_layers=2)
    assert torch.equal(kv.data[:2, :, 5], before[:2, :, 7])
    assert torch.equal(kv.data[:2, :, 6], before[:2, :, 5])
    assert torch.equal(kv.data[2], before[2])  # a layer past num_layers is left alone
    untouched = [s for s in range(kv.data.shape[2]) if s not in (5, 6)]
    assert torch.equal(kv.data[:, :, untouched], before[:, :, untouched])


# --------------------------------------------------------------------------- config


def _config(method="eagle3", rejection="strict", **tree):
    cfg = Config(model=ModelConfig(name="t", path="/nonexistent", dtype="float32"))
    cfg.method = method_options(method, num_speculative_tokens=3, model="/head", tree=tree,
                                rejection_sample_method=rejection,
                                synthetic_acceptance_rate=0.5 if rejection == "synthetic" else None)
    return cfg


def test_a_tree_sets_k_to_its_drafts():
    cfg = validate_config(_config(topk=4, depth=3, num_draft_tokens=10))
    assert cfg.method.num_speculative_tokens == 9
    assert (cfg.method.tree.topk, cfg.method.tree.depth, cfg.method.tree.num_draft_tokens) == (4, 3, 10)
    assert validate_config(_config()).method.num_speculative_tokens == 3  # no tree: chains of K


@pytest.mark.parametrize("method,tree,line", [
    ("ngram", dict(topk=2, depth=2, num_draft_tokens=4),
     "method.tree: ngram drafts chains; only draft_model, eagle, eagle3"),
    ("eagle3", dict(topk=2, depth=2), "method.tree.num_draft_tokens: is required with a tree"),
    ("eagle3", dict(topk=0, depth=2, num_draft_tokens=3), "method.tree.topk: must be >= 1, got 0"),
    ("eagle3", dict(topk=2, depth=0, num_draft_tokens=3), "method.tree.depth: must be >= 1, got 0"),
    ("eagle3", dict(topk=2, depth=2, num_draft_tokens=1), "method.tree.num_draft_tokens: must be in [2, 64]"),
    ("eagle3", dict(topk=2, depth=2, num_draft_tokens=65), "method.tree.num_draft_tokens: must be in [2, 64]"),
    ("eagle3", dict(topk=2, depth=2, num_draft_tokens=8), "method.tree.num_draft_tokens: must be <= 7"),
    ("eagle3", dict(topk=9, depth=9, num_draft_tokens=60), "method.tree.topk: topk x (depth - 1) must be <= 64"),
    ("eagle3", dict(topk=2, depth=2, num_draft_tokens=3.5), "method.tree.num_draft_tokens: must be an integer"),
    ("eagle3", dict(topx=2), "method.tree.topx: no such key"),
])
def test_bad_trees_fail_in_one_line_naming_the_key(method, tree, line):
    cfg = _config(method, **tree)
    if method == "ngram":
        cfg.method.model = None
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert line in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_trees_refuse_synthetic_acceptance():
    with pytest.raises(ConfigError, match="method.tree: does not combine with rejection_sample_method=synthetic"):
        validate_config(_config(rejection="synthetic", topk=2, depth=2, num_draft_tokens=4))
