"""Per-request speculation: ``SamplingParams.speculation.num_speculative_tokens`` caps one
request's drafts per step, 0 turning speculation off for it alone.

In one batch, requests with cap 0, cap 1, the server's K and no cap get plain decoding's
greedy tokens (and a seeded sampled request its plain tokens) on n-gram, suffix, a draft
model, an EAGLE-3 head and MTP layers.  A cap-0 request is never handed to the proposer
(no DraftRequest, no head forward: its target steps are plain decoding's), reports zero
drafts and is not counted by the adaptive controller; a cap-1 request never verifies more
than one draft per step.  Proposers cope with requests they never saw (``remove`` and
``on_verified`` of an unknown id change nothing), and a bad cap is refused naming the field.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proposers"))

from eagle_heads import make_bigram_target, write_head  # noqa: E402
from engine_utils import head_forwards, random_prompts, tiny_config  # noqa: E402
from engine_utils import one_thread  # noqa: E402, F401 (an autouse fixture: one torch thread)
from specserve.compat import SamplingParams as VllmSamplingParams  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.errors import InvalidRequestError  # noqa: E402
from specserve.executor.loader import load_model  # noqa: E402
from specserve.request import SamplingParams, SpeculationParams  # noqa: E402

K = 4
MAX_TOKENS = 20
CAPS = [0, 1, K, None]  # one batch: off, one draft per step, the server's K, the server's choice


def params(cap: int | None, seed: int | None = None, temperature: float = 0.0, **kw) -> SamplingParams:
    spec = None if cap is None else SpeculationParams(num_speculative_tokens=cap)
    return SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, seed=seed, ignore_eos=True,
                          speculation=spec, **kw)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("per-request")


@pytest.fixture(scope="module")
def target(root) -> Path:
    """Almost a bigram model: drafts are accepted for a while, then rejected."""
    return make_bigram_target(root / "target", leak=0.05)


@pytest.fixture(scope="module")
def drafters(root, target) -> dict[str, tuple[str, Path | None]]:
    return {
        "ngram": ("ngram", None),
        "suffix": ("suffix", None),
        "draft_model": ("draft_model", make_bigram_target(root / "draft", leak=0.2, seed=0)),
        "eagle3": ("eagle3", write_head(root / "head", "eagle3", oracle=True, aux_ids=[0, 1, 1])),
    }


_TARGETS: dict[str, object] = {}


def make_engine(target_dir: Path, method: str | None = None, draft: Path | None = None, speculation: str = "fixed",
                num_prediction_tokens: int = 0) -> LLMEngine:
    cfg = tiny_config(target_dir, method, k=K, num_blocks=512, draft_dir=draft, speculation=speculation)
    cfg.engine.num_prediction_tokens = num_prediction_tokens
    cfg.engine.max_num_seqs = 16
    key = str(target_dir)
    if key not in _TARGETS:
        _TARGETS[key] = load_model(key, "float32", torch.device("cpu"))
    return LLMEngine(cfg, target=_TARGETS[key])


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    """Each prompt holds the target's greedy continuation of its start, then the start again:
    the output follows that chain, so n-gram and suffix drafts are found (and some accepted)."""
    starts = random_prompts(8, seed=5, lo=3, hi=6, vocab=40)
    chains = [o.token_ids for o in make_engine(target).generate(starts, [params(None)] * len(starts))]
    return [s + c[:12] + s for s, c in zip(starts, chains)]


@pytest.fixture(scope="module")
def caps(prompts) -> list[int | None]:
    return [CAPS[i % len(CAPS)] for i in range(len(prompts))]


def spy_proposals(eng: LLMEngine) -> list[list[tuple[str, int]]]:
    """Every propose call's requests, as (request id, max_drafts)."""
    seen: list[list[tuple[str, int]]] = []
    propose = eng.proposer.propose

    def recording(reqs, step=None):
        seen.append([(r.seq.request_id, r.max_drafts) for r in reqs])
        return propose(reqs, step)

    eng.proposer.propose = recording
    return seen


def spy_steps(eng: LLMEngine) -> list[list[int]]:
    """Every target forward's tokens per sequence (its cost profile)."""
    seen: list[list[int]] = []
    execute = eng.runner.execute

    def recording(batch, *args, **kw):
        qs = batch.query_start
        seen.append([qs[b + 1] - qs[b] for b in range(len(qs) - 1)])
        return execute(batch, *args, **kw)

    eng.runner.execute = recording
    return seen


def request_states(eng: LLMEngine) -> dict:
    """The proposer's per-request state, whatever its name."""
    p = eng.proposer
    for name in ("states", "seqs"):
        if hasattr(p, name):
            return getattr(p, name)
    return {}


def check_drained(eng: LLMEngine) -> None:
    assert eng.blocks.num_free == eng.blocks.num_blocks  # every KV block came back
    assert not request_states(eng)  # and the proposer dropped every request it saw
    own = getattr(eng.proposer, "blocks", None)
    if own is not None and own is not eng.blocks:
        assert own.num_free == own.num_blocks


def check_caps(outs, caps, proposed: list[list[tuple[str, int]]]) -> None:
    """Cap 0: no drafts and never proposed for; cap c: at most c drafts per step, asked for
    at most c; the cap-1 and cap-K groups drafted (the checks are not vacuous)."""
    ids = {o.request_id: c for o, c in zip(outs, caps)}
    asked = [(rid, m) for call in proposed for rid, m in call]
    for o, c in zip(outs, caps):
        s = o.spec
        if c == 0:
            assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (0, 0, 0)
        elif c is not None:
            assert s.num_draft_tokens <= c * s.num_drafts
    assert not any(ids[rid] == 0 for rid, _ in asked)  # a cap-0 request never reached the proposer
    assert all(m <= ids[rid] for rid, m in asked if ids[rid] is not None)
    for c in (1, K):
        assert sum(o.spec.num_drafts for o, cc in zip(outs, caps) if cc == c) > 0, c
    # the cap is what bounds cap-1 requests: uncapped neighbours draft several per step
    assert any(o.spec.num_draft_tokens > o.spec.num_drafts for o, c in zip(outs, caps) if c in (K, None))


@pytest.mark.parametrize("name", ["ngram", "suffix", "draft_model", "eagle3"])
def test_caps_in_one_batch_keep_greedy_output(target, drafters, prompts, caps, name):
    plain = [o.token_ids for o in make_engine(target).generate(prompts, [params(None)] * len(prompts))]
    method, draft = drafters[name]
    eng = make_engine(target, method, draft)
    proposed = spy_proposals(eng)
    outs = eng.generate(prompts, [params(c) for c in caps])
    assert [o.token_ids for o in outs] == plain
    check_caps(outs, caps, proposed)
    check_drained(eng)


@pytest.mark.parametrize("name", ["ngram", "eagle3"])
def test_seeded_sampled_requests_keep_plain_tokens_under_any_cap(target, drafters, prompts, caps, name):
    """Keyed random numbers: a seeded request's tokens do not depend on its drafts, so every
    cap gives plain decoding's sampled tokens for that seed."""
    ps = [params(None, seed=100 + i, temperature=0.05) for i in range(len(prompts))]
    plain = [o.token_ids for o in make_engine(target).generate(prompts, ps)]
    method, draft = drafters[name]
    eng = make_engine(target, method, draft, speculation="adaptive")
    outs = eng.generate(prompts, [params(c, seed=100 + i, temperature=0.05) for i, c in enumerate(caps)])
    assert [o.token_ids for o in outs] == plain
    assert all(o.spec.num_drafts == 0 for o, c in zip(outs, caps) if c == 0)
    check_drained(eng)


def test_a_cap_zero_request_costs_what_plain_decoding_costs(target, drafters, prompts, monkeypatch):
    """Alone on an EAGLE-3 engine, a cap-0 request runs exactly plain decoding's target steps
    (one token per step after its prompt), the head never runs, and the proposer is never asked."""
    plain_eng = make_engine(target)
    plain_steps = spy_steps(plain_eng)
    [ref] = plain_eng.generate(prompts[:1], [params(None)])
    method, head = drafters["eagle3"]
    eng = make_engine(target, method, head)
    steps = spy_steps(eng)
    proposed = spy_proposals(eng)
    forwards = head_forwards(monkeypatch)
    [out] = eng.generate(prompts[:1], [params(0)])
    assert out.token_ids == ref.token_ids and out.spec.num_drafts == 0
    assert steps == plain_steps and not proposed and not forwards
    check_drained(eng)
    # the same request with the server's K does run the head (the spies would have seen it)
    n = len(steps)
    [out] = eng.generate(prompts[:1], [params(None)])
    assert out.token_ids == ref.token_ids and proposed and forwards and steps[n:] != plain_steps


def test_the_adaptive_controller_never_counts_cap_zero_requests(target, prompts):
    eng = make_engine(target, "ngram", speculation="adaptive")
    sizes, observed = [], []
    choose, observe = eng.spec_control.choose, eng.spec_control.observe_drafts
    eng.spec_control.choose = lambda n: (sizes.append(n), choose(n))[1]
    eng.spec_control.observe_drafts = lambda d, a, **kw: (observed.append(d), observe(d, a, **kw))[1]
    outs = eng.generate(prompts, [params(0)] * len(prompts))
    assert all(o.spec.num_drafts == 0 for o in outs)
    assert set(sizes) == {0} and not observed and not any(eng.spec_control.reached)
    # steps that proposed for no request leave the proposing costs unmeasured
    assert not eng.spec_control.propose_cost
    # beside speculating requests, only those are counted
    sizes.clear()
    outs = eng.generate(prompts, [params(0 if i % 2 else None) for i in range(len(prompts))])
    assert 0 < max(sizes) <= len(prompts) // 2
    assert len(observed) == sum(o.spec.num_drafts for o in outs) > 0
    check_drained(eng)


def test_mtp_layers_with_caps(tmp_path, prompts):
    """MTP (a head with its own cache): the cap-0 request is never seen, the others lossless."""
    from test_mtp import add_mtp_layers
    from tiny_models import make_tiny_model

    model = add_mtp_layers(make_tiny_model(tmp_path / "mtp", "llama", seed=11), "llama", "deepseek", 1, False)
    ps = random_prompts(4, seed=21)
    plain = [o.token_ids for o in make_engine(model).generate(ps, [params(None)] * len(ps))]
    eng = make_engine(model, "mtp")
    proposed = spy_proposals(eng)
    caps = CAPS[: len(ps)]
    outs = eng.generate(ps, [params(c) for c in caps])
    assert [o.token_ids for o in outs] == plain
    assert outs[0].spec.num_drafts == 0 and outs[1].spec.num_draft_tokens <= outs[1].spec.num_drafts
    assert outs[0].request_id not in {rid for call in proposed for rid, _ in call}
    check_drained(eng)


@pytest.mark.parametrize("name", ["ngram", "suffix", "draft_model", "eagle3"])
def test_proposers_ignore_requests_they_never_saw(target, drafters, prompts, name):
    method, draft = drafters[name]
    eng = make_engine(target, method, draft)
    eng.add_request("seen", prompts[0], params(None))
    eng.add_request("unseen", prompts[1], params(0))
    for _ in range(3):
        eng.step()
    before = {rid: id(v) for rid, v in request_states(eng).items()}
    assert "unseen" not in before
    seq = eng.requests["unseen"].seq
    eng.proposer.on_verified(seq, len(seq.token_ids) - 1, 0, 0)
    eng.proposer.remove("unseen")
    eng.proposer.remove("never-admitted")
    assert {rid: id(v) for rid, v in request_states(eng).items()} == before
    while eng.has_unfinished():
        eng.step()
    check_drained(eng)


# --------------------------------------------------------------------------- Predicted Outputs


def test_cap_bounds_prediction_drafts_too(target, prompts):
    """Without a method (Predicted Outputs alone) only cap 0 is accepted, and it turns the
    prediction's drafts off; with a method, a cap-1 request's prediction drafts one at a time."""
    ref = make_engine(target).generate(prompts[:1], [params(None)])[0].token_ids
    pred = dict(prediction_token_ids=list(ref))
    eng = make_engine(target, num_prediction_tokens=8)
    on, off = eng.generate(prompts[:1] * 2, [params(None, **pred), params(0, **pred)])
    assert on.token_ids == off.token_ids == ref
    assert on.spec.num_accepted_prediction_tokens > 0 and off.spec.num_draft_tokens == 0
    with pytest.raises(InvalidRequestError, match="no speculative method") as e:
        eng.add_request("r", prompts[0], params(1))
    assert e.value.field == "speculation.num_speculative_tokens"
    eng = make_engine(target, "ngram", num_prediction_tokens=8)
    [one] = eng.generate(prompts[:1], [params(1, **pred)])
    assert one.token_ids == ref and 0 < one.spec.num_draft_tokens <= one.spec.num_drafts
    check_drained(eng)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("spec, field, message", [
    ({"num_speculative_tokens": K + 1}, "speculation.num_speculative_tokens", f"must be in [0, {K}]"),
    ({"num_speculative_tokens": -1}, "speculation.num_speculative_tokens", "must be >= 0"),
    ({"num_speculative_tokens": "2"}, "speculation.num_speculative_tokens", "must be an integer"),
    ({"num_speculative_tokens": 1.5}, "speculation.num_speculative_tokens", "must be an integer"),
    ({"num_speculative_tokens": True}, "speculation.num_speculative_tokens", "must be an integer"),
    ({"num_draft_tokens": 2}, "speculation.num_draft_tokens", "is not a known key"),
    (3, "speculation", "must be an object"),
])  # fmt: skip
def test_bad_caps_are_refused_naming_the_field(target, prompts, spec, field, message):
    eng = make_engine(target, "ngram")
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("r", prompts[0], SamplingParams(temperature=0.0, speculation=spec))
    assert e.value.field == field and message in str(e.value) and str(e.value).startswith(field + ": ")
    assert not eng.has_unfinished() and eng.blocks.num_free == eng.blocks.num_blocks


def test_the_vllm_spelled_door_takes_speculation_as_a_dict(target, prompts):
    p = VllmSamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                           speculation={"num_speculative_tokens": 0})
    eng = make_engine(target, "ngram")
    [out] = eng.generate(prompts[:1], [p])
    assert p.num_speculative_tokens == 0 and isinstance(p.speculation, SpeculationParams)
    assert out.spec.num_drafts == 0
    assert SamplingParams(speculation={}).validate(max_speculative_tokens=K).num_speculative_tokens is None
