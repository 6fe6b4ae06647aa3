from __future__ import annotations

import pytest

from specserve.kv_blocks import BlockManager
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Sequence, Status
from specserve.request import SamplingParams


def seq(rid: str, n: int, max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(range(5, 5 + n)), SamplingParams(max_tokens=max_tokens))


class Pending(dict):
    """The drafts waiting per request id, counted for the scheduler as the engine's RequestTable does."""

    def __call__(self, s: Sequence) -> int:
        return len(self.get(s.request_id, []))


def test_prefill_then_decode_reserves_draft_room():
    drafts = Pending()
    s = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64, num_spec_tokens=3, max_model_len=64,
                  pending_drafts=drafts)
    a = seq("a", 6)
    s.add(a)
    out = s.schedule()
    (item,) = out.scheduled
    assert item.num_new_tokens == 6 and item.sample and item.draft_room == 0
    s.commit(a, 6)
    a.token_ids.append(9)  # the sampled token is pending ...
    drafts["a"] = [1, 2, 3, 4]  # ... with the drafts proposed after verification
    (item,) = s.schedule().scheduled
    assert item.num_new_tokens == 1 and item.draft_room == 3  # at most K
    assert len(a.block_table) == 3  # 7 tokens + 3 drafts = 10 positions


def test_no_pending_drafts_no_draft_room():
    drafts = Pending()
    s = Scheduler(BlockManager(16, 4), 4, 64, num_spec_tokens=3, max_model_len=64, pending_drafts=drafts)
    a = seq("a", 6)
    s.add(a)
    s.schedule()
    s.commit(a, 6)
    a.token_ids.append(9)
    drafts["a"] = [1]
    (item,) = s.schedule().scheduled
    assert item.draft_room == 1 and len(a.block_table) == 2  # 7 tokens + 1 draft
    drafts["a"] = []
    (item,) = s.schedule().scheduled
    assert item.draft_room == 0


def test_draft_room_respects_max_model_len_not_max_tokens():
    drafts = Pending()
    s = Scheduler(BlockManager(16, 4), 4, 64, num_spec_tokens=5, max_model_len=10, pending_drafts=drafts)
    a = seq("a", 7, max_tokens=1)
    s.add(a)
    s.schedule()
    s.commit(a, 7)
    a.token_ids.append(9)
    drafts["a"] = [1, 2, 3, 4, 5]
    (item,) = s.schedule().scheduled
    assert item.draft_room == 1  # max_model_len 10: 8 tokens + 1 draft + 1 emitted
    b = seq("b", 3, max_tokens=1)
    s.add(b)
    s.schedule()
    s.commit(b, 3)
    b.token_ids.append(9)
    drafts["b"] = [1, 2, 3, 4, 5]
    items = {i.seq.request_id: i for i in s.schedule().scheduled}
    assert items["b"].draft_room == 5  # a full round even though max_tokens is reached


def test_token_budget_chunks_prefill():
    s = Scheduler(BlockManager(16, 4), 4, max_num_batched_tokens=5, num_spec_tokens=0, max_model_len=64)
    a = seq("a", 12)
    s.add(a)
    (item,) = s.schedule().scheduled
    assert item.num_new_tokens == 5 and not item.sample


def test_waiting_when_blocks_run_out_and_preemption_frees_everything():
    bm = BlockManager(4, 4)
    s = Scheduler(bm, 4, 64, num_spec_tokens=0, max_model_len=64)
    a, b = seq("a", 8), seq("b", 8)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [i.seq.request_id for i in out.scheduled] == ["a", "b"]
    s.commit(a, 8)
    s.commit(b, 8)
    a.token_ids.append(1)
    b.token_ids.append(1)
    out = s.schedule()  # a needs a 3rd block: b (newest) is preempted
    assert [p.request_id for p in out.preempted] == ["b"]
    assert b.status is Status.WAITING and b.num_computed == 0 and b.block_table == []
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    s.remove(a)
    assert bm.num_free == 4


# --------------------------------------------------------------------------- chunked-prefill fairness


def _step(s: Scheduler, drafts: dict[str, list[int]] | None = None) -> dict[str, int]:
    """One engine step in pure Python: run what was scheduled (every draft rejected), sample
    a token where a chunk reached the end, drop finished sequences.  Returns
    {request id: tokens run}."""
    out = s.schedule()
    assert sum(i.num_new_tokens + i.draft_room for i in out.scheduled) <= s.max_num_batched_tokens
    ran = {}
    for item in out.scheduled:
        a = item.seq
        s.commit(a, a.num_computed + item.num_new_tokens)
        ran[a.request_id] = item.num_new_tokens
        if item.sample:
            a.token_ids.append(9)
            s.pending_drafts[a.request_id] = list((drafts or {}).get(a.request_id, []))
            if a.num_output_tokens >= a.params.max_tokens:
                s.remove(a)
                a.status = Status.FINISHED
    return ran


def _fair(threshold: int | None = None, budget: int = 64, max_num_seqs: int = 8, k: int = 0) -> Scheduler:
    kw = {} if threshold is None else {"long_prefill_token_threshold": threshold}
    return Scheduler(BlockManager(128, 16), max_num_seqs, budget, num_spec_tokens=k, max_model_len=2048,
                     pending_drafts=Pending(), **kw)


def test_a_short_request_starts_in_the_step_after_it_arrives_next_to_a_long_prefill():
    s = _fair()  # budget 64, default threshold 16
    long = seq("long", 640, max_tokens=1)
    s.add(long)
    assert _step(s) == {"long": 64}  # alone: the whole budget
    short = seq("short", 2, max_tokens=2)
    s.add(short)
    ran = _step(s)
    assert ran == {"long": 16, "short": 2}  # capped while someone waits; short samples its first token
    assert short.num_output_tokens == 1
    steps = 2
    while long.status is not Status.FINISHED:
        _step(s)
        steps += 1
    assert long.num_computed >= 640 and long.num_output_tokens == 1 and s.num_unfinished == 0  # it still completes
    assert steps <= 640 // 64 + 2  # back to full chunks once nobody waits


def test_decodes_are_never_starved_by_an_older_long_prefill():
    s = _fair(k=3)
    long = seq("long", 900, max_tokens=1)
    s.add(long)
    _step(s)
    d = seq("d", 3, max_tokens=12)
    s.add(d)
    drafts = {"d": [1, 2, 3]}
    _step(s, drafts)  # d is admitted next to the long prefill and samples its first token
    steps = 0
    while d.status is Status.RUNNING:
        ran = _step(s, drafts)
        steps += 1
        assert ran.get("d") == 1, ran  # d decodes every step ...
        assert ran["long"] == 64 - 4  # ... with its token and 3 drafts set aside before the prefill chunk
    assert steps == 11 and d.num_output_tokens == 12
    while s.num_unfinished:
        _step(s)
    assert long.num_output_tokens == 1 and s.blocks.num_free == s.blocks.num_blocks


def test_many_decodes_and_two_long_prefills_share_the_budget():
    s = _fair(budget=32, max_num_seqs=16)
    a, b = seq("a", 300, max_tokens=1), seq("b", 300, max_tokens=1)
    s.add(a)
    s.add(b)
    decoders = [seq(f"d{i}", 2, max_tokens=40) for i in range(6)]
    for d in decoders:
        s.add(d)
    first = _step(s)
    assert first == {"a": 8, "b": 8, **{d.request_id: 2 for d in decoders}}  # threshold 32 // 4 = 8
    for _ in range(10):  # a has 300 - 8 - 10 * 26 = 32 tokens left after these
        ran = _step(s)
        assert all(ran[d.request_id] == 1 for d in decoders), ran
        assert ran["a"] == 32 - 6 and "b" not in ran  # nobody waits: a's chunk takes what the decodes leave
    while s.num_unfinished:
        ran = _step(s)
        assert all(ran.get(d.request_id) == 1 for d in decoders if d.status is Status.RUNNING), ran
    assert a.num_output_tokens == b.num_output_tokens == 1 and s.blocks.num_free == s.blocks.num_blocks


def test_no_cap_when_alone_when_no_slot_is_free_or_when_disabled():
    s = _fair(max_num_seqs=1)
    s.add(seq("long", 300, max_tokens=1))
    s.add(seq("next", 2))
    assert _step(s) == {"long": 64}  # "next" could not be admitted anyway
    s = _fair(threshold=0)
    s.add(seq("long", 300, max_tokens=1))
    _step(s)
    s.add(seq("short", 2))
    assert _step(s) == {"long": 64}  # 0: no cap (the arrival waits, as without fairness)
    s = _fair(threshold=40)
    s.add(seq("long", 300, max_tokens=1))
    s.add(seq("short", 2))
    assert _step(s) == {"long": 40, "short": 2}


def _background(rid: str, n: int, max_tokens: int = 8) -> Sequence:
    b = seq(rid, n, max_tokens)
    b.background = True
    return b


def _yielding(background_tokens: int = 8) -> Scheduler:
    return Scheduler(BlockManager(128, 16), 8, 64, num_spec_tokens=0, max_model_len=2048, pending_drafts=Pending(),
                     background_tokens=background_tokens)  # long_prefill_token_threshold 16


def test_background_prefill_yields_to_a_foreground_decode_and_runs_whole_otherwise():
    s = _yielding()
    a = _background("a", 200, max_tokens=2)
    s.add(a)
    assert _step(s) == {"a": 64}  # nothing in the foreground: the whole budget
    chat = seq("chat", 3, max_tokens=12)
    s.add(chat)
    assert _step(s) == {"a": 8, "chat": 3}  # chat waits: the background yields already
    b = _background("b", 100, max_tokens=2)
    s.add(b)
    steps = 0
    while chat.status is Status.RUNNING:
        ran = _step(s)
        steps += 1
        assert ran["chat"] == 1  # chat decodes every step ...
        assert sum(n for r, n in ran.items() if r != "chat") <= 8, ran  # ... beside 8 background tokens at most
    assert steps == 11
    ran = _step(s)
    assert sum(ran.values()) > 8  # alone again: background work takes the whole budget
    while s.num_unfinished:
        _step(s)
    assert a.num_output_tokens == 2 and b.num_output_tokens == 2 and s.blocks.num_free == s.blocks.num_blocks


def test_background_decodes_do_not_cap_each_other_and_a_foreground_arrival_is_admitted():
    """Background decodes count against the budget only beside a foreground decode."""
    s = _yielding(background_tokens=4)
    a = _background("a", 10, max_tokens=30)
    s.add(a)
    _step(s)  # a decodes from now on
    b = _background("b", 100, max_tokens=1)
    s.add(b)
    assert _step(s) == {"a": 1, "b": 63}  # a background decode is no reason to yield
    c = _background("c", 100, max_tokens=1)
    chat = seq("chat", 2, max_tokens=5)
    _step(s)
    s.add(c)
    s.add(chat)
    ran = _step(s)
    assert ran["chat"] == 2  # chat starts although c (queued first) is not admitted yet...
    ran = _step(s)
    assert ran["chat"] == 1 and sum(n for r, n in ran.items() if r != "chat") == 4, ran  # ...then a and c share 4
    assert _yielding(0).background_tokens == 0  # 0: no cap


def test_a_background_decode_s_drafts_are_cut_to_the_budget_but_a_first_pass_keeps_its_own():
    drafts = Pending()
    s = Scheduler(BlockManager(128, 16), 8, 64, num_spec_tokens=6, max_model_len=2048, pending_drafts=drafts,
                  background_tokens=4)
    chat, a = seq("chat", 3, max_tokens=40), _background("a", 10, max_tokens=40)
    s.add(a)
    drafts["a"] = [1] * 6  # a's first drafts (a CTC hypothesis) ride on its prompt's last chunk
    out = {i.seq.request_id: (i.num_new_tokens, i.draft_room) for i in s.schedule().scheduled}
    assert out == {"a": (10, 6)}  # nothing in the foreground: nothing cut
    s.commit(a, len(a.token_ids))
    a.token_ids.append(9)
    s.add(chat)
    out = {i.seq.request_id: (i.num_new_tokens, i.draft_room) for i in s.schedule().scheduled}
    assert out == {"a": (1, 3), "chat": (3, 0)}  # chat arrives: a's 1 + 3 drafts = 4
    for i in (chat, a):
        s.commit(i, len(i.token_ids))
        i.token_ids.append(9)
    drafts["chat"], drafts["a"] = [1] * 6, [1] * 6
    out = {i.seq.request_id: (i.num_new_tokens, i.draft_room) for i in s.schedule().scheduled}
    assert out == {"a": (1, 3), "chat": (1, 6)}  # beside chat's decode: the same
    b = _background("b", 20, max_tokens=5)
    s.add(b)
    drafts["b"] = [1] * 6
    for i in (chat, a):
        s.commit(i, len(i.token_ids))
        i.token_ids.append(9)
    s.pending_drafts = Pending(chat=[1] * 6, b=[1] * 6)  # a drafts nothing this step
    out = {i.seq.request_id: (i.num_new_tokens, i.draft_room) for i in s.schedule().scheduled}
    assert out == {"a": (1, 0), "chat": (1, 6), "b": (3, 0)}  # b's prompt chunks fill the rest


def test_beside_a_foreground_the_background_share_comes_in_one_step_of_each_period():
    s = Scheduler(BlockManager(128, 16), 8, 64, num_spec_tokens=0, max_model_len=2048, pending_drafts=Pending(),
                  background_tokens=4, background_period=3)
    chat, a = seq("chat", 2, max_tokens=10), _background("a", 200, max_tokens=1)
    s.add(chat)
    s.add(a)
    shares = [_step(s).get("a", 0) for _ in range(9)]
    assert shares == [12, 0, 0, 12, 0, 0, 12, 0, 0]  # 4 a step, granted 3 steps' worth at once
    while chat.status is Status.RUNNING:
        _step(s)
    assert _step(s)["a"] > 12  # alone: the whole budget again


def test_background_alone_runs_at_most_its_own_step_cap():
    drafts = Pending()
    s = Scheduler(BlockManager(128, 16), 8, 64, num_spec_tokens=6, max_model_len=2048, pending_drafts=drafts,
                  background_tokens=4, background_tokens_alone=20)
    a, b = _background("a", 30, max_tokens=3), _background("b", 30, max_tokens=3)
    s.add(a)
    s.add(b)
    assert _step(s) == {"a": 16, "b": 4}  # a capped at the arrival threshold (b waits), b the rest of 20
    while s.num_unfinished:
        ran = _step(s)
        assert sum(ran.values()) <= 20
    assert s.blocks.num_free == s.blocks.num_blocks


def test_long_prefill_token_threshold_is_validated_and_defaults_to_a_quarter_of_the_budget():
    from specserve.config import Config, validate_config
    from specserve.errors import ConfigError

    cfg = Config()
    cfg.engine.long_prefill_token_threshold = -1
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert "engine.long_prefill_token_threshold" in str(err.value)
    cfg.engine.long_prefill_token_threshold = 0
    assert validate_config(cfg).engine.long_prefill_token_threshold == 0
    assert _fair(budget=2048).long_prefill_token_threshold == 512


def test_engine_greedy_output_is_unchanged_and_short_requests_finish_first(tiny_llama):
    """The real engine on a tiny model: short requests arriving while a long prompt prefills
    in chunks get their tokens within a few steps, and every output equals the request's
    output when it runs alone (greedy)."""
    from engine_utils import greedy, random_prompts, tiny_config

    from specserve.engine.engine import LLMEngine

    long_prompt = random_prompts(1, seed=5, lo=300, hi=301)[0]
    shorts = random_prompts(3, seed=6, lo=2, hi=5)
    alone = LLMEngine(tiny_config(tiny_llama, "ngram", k=3))
    want = [o.token_ids for o in alone.generate([long_prompt, *shorts], [greedy(6)] + [greedy(4)] * 3)]

    cfg = tiny_config(tiny_llama, "ngram", k=3)
    cfg.engine.max_num_batched_tokens = 32
    eng = LLMEngine(cfg)
    eng.add_request("long", long_prompt, greedy(6))
    got: dict[str, list[int]] = {}
    finished_at: dict[str, int] = {}
    for step in range(1, 200):
        if step == 2:
            for i, p in enumerate(shorts):
                eng.add_request(f"s{i}", p, greedy(4))
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.token_ids
                finished_at[out.request_id] = step
        if not eng.has_unfinished():
            break
    assert [got["long"], got["s0"], got["s1"], got["s2"]] == want
    assert all(finished_at[f"s{i}"] <= 2 + 4 for i in range(3)), finished_at  # prefill + 3 decode steps
    assert finished_at["long"] > max(finished_at[f"s{i}"] for i in range(3))
    assert eng.blocks.num_free == eng.blocks.num_blocks
