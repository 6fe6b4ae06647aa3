"""The probe's text-loss case end to end: the embedded SmolLM2 with n-gram speculation,
asked to continue a row of emoji.  Accepted drafts deliver several tokens per step,
and step boundaries fall inside 4-byte characters; the text every API returns must
still equal one decode of the token ids (it lost 62 of 67 characters before).
"""

from __future__ import annotations

import grpc
import openai
import pytest
from server_testutil import server_config

from specserve.config import Config, ModelConfig, validate_config
from specserve.methods import method_options
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import LLMEngine
from specserve.server import start_servers
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(300)

PATTERN = "Continue the pattern: 🍎🍌🍎🍌🍎🍌🍎🍌"
MAX_TOKENS = 47  # odd: the last token is half an emoji (each is two tokens here)


@pytest.fixture(scope="module")
def served():
    cfg = Config(model=ModelConfig(dtype="float32"))
    cfg.method = method_options("ngram", num_speculative_tokens=5, prompt_lookup_min=2, prompt_lookup_max=5)
    cfg.engine.num_kv_blocks = 64
    llm = LLMEngine(validate_config(cfg))
    engine = AsyncEngine(llm, max_queue=8)
    handle = start_servers(server_config(max_tokens_cap=256), engine)
    channel = grpc.insecure_channel(f"127.0.0.1:{handle.grpc_port}")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{handle.http_port}/v1", api_key="x", max_retries=0, timeout=120)
    yield llm, pb_grpc.SpecServeStub(channel), client
    channel.close()
    client.close()
    handle.stop()


def test_emoji_text_survives_speculation(served):
    llm, stub, client = served
    msgs = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=PATTERN)])
    sp = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    resp = stub.Generate(pb.GenerateRequest(messages=msgs, sampling_params=sp), timeout=240)
    ids = list(resp.token_ids)
    want = llm.tokenizer.decode(ids)
    assert "🍎🍌" in want, want  # the model does continue the pattern
    assert resp.spec_decode.mean_acceptance_length > 2.0  # several tokens per step
    assert resp.text == want

    streamed = "".join(m.text for m in stub.GenerateStream(pb.GenerateRequest(messages=msgs, sampling_params=sp), timeout=240))
    assert streamed == want

    chat = [{"role": "user", "content": PATTERN}]
    r = client.chat.completions.create(model="", messages=chat, temperature=0, max_tokens=MAX_TOKENS)
    assert r.choices[0].message.content == want
    parts = client.chat.completions.create(model="", messages=chat, temperature=0, max_tokens=MAX_TOKENS, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == want
