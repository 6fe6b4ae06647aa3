"""Static draft trees (``method.tree.static``, vLLM's ``speculative_token_tree``): a fixed
tree of child ranks instead of topk/depth.  ``heads.StaticLevels`` drafts node (0, 1) as
the second-best child of the best first token, keeps exactly the static nodes (the
best-scored subtree when fewer are wanted); EAGLE-3 and Medusa follow it through the
engine with greedy output equal to plain decoding and every full round shaped exactly
as the static tree; the config's checks are one line naming ``method.tree.static``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from eagle_heads import make_bigram_target, write_head  # noqa: E402
from engine_utils import greedy, random_prompts, run, tiny_config  # noqa: E402
from engine_utils import one_thread  # noqa: E402, F401 (an autouse fixture: one torch thread)
from test_medusa import oracle_heads, write_layout  # noqa: E402

from specserve.compose import compose_config  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.errors import ConfigError  # noqa: E402
from specserve.methods import TreeConfig  # noqa: E402
from specserve.proposers.heads import choose_nodes, tree_levels  # noqa: E402
from tree_utils import engine, record_trees  # noqa: E402

MAX_TOKENS = 20
STATIC = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]"
# its paths in level order (the order drafts come in) and each one's parent among them
LEVEL_ORDER = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]
PARENTS = [-1, -1, -1, 0, 0, 1, 3, 4]

# --------------------------------------------------------------------------- the levels


def test_static_levels_follow_child_ranks():
    """A drafter whose children's log-probabilities depend on the parent token alone (a
    table): every kept node's token is the one its path of ranks names, parents first;
    a request wanting fewer nodes gets the best-scored subtree of the static tree."""
    V, B = 12, 3
    g = torch.Generator().manual_seed(4)
    table = torch.log_softmax(torch.randn(V, V, generator=g) * 3, dim=-1)  # child log-probabilities by parent token
    root = torch.log_softmax(torch.randn(B, V, generator=g) * 3, dim=-1)
    shape = TreeConfig(static=STATIC).expanded()
    assert (shape.topk, shape.depth, shape.num_draft_tokens) == (3, 3, 9)
    levels = tree_levels(shape, root)
    for d in range(1, shape.depth):
        levels.grow(*table[levels.frontier_tokens()].topk(shape.topk, dim=-1))
        if d + 1 < shape.depth:
            levels.advance()
    want = [8, 4, 2]
    drafts: list[list[int]] = [[] for _ in range(B)]
    parents: list[list[int] | None] = [None] * B
    choose_nodes(list(enumerate(want)), *levels.pool(), drafts, parents)

    def by_hand(b: int, path: tuple[int, ...]) -> tuple[int, float]:
        lp = root[b]
        tok, score = int(lp.argsort(descending=True)[path[0]]), float(lp.sort(descending=True).values[path[0]])
        for r in path[1:]:
            row = table[tok]
            tok, score = int(row.argsort(descending=True)[r]), score + float(row.sort(descending=True).values[r])
        return tok, score

    assert drafts[0] == [by_hand(0, p)[0] for p in LEVEL_ORDER] and parents[0] == PARENTS
    for b in (1, 2):  # the want best static nodes by score, in level order
        scores = [by_hand(b, p)[1] for p in LEVEL_ORDER]
        best = sorted(sorted(range(len(LEVEL_ORDER)), key=lambda n: -scores[n])[: want[b]])
        assert drafts[b] == [by_hand(b, LEVEL_ORDER[n])[0] for n in best]
        assert parents[b] == [best.index(PARENTS[n]) if PARENTS[n] >= 0 else -1 for n in best]


# --------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("static-tree")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, seed=31)


def _eagle3(root: Path, prompts) -> tuple[Path, Path]:
    from safetensors.torch import load_file

    target = make_bigram_target(root / "eagle-target", leak=0.3)
    lm = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    return target, write_head(root / "head-eagle3", "eagle3", oracle=True, aux_ids=[0, 1, 1], draft_vocab=300,
                              target_lm_head=lm)


def _medusa(root: Path, prompts) -> tuple[Path, Path]:
    heads, _ = oracle_heads(make_bigram_target(root / "medusa-exact", leak=0.0), prompts, num_heads=4, num_layers=1)
    return make_bigram_target(root / "medusa-leaky", leak=0.05), write_layout(root / "medusa-head", "medusa", heads)


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_greedy_static_trees_equal_plain_decoding(root, prompts, method):
    target, head = (_eagle3 if method == "eagle3" else _medusa)(root, prompts)
    expected = run(engine(tiny_config(target)), prompts, [greedy(MAX_TOKENS) for _ in prompts])
    eng = engine(tiny_config(target, method, draft_dir=head, tree={"static": STATIC}))
    assert eng.num_spec_tokens == len(LEVEL_ORDER)
    seen = record_trees(eng)
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    assert [o.token_ids for o in outs] == expected
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert 0 < sum(o.spec.num_accepted_tokens for o in outs) < sum(o.spec.num_draft_tokens for o in outs)
    full = [p for t, p in seen if len(t) == len(LEVEL_ORDER)]
    assert full and all(p == PARENTS for p in full)  # the static shape, every full round
    assert all(p is not None and all(-1 <= q < i for i, q in enumerate(p)) for _, p in seen)


# --------------------------------------------------------------------------- config


def _compose(*overrides: str):
    return compose_config(["model.path=/tmp/none", "+method=eagle3", "method.model=/tmp/none", *overrides])


def test_a_static_tree_composes_from_either_spelling():
    for value in ['"[(0,), (1,), (0, 0), (0, 1), (1, 0)]"', "[[0],[1],[0,0],[0,1],[1,0]]"]:
        cfg = _compose(f"method.tree.static={value}")
        assert cfg.method.num_speculative_tokens == 5  # K = nodes; num_draft_tokens = nodes + 1
        assert cfg.method.tree.expanded().num_draft_tokens == 6
    cfg = _compose("method.tree.static=[[0],[1]]", "method.tree.num_draft_tokens=3")  # consistent: accepted
    assert cfg.method.num_speculative_tokens == 2


WIDE_AND_DEEP = [[r] for r in range(10)] + [[0] * d for d in range(2, 9)]  # 10 wide x 7 expansions past the first


@pytest.mark.parametrize(("overrides", "says"), [
    (["method.tree.static=[[0],[0,0],[1,0]]"], "path (1, 0) has no parent: (1,) is not in the tree"),
    (["method.tree.static=[[0],[-1]]"], "child ranks must be >= 0"),
    (["method.tree.static=[[0],[0]]"], "lists a path twice: (0,)"),
    (["method.tree.static=[]"], "must be a non-empty list of paths"),
    (['method.tree.static="[(0,), (1,"'], "must be a list of paths like"),
    (["method.tree.static=[[0],[x]]"], "each a non-empty tuple of child ranks (integers)"),
    ([f"method.tree.static={[[r] for r in range(64)]}".replace(" ", "")], "holds 64 nodes; at most 63"),
    (["method.tree.static=[[0],[1]]", "method.tree.topk=2"], "leave method.tree.topk unset"),
    (["method.tree.static=[[0],[1]]", "method.tree.depth=1"], "leave method.tree.depth unset"),
    (["method.tree.static=[[0],[1]]", "method.tree.num_draft_tokens=5"], "so num_draft_tokens is 3"),
    ([f"method.tree.static={WIDE_AND_DEEP}".replace(" ", "")], "(10 nodes) x (depth 8 - 1) must be <= 64"),
])
def test_static_tree_errors_are_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        _compose(*overrides)
    msg = str(e.value)
    assert msg.startswith("method.tree.static: ") and says in msg and "\n" not in msg, msg


def test_a_static_tree_needs_a_tree_method():
    with pytest.raises(ConfigError) as e:
        compose_config(["model.path=/tmp/none", "+method=ngram", "method.tree.static=[[0]]"])
    assert str(e.value).startswith("method.tree: ngram drafts chains; only ")
