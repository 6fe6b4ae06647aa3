"""The async facade: streams, abort on early exit, queue bound, failure, drain."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine_utils import greedy, tiny_config
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import LLMEngine
from specserve.engine.stats import RequestFinishedStats
from specserve.errors import EngineDeadError, EngineDrainingError, QueueFullError
from specserve.request import FinishReason


@pytest.fixture
def aengine(tiny_llama):
    eng = AsyncEngine(LLMEngine(tiny_config(tiny_llama, "ngram", num_blocks=64)), max_queue=4)
    eng.start()
    yield eng
    eng.shutdown()


class StepGate:
    """Holds the engine thread before a step: ``hold_after(n)`` lets ``n`` more steps run
    (their outputs reach the consumers), then the next one waits until ``release()``.  So a
    request is in flight exactly as long as the test says, whatever the machine's speed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, engine: LLMEngine):
        self._steps_left: int | None = None  # None: not holding
        self._open = threading.Event()
        self._open.set()
        self.holding = threading.Event()  # the engine thread waits at the gate
        real_step = engine.step

        def step():
            left = self._steps_left  # read once: release() may run at any moment
            if left == 0:
                self.holding.set()
                self._open.wait()  # cleared by hold_after, so a release() at any time opens it
            elif left is not None:
                self._steps_left = left - 1
            return real_step()

        monkeypatch.setattr(engine, "step", step)

    def hold_after(self, steps: int) -> None:
        self._open.clear()
        self._steps_left = steps

    def release(self) -> None:
        self._steps_left = None
        self._open.set()

    def wait_holding(self) -> None:
        assert self.holding.wait(30), "the engine never reached the gate"


@pytest.fixture
def gate(aengine, monkeypatch):
    g = StepGate(monkeypatch, aengine.engine)
    yield g
    g.release()  # never leave the engine thread stuck (the engine shuts down after this)


class FinishReasons:
    """A stats listener: how each engine request ended."""

    def __init__(self):
        self.reasons: list[str] = []

    def on_step(self, stats) -> None:
        pass

    def on_request_finished(self, stats: RequestFinishedStats) -> None:
        self.reasons.append(stats.finish_reason)


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    """Poll; ``timeout_s`` is only a safety net against a hang."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


async def _collect(eng, rid, prompt, params):
    return [o async for o in eng.generate(rid, prompt, params)]


def test_stream_matches_offline_greedy(aengine, tiny_llama):
    prompt = [5, 6, 7, 8, 5, 6, 7]
    outs = asyncio.run(_collect(aengine, "a", prompt, greedy(16)))
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert sum((o.new_token_ids for o in outs), []) == outs[-1].token_ids
    offline = LLMEngine(tiny_config(tiny_llama)).generate([prompt], [greedy(16)])[0]
    assert outs[-1].token_ids == offline.token_ids


def test_consumer_that_stops_early_aborts_and_frees_blocks(aengine, gate):
    ended = FinishReasons()
    aengine.add_stats_listener(ended)
    blocks = aengine.engine.blocks
    gate.hold_after(1)  # the first output reaches the consumer, then the request cannot finish

    async def go():
        agen = aengine.generate("b", [5, 6, 7], greedy(200))
        async for out in agen:
            assert not out.finished
            break
        gate.wait_holding()
        assert blocks.num_free < blocks.num_blocks  # the request holds KV while the consumer leaves
        await agen.aclose()

    asyncio.run(go())
    assert aengine.num_in_flight == 0  # the stream is closed: its abort is queued
    gate.release()
    assert wait_until(lambda: blocks.num_free == blocks.num_blocks and not aengine.engine.requests)
    assert ended.reasons == ["abort"]


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


def test_drain_finishes_in_flight_and_refuses_new(aengine, gate):
    gate.hold_after(0)  # the request is admitted but takes no step until the drain has begun

    async def go():
        task = asyncio.ensure_future(_collect(aengine, "e", [5, 6, 7], greedy(12)))
        await asyncio.sleep(0)  # the task submits its request
        assert aengine.num_in_flight == 1
        drain = asyncio.ensure_future(aengine.drain(timeout_s=30))
        await asyncio.sleep(0)  # the drain refuses new work from now on
        with pytest.raises(EngineDrainingError):
            await _collect(aengine, "f", [5, 6, 7], greedy(4))
        assert not task.done()
        gate.release()
        await drain
        return await task

    outs = asyncio.run(go())
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert len(outs[-1].token_ids) == 12
