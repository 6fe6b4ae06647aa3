"""Output that is all U+FFFD must not stall the server's event loop.

Detokenisation runs on the server's loop (``AsyncEngine.generate``).  With the
embedded SmolLM2 and ``logit_bias={24211: 100}`` at temperature 0, every token is
24211, the real character U+FFFD: while such a stream runs, ``/health`` and a
second request are answered, each step of the stream decodes a bounded number of
ids (counted, not timed), and the streamed text equals one decode of its ids.
And a consumer with a backlog of outputs lets other tasks run between them.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from engine_utils import greedy, tiny_config
from server_testutil import http_call, server_config

from specserve.config import Config, ModelConfig, validate_config
from specserve.methods import method_options
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import LLMEngine
from specserve.engine.tokenizer import Tokenizer
from specserve.server import start_servers
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)

FFFD_ID = 24211  # SmolLM2's token for the complete bytes EF BF BD
LONG = 400  # tokens of the U+FFFD stream
PROBE_AT = 40  # streamed tokens before the probes: the stream is then well under way
SHORT = 4


class CountingTokenizer(Tokenizer):
    """The engine's tokenizer, counting the ids that decode calls are given."""

    def __init__(self, inner: Tokenizer):
        super().__init__(inner.hf, inner.eos_token_ids)
        self.decoded_ids = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_ids += len(ids)
        return super().decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def served():
    cfg = Config(model=ModelConfig(dtype="float32"))
    cfg.method = method_options("ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
    cfg.engine.num_kv_blocks = 128
    llm = LLMEngine(validate_config(cfg))
    engine = AsyncEngine(llm, max_queue=8)
    tok = engine.tokenizer = CountingTokenizer(engine.tokenizer)  # every stream detokenizes with it
    handle = start_servers(server_config(max_tokens_cap=LONG), engine)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.grpc_port}")
    yield engine, tok, pb_grpc.SpecServeStub(channel), f"http://127.0.0.1:{handle.http_port}"
    channel.close()
    handle.stop()


def fffd_request(max_tokens: int) -> pb.GenerateRequest:
    sp = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                           logit_bias=[pb.LogitBias(token_id=FFFD_ID, bias=100.0)])  # fmt: skip
    return pb.GenerateRequest(prompt="Write anything:", sampling_params=sp)


def test_fffd_stream_leaves_the_server_responsive(served):
    engine, tok, stub, http = served
    ids: list[int] = []
    text, finish, probes = "", None, None
    for msg in stub.GenerateStream(fffd_request(LONG), timeout=240):
        ids += msg.token_ids
        text += msg.text
        finish = msg.finish_reason or finish
        if probes is None and len(ids) >= PROBE_AT:
            # The stream's own progress is the clock: these must be answered while it runs.
            health = [http_call(f"{http}/health")[0] for _ in range(5)]
            short = http_call(f"{http}/v1/completions", {"prompt": "Hello", "max_tokens": SHORT, "temperature": 0})
            probes = (health, short, engine.num_in_flight)
    assert ids == [FFFD_ID] * LONG and finish == pb.FINISH_REASON_LENGTH
    assert text == tok.hf.decode(ids, skip_special_tokens=True) == "\ufffd" * LONG
    health, (status, body), in_flight = probes
    assert health == [200] * 5
    assert status == 200 and body["usage"]["completion_tokens"] == SHORT, body
    assert body["choices"][0]["text"] and body["choices"][0]["finish_reason"] == "length"
    assert in_flight == 1  # the U+FFFD stream was still running when both were answered
    # Decode work grows with the tokens, not with their square (a few ids per token).
    assert tok.decoded_ids <= 8 * (LONG + SHORT) + 100, tok.decoded_ids


# --------------------------------------------------------------------------- the consumer yields


def test_consumer_with_a_backlog_lets_other_tasks_run(tiny_llama):
    """All of a request's outputs are queued before its consumer reads them: reading
    them must still hand the loop to other tasks between outputs (``Queue.get`` does
    not suspend while items are queued)."""
    llm = LLMEngine(tiny_config(tiny_llama, num_blocks=128))
    engine = AsyncEngine(llm, max_queue=4)
    step, finished, after = llm.step, threading.Event(), threading.Event()

    def step_and_watch():
        if finished.is_set():
            after.set()  # the step that finished "r" has delivered its outputs
        outs = step()
        if any(o.finished and o.request_id.startswith("r#") for o in outs):
            finished.set()
        return outs

    llm.step = step_and_watch

    async def go() -> list[str]:
        keeper = engine.generate("k", [9, 8, 7], greedy(300))  # keeps the engine stepping
        await keeper.__anext__()
        stream = engine.generate("r", [5, 6, 7], greedy(32))
        events = [f"first:{len((await stream.__anext__()).token_ids)}"]
        assert await asyncio.get_running_loop().run_in_executor(None, after.wait, 60)

        async def ticker() -> None:
            while True:
                events.append("tick")
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        async for out in stream:
            events.append("out:finished" if out.finished else "out")
        task.cancel()
        await keeper.aclose()
        return events

    engine.start()
    try:
        events = asyncio.run(go())
    finally:
        engine.shutdown()
    outs = [e for e in events if e.startswith("out")]
    assert events[0] == "first:1" and len(outs) == 31 and outs[-1] == "out:finished"
    # Between any two outputs the other task ran.
    assert all(a == "tick" or b == "tick" for a, b in zip(events[1:], events[2:])), events
