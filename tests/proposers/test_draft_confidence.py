"""Draft confidence cuts (``engine.draft_confidence_threshold``, ``DraftRequest.min_confidence``):
a chain stops drafting where the drafter's cumulative probability falls below the cut.

* ``DraftColumns`` cuts each drafter at the first column whose running product of draft
  probabilities (a greedy draft's softmax probability, q of the drawn token for a sampled
  one) is below its cut, and only that drafter;
* on an engine (tiny EAGLE-3 heads), greedy output stays plain decoding's whatever the cut,
  a cut just below 1 leaves one draft per round, one below every confidence changes
  nothing, and one in between drafts fewer tokens than without a cut;
* the adaptive controller's derived cut (``"auto"``) is the break-even probability of one
  more draft, 0 where it has nothing to go on; the default (0) never cuts;
* a bad threshold is a config error naming the key."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from eagle_heads import make_bigram_target, write_head  # noqa: E402
from engine_utils import engine_on_cached_target, greedy, random_prompts, record_drafts, run, tiny_config  # noqa: E402
from engine_utils import one_thread  # noqa: E402, F401 (an autouse fixture: one torch thread)
from specserve.config import validate_config  # noqa: E402
from specserve.engine.spec_control import MAX_CUT, SpecController  # noqa: E402
from specserve.errors import ConfigError  # noqa: E402
from specserve.proposers.heads import DraftColumns, HeadSampler  # noqa: E402
from specserve.request import SamplingParams  # noqa: E402

K = 4
V = 10


class _Seq:
    def __init__(self, i: int, temperature: float = 0.0):
        self.request_id, self.params = f"r{i}", SamplingParams(temperature=temperature, seed=i)
        self.seed, self.num_output_tokens = i, 3


def _logits_with_top(p: float) -> torch.Tensor:
    """A row of V logits whose softmax puts probability p on token 0, the rest spread evenly."""
    rest = (1.0 - p) / (V - 1)
    return torch.log(torch.tensor([p] + [rest] * (V - 1)))


# --------------------------------------------------------------------------- DraftColumns


def test_each_drafter_is_cut_at_the_first_column_below_its_threshold():
    probs = [[0.9, 0.5, 0.9, 0.9],   # 0.9, 0.45, 0.405, 0.36: below 0.42 at column 2
             [0.95, 0.95, 0.95, 0.95],  # 0.95 .. 0.81: never below 0.42
             [0.3, 0.9, 0.9, 0.9]]   # below 0.42 at column 0
    want = [K, K, K]
    cols = DraftColumns(HeadSampler(False, V, torch.device("cpu")), 3, [0, 1, 2], [_Seq(i) for i in range(3)], want,
                        [0.42, 0.42, 0.42])
    live = [0, 1, 2]
    for col in range(K):
        live = [a for a in live if want[a] > col]
        cols.draw(torch.stack([_logits_with_top(probs[a][col]) for a in live]), live, col)
    assert want == [3, K, 1]
    drafts = cols.proposal([[], [], []]).token_ids
    assert [len(d) for d in drafts] == [3, K, 1] and all(t == 0 for d in drafts for t in d)
    assert cols.confidence[1] == pytest.approx(0.95**4)


def test_no_cut_and_zero_cuts_leave_want_alone():
    for cut in (None, [0.0, 0.0]):
        want = [K, 2]
        cols = DraftColumns(HeadSampler(False, V, torch.device("cpu")), 2, [0, 1], [_Seq(0), _Seq(1)], want, cut)
        cols.draw(torch.stack([_logits_with_top(0.01 + 1e-3), _logits_with_top(0.2)]), [0, 1], 0)
        assert want == [K, 2]


def test_a_sampled_draft_counts_with_q_of_the_token_drawn_and_a_greedy_one_with_its_argmax():
    """A batch of a sampled and a greedy request (q is one-hot on the greedy row): the
    sampled row's confidence is q of its draw, the greedy row's the softmax maximum."""
    sampler = HeadSampler(True, V, torch.device("cpu"))
    seqs = [_Seq(0, temperature=1.0), _Seq(1, temperature=0.0)]
    want = [K, K]
    cols = DraftColumns(sampler, 2, [0, 1], seqs, want, [1e-9, 1e-9])
    logits = torch.stack([_logits_with_top(0.6), _logits_with_top(0.7)])
    tok = cols.draw(logits, [0, 1], 0)
    q0 = torch.softmax(logits[0], -1)[tok[0]].item()
    assert cols.confidence[0] == pytest.approx(q0, rel=1e-5)
    assert cols.confidence[1] == pytest.approx(0.7, rel=1e-5) and tok[1] == 0


# --------------------------------------------------------------------------- the engine

_engine = engine_on_cached_target


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("confidence")


@pytest.fixture(scope="module")
def target(root) -> Path:
    return make_bigram_target(root / "target", leak=0.05)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, seed=11)


@pytest.fixture(scope="module")
def plain(target, prompts):
    return run(_engine(tiny_config(target)), prompts, [greedy(24) for _ in prompts])


def _cut_engine(target, head, threshold):
    cfg = tiny_config(target, "eagle3", k=K, draft_dir=head)
    cfg.engine.draft_confidence_threshold = threshold
    return _engine(validate_config(cfg))


def _generate(eng, prompts):
    rounds = record_drafts(eng)
    outs = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.proposer.states
    return outs, [len(d) for r in rounds for d in r if d]


def test_a_cut_just_below_one_leaves_one_draft_per_round(root, target, prompts, plain):
    head = write_head(root / "random", "eagle3", seed=1, aux_ids=[0, 1, 1])
    outs, lens = _generate(_cut_engine(target, head, 0.999), prompts)
    assert [o.token_ids for o in outs] == plain
    assert lens and set(lens) == {1}


def test_a_cut_below_every_confidence_changes_nothing(root, target, prompts, plain):
    head = write_head(root / "oracle", "eagle3", oracle=True, aux_ids=[0, 1, 1])
    outs, lens = _generate(_cut_engine(target, head, 1e-300), prompts)
    full, full_lens = _generate(_cut_engine(target, head, 0.0), prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in full] == plain
    assert lens == full_lens and max(lens) == K


def test_a_cut_between_the_head_s_confidences_drafts_less_and_stays_lossless(root, target, prompts, plain):
    """This head's cumulative draft probabilities run from about 1e-9 to 1e-3 (a flat
    distribution over the vocabulary): a cut in between stops some rounds early and not
    others."""
    from safetensors.torch import load_file

    lm = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    head = write_head(root / "reduced", "eagle3", oracle=True, aux_ids=[0, 1, 1], draft_vocab=300,
                      target_lm_head=lm, seed=2)
    uncut, uncut_lens = _generate(_cut_engine(target, head, 0.0), prompts)
    cut, lens = _generate(_cut_engine(target, head, 1e-4), prompts)
    assert [o.token_ids for o in uncut] == [o.token_ids for o in cut] == plain
    assert max(uncut_lens) == K
    assert sum(lens) < sum(uncut_lens) and min(lens) >= 1 and max(lens) > 1
    assert sum(o.spec.num_draft_tokens for o in cut) < sum(o.spec.num_draft_tokens for o in uncut)


# --------------------------------------------------------------------------- the controller


def _measured(c: SpecController, bucket: int = 1) -> None:
    c.seed_costs({(bucket, q): 0.010 + 0.0001 * (q - 1) for q in range(1, K + 2)})  # 0.1 ms per token
    for k in (1, 2, 3):
        c.propose_cost.setdefault(k, type(c.step_cost[(bucket, 1)])()).add(0.0005 + 0.0002 * k, weight=20)
    c.reached, c.accepted = [100.0, 50.0, 20.0, 5.0], [50.0, 20.0, 5.0, 1.0]


def test_the_derived_cut_is_the_break_even_probability_of_one_more_draft():
    c = SpecController(K, adaptive=True)
    _measured(c)
    a = (20.0 + 5.0 + 1.0) / (50.0 + 20.0 + 5.0)  # acceptance past the first position
    assert c.draft_cut(1) == pytest.approx((0.0002 + 0.0001) / (a * 0.010))
    c.reached, c.accepted = [100.0, 50.0, 20.0, 5.0], [50.0, 1.0, 0.0, 0.0]  # later drafts rarely accepted
    assert c.draft_cut(1) == MAX_CUT


def test_no_derived_cut_without_adaptive_speculation_or_measurements():
    fixed = SpecController(K, adaptive=False)
    _measured(fixed)
    assert fixed.draft_cut(1) == 0.0
    cold = SpecController(K, adaptive=True)
    assert cold.draft_cut(1) == 0.0  # nothing verified yet
    cold.reached, cold.accepted = [100.0] * K, [50.0] * K
    assert cold.draft_cut(1) == 0.0  # no costs measured
    cold.seed_costs({(1, 1): 0.010, (1, 2): 0.011})
    assert cold.draft_cut(1) == 0.0  # one chain length measured: no slope of proposing
    assert SpecController(K, adaptive=True).draft_cut(0) == 0.0


def test_the_engine_asks_the_controller_when_the_threshold_is_auto(target, root, prompts):
    head = write_head(root / "random", "eagle3", seed=1, aux_ids=[0, 1, 1])
    seen: list[float] = []
    eng = _cut_engine(target, head, "auto")
    eng.spec_control.draft_cut = lambda b: seen.append(b) or 0.25
    asked = []
    propose = eng.proposer.propose
    eng.proposer.propose = lambda reqs, step=None: asked.extend(r.min_confidence for r in reqs) or propose(reqs, step)
    eng.generate(prompts[:2], [greedy(8) for _ in prompts[:2]])
    assert seen and set(asked) == {0.25}
    eng = _cut_engine(target, head, 0.125)
    eng.spec_control.draft_cut = lambda b: pytest.fail("a configured threshold is used as given")
    asked.clear()
    propose = eng.proposer.propose
    eng.proposer.propose = lambda reqs, step=None: asked.extend(r.min_confidence for r in reqs) or propose(reqs, step)
    eng.generate(prompts[:2], [greedy(8) for _ in prompts[:2]])
    assert set(asked) == {0.125}


@pytest.mark.parametrize("bad", [1.0, -0.1, "high", True, math.nan, None])
def test_a_bad_threshold_names_the_key(root, target, bad):
    cfg = tiny_config(target, "eagle3", k=K, draft_dir=write_head(root / "random", "eagle3", seed=1, aux_ids=[0, 1, 1]))
    cfg.engine.draft_confidence_threshold = bad
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert "engine.draft_confidence_threshold" in str(e.value)


def test_the_default_never_cuts(root, target, prompts):
    from specserve.config import EngineConfig

    assert EngineConfig().draft_confidence_threshold == 0.0
    head = write_head(root / "random", "eagle3", seed=1, aux_ids=[0, 1, 1])
    eng = _engine(tiny_config(target, "eagle3", k=K, draft_dir=head, speculation="auto"))
    eng.spec_control.draft_cut = lambda b: pytest.fail("no derived cut unless asked")
    asked = []
    propose = eng.proposer.propose
    eng.proposer.propose = lambda reqs, step=None: asked.extend(r.min_confidence for r in reqs) or propose(reqs, step)
    eng.generate(prompts[:2], [greedy(8) for _ in prompts[:2]])
    assert asked and set(asked) == {0.0}
