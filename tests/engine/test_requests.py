"""A request's state has one owner (engine.requests) and one teardown; verification results are typed.

Finishing, aborting and preempting a request all go through ``RequestTable.release``:
afterwards nothing of the request is left anywhere -- not in the engine's table, not
in the proposer's per-request states, not in Predicted Outputs' indexes, not in any
KV block (the engine's or the draft model's).  A preempted request stays admitted
(it is recomputed later) but loses everything derived from its computed tokens.
Each verified request of a step gets a ``Verified`` on its scheduled entry.
"""

from __future__ import annotations

import pytest

from engine_utils import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from engine_utils import greedy, plain_outputs, random_prompts, tiny_config
from specserve.engine.engine import LLMEngine
from specserve.engine.requests import Drafts, RequestState, RequestTable, Verified
from specserve.engine.sequence import Sequence, Status
from specserve.request import FinishReason, SamplingParams

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, seed=3)


@pytest.fixture(scope="module")
def vanilla(tiny_llama, prompts):
    return plain_outputs(tiny_llama, prompts, MAX_TOKENS)


def engine(model_dir, **kw) -> LLMEngine:
    """A draft model (per-request states and KV blocks of its own) with Predicted Outputs."""
    return LLMEngine(tiny_config(model_dir, "draft_model", k=3, draft_dir=model_dir, **kw))


def params(prediction: list[int]) -> SamplingParams:
    return greedy(MAX_TOKENS, prediction_token_ids=prediction)


def state_of(eng: LLMEngine, rid: str) -> dict[str, bool]:
    """Where something of request ``rid`` is kept."""
    return {
        "engine": rid in eng.requests,
        "proposer": rid in eng.proposer.states,
        "predictions": rid in eng.predictions.indexes,
    }


def assert_nothing_left(eng: LLMEngine) -> None:
    assert not eng.requests and not eng.proposer.states and not eng.predictions.indexes
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.proposer.blocks.num_free == eng.proposer.blocks.num_blocks
    assert not eng.scheduler.running and not eng.scheduler.waiting


def add(eng: LLMEngine, prompts, predictions) -> list[str]:
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, pred in zip(ids, prompts, predictions):
        eng.add_request(rid, p, params(pred))
    return ids


def step_until_drafting(eng: LLMEngine, ids: list[str]) -> None:
    """Step until every request has state in every place (so its teardown has something to do)."""
    for _ in range(20):
        eng.step()
        if all(all(state_of(eng, rid).values()) for rid in ids):
            return
    raise AssertionError({rid: state_of(eng, rid) for rid in ids})


def test_finished_requests_leave_nothing_behind(tiny_llama, prompts, vanilla):
    eng = engine(tiny_llama)
    ids = add(eng, prompts, [v[::-1] for v in vanilla])  # predictions that draft and miss
    step_until_drafting(eng, ids)
    finished = []
    while eng.has_unfinished():
        finished += [o for o in eng.step() if o.finished]
    assert sorted(o.request_id for o in finished) == ids
    assert all(o.finish_reason is FinishReason.LENGTH for o in finished)
    assert_nothing_left(eng)


def test_aborted_requests_leave_nothing_behind_and_their_neighbours_keep_theirs(tiny_llama, prompts, vanilla):
    eng = engine(tiny_llama)
    ids = add(eng, prompts, [v[::-1] for v in vanilla])
    step_until_drafting(eng, ids)
    victim, *others = ids
    table = list(eng.requests[victim].seq.block_table)
    assert table and eng.requests[victim].drafts.token_ids  # blocks held, drafts waiting
    out = eng.abort_request(victim)
    assert out.finished and out.finish_reason is FinishReason.ABORT
    assert state_of(eng, victim) == {"engine": False, "proposer": False, "predictions": False}
    assert all(all(state_of(eng, rid).values()) for rid in others)
    held = {b for rid in others for b in eng.requests[rid].seq.block_table}
    assert not set(table) & held and eng.blocks.num_free == eng.blocks.num_blocks - len(held)
    for rid in others:
        eng.abort_request(rid)
    assert_nothing_left(eng)


def test_preempted_requests_keep_only_what_recomputing_needs(tiny_llama, prompts, vanilla):
    eng = engine(tiny_llama, num_blocks=24, block_size=4)
    preempted: list[str] = []
    schedule = eng.scheduler.schedule

    def watch():
        out = schedule()
        preempted.extend(s.request_id for s in out.preempted)
        return out

    eng.scheduler.schedule = watch
    ids = add(eng, prompts, [v[::-1] for v in vanilla])
    outs: dict[str, list[int]] = {rid: [] for rid in ids}
    checked = 0
    while eng.has_unfinished():
        before = len(preempted)
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
        for rid in preempted[before:]:
            if rid not in eng.requests or eng.requests[rid].seq.status is not Status.WAITING:
                continue  # re-admitted within the step: checked by the losslessness below
            st = eng.requests[rid]
            assert state_of(eng, rid) == {"engine": True, "proposer": False, "predictions": False}
            assert st.drafts == Drafts() and st.seq.block_table == [] and st.seq.num_computed == 0
            checked += 1
    assert checked > 0, "no request was preempted: the cache is too large for this test"
    assert [outs[rid] for rid in ids] == vanilla  # recomputed from its tokens, nothing lost
    assert_nothing_left(eng)


def test_a_failed_admission_leaves_nothing_behind(tiny_llama, prompts, monkeypatch):
    eng = engine(tiny_llama)

    def refuse(seq):
        raise RuntimeError("no room")

    monkeypatch.setattr(eng.scheduler, "add", refuse)
    with pytest.raises(Exception, match="no room"):
        eng.add_request("x", prompts[0], params([5, 6, 7]))
    assert "x" not in eng.requests
    monkeypatch.undo()
    eng.add_request("x", prompts[0], params([5, 6, 7]))  # the id is free again
    assert "x" in eng.requests


# --------------------------------------------------------------------------- the table on its own


class Recorder:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def remove(self, arg) -> None:
        self.log.append((self.name, arg if isinstance(arg, str) else arg.request_id))


def test_release_is_the_one_teardown():
    log: list = []
    table = RequestTable(Recorder(log, "scheduler"), [Recorder(log, "proposer"), None, Recorder(log, "predictions")])
    a = RequestState(Sequence("a", [1, 2], SamplingParams()), drafts=Drafts([3, 4], None, 1))
    b = RequestState(Sequence("b", [1, 2], SamplingParams()))
    table.add(a)
    table.add(b)
    assert table.num_pending_drafts(a.seq) == 2 and table.num_pending_drafts(b.seq) == 0
    table.release(a, finished=False)  # preempted: stays, loses its drafts and the method's state
    assert "a" in table and a.drafts == Drafts() and log == [("proposer", "a"), ("predictions", "a")]
    log.clear()
    table.release(a, finished=True)  # finished: leaves the scheduler and the table too
    assert log == [("proposer", "a"), ("predictions", "a"), ("scheduler", "a")]
    assert list(table) == ["b"] and len(table) == 1 and table.num_pending_drafts(a.seq) == 0


def test_drafts_cut_to_the_room_keep_the_prediction_count_within_it():
    d = Drafts([7, 8, 9], "q", num_from_prediction=3)
    assert d.first(2) == Drafts([7, 8], "q", 2) and d.first(5) == d


# --------------------------------------------------------------------------- typed verification results


def steps_with_entries(eng: LLMEngine):
    """Run the engine to the end; yield (scheduled entries, outputs) per step."""
    schedule = eng.scheduler.schedule
    last = []
    eng.scheduler.schedule = lambda: last.append(schedule()) or last[-1]
    while eng.has_unfinished():
        outs = eng.step()
        yield last[-1].scheduled, {o.request_id: o for o in outs}


def test_every_sampled_entry_gets_its_verification(tiny_llama, prompts, vanilla):
    cfg = tiny_config(tiny_llama, "ngram", k=3)
    cfg.engine.max_num_batched_tokens = 8  # prefill chunks (not sampled) beside decodes
    eng = LLMEngine(cfg)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(MAX_TOKENS, logprobs=2 if i == 1 else None))
    seen_chunk = seen_accept = False
    for entries, outs in steps_with_entries(eng):
        for s in entries:
            if not s.sample:
                assert s.verified is None and s.drafts.token_ids == []
                seen_chunk = True
                continue
            v = s.verified
            assert isinstance(v, Verified) and v.failure is None
            assert len(v.tokens) == v.num_accepted + 1 and v.num_accepted <= len(s.drafts.token_ids) <= 3
            assert v.tokens[: v.num_accepted] == s.drafts.token_ids[: v.num_accepted]
            out = outs[s.seq.request_id]
            assert out.new_token_ids == v.tokens[: len(out.new_token_ids)]
            assert (v.logprobs is not None) == (s.seq.request_id == "r1")
            if v.logprobs is not None:
                assert [lp.token_id for lp in v.logprobs] == v.tokens
            seen_accept |= v.num_accepted > 0
    assert seen_chunk and seen_accept


def test_a_failure_is_attached_to_its_own_entry(tiny_llama, prompts, monkeypatch):
    eng = LLMEngine(tiny_config(tiny_llama, "ngram", k=3))
    row = LLMEngine._sampling_row

    def fail_13(p):
        if p.max_tokens == 13:
            raise RuntimeError("bad row")
        return row(p)

    monkeypatch.setattr(LLMEngine, "_sampling_row", staticmethod(fail_13))
    eng.add_request("bad", prompts[0], greedy(13))
    eng.add_request("good", prompts[1], greedy(MAX_TOKENS))
    (entries, outs), *rest = list(steps_with_entries(eng))
    verified = {s.seq.request_id: s.verified for s in entries}
    assert isinstance(verified["bad"].failure, RuntimeError)
    assert verified["bad"].stage == "building its sampling tensors"
    assert verified["bad"].tokens == [] and verified["good"].failure is None and len(verified["good"].tokens) == 1
    assert outs["bad"].finished and "bad row" in str(outs["bad"].failure)
    assert not outs["good"].finished and len(rest) > 0
