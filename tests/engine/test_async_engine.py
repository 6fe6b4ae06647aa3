"""The async facade: streams, abort on early exit, queue bound, failure, drain."""

from __future__ import annotations

import asyncio

import pytest

from engine_utils import greedy, tiny_config
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import LLMEngine
from specserve.errors import EngineDeadError, EngineDrainingError, QueueFullError
from specserve.request import FinishReason


@pytest.fixture
def aengine(tiny_llama):
    eng = AsyncEngine(LLMEngine(tiny_config(tiny_llama, "ngram", num_blocks=64)), max_queue=4)
    eng.start()
    yield eng
    eng.shutdown()


async def _collect(eng, rid, prompt, params):
    return [o async for o in eng.generate(rid, prompt, params)]


def test_stream_matches_offline_greedy(aengine, tiny_llama):
    prompt = [5, 6, 7, 8, 5, 6, 7]
    outs = asyncio.run(_collect(aengine, "a", prompt, greedy(16)))
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert sum((o.new_token_ids for o in outs), []) == outs[-1].token_ids
    offline = LLMEngine(tiny_config(tiny_llama)).generate([prompt], [greedy(16)])[0]
    assert outs[-1].token_ids == offline.token_ids


def test_consumer_that_stops_early_aborts_and_frees_blocks(aengine):
    async def go():
        agen = aengine.generate("b", [5, 6, 7], greedy(200))
        async for out in agen:
            assert not out.finished
            break
        await agen.aclose()
        for _ in range(200):
            if aengine.engine.blocks.num_free == aengine.engine.blocks.num_blocks and not aengine.engine.requests:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(go())


def test_queue_bound_raises_queue_full(aengine):
    async def go():
        aengine.engine.scheduler.max_num_seqs = 1  # everything else waits
        gens = [aengine.generate(f"q{i}", [5, 6, 7], greedy(100)) for i in range(6)]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        done = await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
        return done

    results = asyncio.run(go())
    assert any(isinstance(r, QueueFullError) for r in results)


def test_engine_failure_fails_requests_and_health(aengine):
    def boom(*a, **k):
        raise RuntimeError("device lost")

    aengine.engine.runner.execute = boom
    outs = asyncio.run(_collect(aengine, "c", [5, 6, 7], greedy(8)))
    assert outs[-1].finished and outs[-1].error and "device lost" in outs[-1].error
    assert not aengine.healthy
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(aengine, "d", [5, 6, 7], greedy(8)))
    assert aengine.engine.blocks.num_free == aengine.engine.blocks.num_blocks


def test_drain_finishes_in_flight_and_refuses_new(aengine):
    async def go():
        task = asyncio.ensure_future(_collect(aengine, "e", [5, 6, 7], greedy(12)))
        await asyncio.sleep(0.05)
        await aengine.drain(timeout_s=30)
        outs = await task
        with pytest.raises(EngineDrainingError):
            await _collect(aengine, "f", [5, 6, 7], greedy(4))
        return outs

    outs = asyncio.run(go())
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
