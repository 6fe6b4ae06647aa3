from __future__ import annotations

from specserve.kv_blocks import BlockManager
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Sequence, Status
from specserve.request import SamplingParams


def seq(rid: str, n: int, max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(range(5, 5 + n)), SamplingParams(max_tokens=max_tokens))


def test_prefill_then_decode_reserves_draft_room():
    s = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64, num_lookahead=3, max_model_len=64)
    a = seq("a", 6)
    s.add(a)
    out = s.schedule()
    (item,) = out.scheduled
    assert item.num_new_tokens == 6 and item.sample and item.draft_room == 0
    s.commit(a, 6)
    a.token_ids.append(9)  # the sampled token is pending ...
    a.draft_token_ids = [1, 2, 3, 4]  # ... with the drafts proposed after verification
    (item,) = s.schedule().scheduled
    assert item.num_new_tokens == 1 and item.draft_room == 3  # at most K
    assert len(a.block_table) == 3  # 7 tokens + 3 drafts = 10 positions


def test_no_pending_drafts_no_draft_room():
    s = Scheduler(BlockManager(16, 4), 4, 64, num_lookahead=3, max_model_len=64)
    a = seq("a", 6)
    s.add(a)
    s.schedule()
    s.commit(a, 6)
    a.token_ids.append(9)
    a.draft_token_ids = [1]
    (item,) = s.schedule().scheduled
    assert item.draft_room == 1 and len(a.block_table) == 2  # 7 tokens + 1 draft
    a.draft_token_ids = []
    (item,) = s.schedule().scheduled
    assert item.draft_room == 0


def test_draft_room_respects_max_model_len_not_max_tokens():
    s = Scheduler(BlockManager(16, 4), 4, 64, num_lookahead=5, max_model_len=10)
    a = seq("a", 7, max_tokens=1)
    s.add(a)
    s.schedule()
    s.commit(a, 7)
    a.token_ids.append(9)
    a.draft_token_ids = [1, 2, 3, 4, 5]
    (item,) = s.schedule().scheduled
    assert item.draft_room == 1  # max_model_len 10: 8 tokens + 1 draft + 1 emitted
    b = seq("b", 3, max_tokens=1)
    s.add(b)
    s.schedule()
    s.commit(b, 3)
    b.token_ids.append(9)
    b.draft_token_ids = [1, 2, 3, 4, 5]
    items = {i.seq.request_id: i for i in s.schedule().scheduled}
    assert items["b"].draft_room == 5  # a full round even though max_tokens is reached


def test_token_budget_chunks_prefill():
    s = Scheduler(BlockManager(16, 4), 4, max_num_batched_tokens=5, num_lookahead=0, max_model_len=64)
    a = seq("a", 12)
    s.add(a)
    (item,) = s.schedule().scheduled
    assert item.num_new_tokens == 5 and not item.sample


def test_waiting_when_blocks_run_out_and_preemption_frees_everything():
    bm = BlockManager(4, 4)
    s = Scheduler(bm, 4, 64, num_lookahead=0, max_model_len=64)
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
