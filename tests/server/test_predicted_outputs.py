"""Predicted Outputs through the servers around the REAL engine (tiny random llama,
float32, no speculative method: predictions alone draft).

Over the official ``openai`` client (chat and completions, streamed and not) and
gRPC (Generate and GenerateStream): the same request with a prediction answers
exactly what it answers without one, and ``usage.completion_tokens_details``
(gRPC: ``Usage``) carries the accepted and rejected prediction tokens; a bad
``prediction`` is a 400 / INVALID_ARGUMENT naming it; the KV cache ends empty.
"""

from __future__ import annotations

import grpc
import openai
import pytest
from engine_utils import tiny_config
from server_testutil import http_call, server_config, wait_for

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import LLMEngine
from specserve.server import start_servers
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
MAX_TOKENS = 30
PROMPTS = ["w10 w11 w12 w10 w11", "w7 w8 w9 w7 w8 w40", "w5 w6 w7 w8"]
CHAT = [{"role": "user", "content": "w20 w21 w20 w21"}]


class Served:
    def __init__(self, cfg):
        self.llm = LLMEngine(cfg)
        self.engine = AsyncEngine(self.llm, max_queue=64)
        self.handle = start_servers(server_config(max_tokens_cap=512, default_max_tokens=MAX_TOKENS), self.engine)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.handle.grpc_port}")
        self.stub = pb_grpc.SpecServeStub(self.channel)
        self.http = f"http://127.0.0.1:{self.handle.http_port}"
        self.client = openai.OpenAI(base_url=f"{self.http}/v1", api_key="unused", max_retries=0, timeout=30)

    def kv_free(self) -> bool:
        b = self.llm.blocks
        return b.num_free == b.num_blocks and not self.llm.requests and not self.llm.predictions.indexes

    def close(self) -> None:
        self.channel.close()
        self.client.close()
        self.handle.stop()


@pytest.fixture(scope="module")
def served(tiny_llama):
    s = Served(tiny_config(tiny_llama, num_blocks=256, block_size=4))
    yield s
    s.close()


def _edit(text: str) -> str:
    """A small edit of a word-level text: one word replaced, one inserted, one deleted."""
    words = text.split()
    words[2] = "w499"
    words.insert(6, "w498")
    del words[10]
    return " ".join(words)


def _details(usage) -> tuple[int, int]:
    d = usage.completion_tokens_details
    return d.accepted_prediction_tokens, d.rejected_prediction_tokens


def _complete(s: Served, prompt: str, prediction: str | None, stream: bool):
    extra = {"prediction": {"type": "content", "content": prediction}} if prediction is not None else None
    kw = dict(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra)
    if not stream:
        r = s.client.completions.create(**kw)
        return r.choices[0].text, r.usage
    text, usage = "", None
    for chunk in s.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    return text, usage


def _chat(s: Served, prediction, stream: bool):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    if prediction is not None:
        kw["prediction"] = {"type": "content", "content": prediction}
    if not stream:
        r = s.client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.usage
    text, usage = "", None
    for chunk in s.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        text += "".join(c.delta.content or "" for c in chunk.choices)
        usage = chunk.usage or usage
    return text, usage


@pytest.mark.parametrize("stream", [False, True])
def test_completions_with_prediction_equal_without(served, stream):
    for prompt in PROMPTS:
        ref, usage = _complete(served, prompt, None, stream)
        assert len(ref.split()) == MAX_TOKENS and _details(usage) == (0, 0)
        text, usage = _complete(served, prompt, ref, stream)  # the exact output
        assert text == ref
        acc, rej = _details(usage)
        assert rej == 0 and acc >= MAX_TOKENS - 1 - MAX_TOKENS // 8  # all but the first token and the bonuses
        text, usage = _complete(served, prompt, _edit(ref), stream)
        assert text == ref
        acc, rej = _details(usage)
        assert acc > MAX_TOKENS // 2 and rej > 0
        assert usage.completion_tokens == MAX_TOKENS
    assert wait_for(served.kv_free)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_prediction_equal_without(served, stream):
    ref, _ = _chat(served, None, stream)
    edited = _edit(ref)
    text, usage = _chat(served, [{"type": "text", "text": edited[:9]}, {"type": "text", "text": edited[9:]}], stream)
    assert text == ref
    acc, rej = _details(usage)
    assert acc > MAX_TOKENS // 2 and rej > 0
    text, usage = _chat(served, ref, stream)
    assert text == ref and _details(usage)[1] == 0
    assert wait_for(served.kv_free)


def test_grpc_with_prediction_equal_without(served):
    sp = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for prompt in PROMPTS:
        ref = served.stub.Generate(pb.GenerateRequest(prompt=prompt, sampling_params=sp, model=MODEL))
        assert (ref.usage.accepted_prediction_tokens, ref.usage.rejected_prediction_tokens) == (0, 0)
        req = pb.GenerateRequest(prompt=prompt, sampling_params=sp, model=MODEL, prediction=_edit(ref.text))
        r = served.stub.Generate(req)
        assert list(r.token_ids) == list(ref.token_ids) and r.text == ref.text
        assert r.usage.accepted_prediction_tokens > MAX_TOKENS // 2 and r.usage.rejected_prediction_tokens > 0
        msgs = list(served.stub.GenerateStream(req))
        assert [t for m in msgs for t in m.token_ids] == list(ref.token_ids)
        last = msgs[-1].usage
        assert (last.accepted_prediction_tokens, last.rejected_prediction_tokens) == (
            r.usage.accepted_prediction_tokens, r.usage.rejected_prediction_tokens)
    assert wait_for(served.kv_free)


@pytest.mark.parametrize(
    "prediction, param",
    [
        ("just text", "prediction"),
        ({"type": "other", "content": "x"}, "prediction"),
        ({"type": "content", "content": 3}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}, "prediction.content"),
        ({"type": "content", "content": "\ud800"}, "prediction"),
    ],
)
def test_bad_prediction_is_400_naming_it(served, prediction, param):
    status, body = http_call(f"{served.http}/v1/completions",
                             {"model": MODEL, "prompt": "w5 w6", "max_tokens": 4, "prediction": prediction})
    assert status == 400
    assert body["error"]["param"] == param


def test_bad_grpc_prediction_is_invalid_argument(served):
    sp = pb.SamplingParams(max_tokens=4, temperature=0.0)
    # word-level tiny tokenizer: 600 words -> 600 tokens, beyond max_model_len (512)
    req = pb.GenerateRequest(prompt="w5 w6", sampling_params=sp, model=MODEL, prediction=" ".join(["w7"] * 600))
    with pytest.raises(grpc.RpcError) as e:
        served.stub.Generate(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("prediction:")
    assert wait_for(served.kv_free)
