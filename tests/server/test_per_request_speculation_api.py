"""Per-request speculation over the wire: OpenAI's body field ``speculation:
{"num_speculative_tokens": k}`` (``extra_body`` in the official client) and gRPC's
``SamplingParams.speculation``, on a real engine (tiny llama, n-gram, K=3) and on a server
without a method (FakeEngine).

* requests with cap 0, 1, K and none, sent together, get the offline greedy text; each
  ``spec_decode`` reports its cap (``num_speculative_tokens``) and its drafts: none at cap
  0, at most one per step at cap 1;
* a bad cap is 400 / INVALID_ARGUMENT naming ``speculation.num_speculative_tokens`` (or the
  unknown key), and leaves the KV cache empty;
* a server without a method takes cap 0 and refuses k > 0 saying so.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from engine_utils import tiny_config
from fake_engine import FakeEngine, ModelInfo
from server_testutil import http_call, server_config, wait_for

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import LLMEngine
from specserve.request import SamplingParams
from specserve.server import start_servers
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
K = 3
MAX_TOKENS = 24
# Word prompts with repeats, so the n-gram proposer drafts (and sometimes is right).
PROMPTS = ["w10 w11 w12 w10 w11 w12 w10", "w30 w31 w30 w31 w30 w31"]
CAPS = [0, 1, K, None]
FIELD = "speculation.num_speculative_tokens"


class Real:
    def __init__(self, model_dir):
        self.llm = LLMEngine(tiny_config(model_dir, "ngram", k=K, num_blocks=128, block_size=4))
        self.engine = AsyncEngine(self.llm, max_queue=64)
        self.handle = start_servers(server_config(max_tokens_cap=512, default_max_tokens=MAX_TOKENS), self.engine)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.handle.grpc_port}")
        self.stub = pb_grpc.SpecServeStub(self.channel)
        self.http = f"http://127.0.0.1:{self.handle.http_port}"
        self.client = openai.OpenAI(base_url=f"{self.http}/v1", api_key="unused", max_retries=0, timeout=30)

    def kv_free(self) -> bool:
        b = self.llm.blocks
        return b.num_free == b.num_blocks and not self.llm.requests and self.engine.num_in_flight == 0

    def close(self) -> None:
        self.channel.close()
        self.client.close()
        self.handle.stop()


@pytest.fixture(scope="module")
def real(tiny_llama):
    s = Real(tiny_llama)
    yield s
    s.close()


@pytest.fixture(scope="module")
def plain(tiny_llama):
    """Plain decoding's greedy output of each prompt (no method, no prediction drafts)."""
    cfg = tiny_config(tiny_llama)
    cfg.engine.num_prediction_tokens = 0
    eng = LLMEngine(cfg)
    ids = [eng.tokenizer.encode(p) for p in PROMPTS]
    outs = eng.generate(ids, [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS) for _ in PROMPTS])
    return {p: o for p, o in zip(PROMPTS, outs)}


def extra(cap: int | None) -> dict:
    return {} if cap is None else {"speculation": {"num_speculative_tokens": cap}}


def check_spec(spec: dict, cap: int | None) -> None:
    assert spec["num_speculative_tokens"] == (K if cap is None else cap)
    if cap == 0:
        assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (0, 0, 0)
        assert spec["mean_acceptance_length"] == 1.0
    elif cap is not None:
        assert spec["num_draft_tokens"] <= cap * spec["num_drafts"]


def test_official_client_extra_body_caps_side_by_side(real, plain):
    jobs = [(p, c) for p in PROMPTS for c in CAPS]

    def one(job):
        prompt, cap = job
        return real.client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body=extra(cap))

    with ThreadPoolExecutor(len(jobs)) as pool:  # sent together: they share engine steps
        answers = list(pool.map(one, jobs))
    drafted = {c: 0 for c in CAPS}
    for (prompt, cap), r in zip(jobs, answers):
        assert r.choices[0].text == plain[prompt].text
        spec = r.model_extra["spec_decode"]
        check_spec(spec, cap)
        drafted[cap] += spec["num_drafts"]
    assert drafted[0] == 0 and drafted[1] > 0 and drafted[K] > 0  # the caps were not vacuous
    assert wait_for(real.kv_free)


def test_chat_streamed_reports_the_cap_on_its_last_chunk(real):
    messages = [{"role": "user", "content": "w20 w21 w20 w21 w20 w21"}]
    whole = real.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    for cap in (0, 1):
        text, specs = "", []
        for chunk in real.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                         temperature=0, stream=True, extra_body=extra(cap)):
            text += "".join(c.delta.content or "" for c in chunk.choices)
            if (chunk.model_extra or {}).get("spec_decode") is not None:
                specs.append(chunk.model_extra["spec_decode"])
        assert text == whole.choices[0].message.content
        assert len(specs) == 1  # on the final chunk only
        check_spec(specs[0], cap)
    assert whole.model_extra["spec_decode"]["num_speculative_tokens"] == K
    assert wait_for(real.kv_free)


@pytest.mark.parametrize("speculation, field, message", [
    ({"num_speculative_tokens": K + 1}, FIELD, f"must be in [0, {K}]"),
    ({"num_speculative_tokens": -1}, FIELD, "must be >= 0"),
    ({"num_speculative_tokens": "2"}, FIELD, "must be an integer"),
    ({"num_speculative_tokens": 2.0}, FIELD, "must be an integer"),
    ({"num_speculative_tokens": True}, FIELD, "must be an integer"),
    ({"num_speculative_tokens": 1, "k": 2}, "speculation.k", "is not a known key"),
    ([1], "speculation", "must be an object"),
])  # fmt: skip
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_bad_caps_are_400_naming_the_field(real, endpoint, speculation, field, message):
    body = {"model": MODEL, "max_tokens": 4, "speculation": speculation}
    body.update({"prompt": "w1 w2"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "w1"}]})
    status, answer = http_call(f"{real.http}/v1/{endpoint}", body)
    assert status == 400, answer
    err = answer["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}: ") and message in err["message"]
    assert wait_for(real.kv_free)


def test_the_official_client_gets_a_bad_request_error(real):
    with pytest.raises(openai.BadRequestError) as e:
        real.client.completions.create(model=MODEL, prompt="w1 w2", max_tokens=4, extra_body=extra(K + 1))
    assert e.value.status_code == 400 and FIELD in str(e.value)


def grpc_request(prompt: str, cap: int | None, max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    sp = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if cap is not None:
        sp.speculation.num_speculative_tokens = cap
    return pb.GenerateRequest(prompt=prompt, sampling_params=sp, model=MODEL)


def grpc_spec(msg: pb.GenerateResponse) -> dict:
    s = msg.spec_decode
    return {"num_speculative_tokens": s.num_speculative_tokens, "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens, "num_accepted_tokens": s.num_accepted_tokens,
            "mean_acceptance_length": s.mean_acceptance_length}  # fmt: skip


def test_grpc_caps_and_their_report(real, plain):
    prompt = PROMPTS[0]
    ref = plain[prompt]
    for cap in CAPS:
        r = real.stub.Generate(grpc_request(prompt, cap))
        assert list(r.token_ids) == ref.token_ids and r.text == ref.text
        check_spec(grpc_spec(r), cap)
        msgs = list(real.stub.GenerateStream(grpc_request(prompt, cap)))
        assert [t for m in msgs for t in m.token_ids] == ref.token_ids
        assert msgs[-1].spec_decode == r.spec_decode  # the last message reports the same figures
    # a speculation message without the field: the server's K
    req = grpc_request(prompt, None)
    req.sampling_params.speculation.SetInParent()
    assert real.stub.Generate(req).spec_decode.num_speculative_tokens == K
    assert wait_for(real.kv_free)


@pytest.mark.parametrize("stream", [False, True])
def test_grpc_cap_above_k_is_invalid_argument(real, stream):
    call = real.stub.GenerateStream if stream else real.stub.Generate
    with pytest.raises(grpc.RpcError) as e:
        result = call(grpc_request(PROMPTS[0], K + 1))
        if stream:
            list(result)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"{FIELD}: must be in [0, {K}]")
    assert wait_for(real.kv_free)


def test_a_server_without_a_method_takes_cap_zero_only(make_served):
    s = make_served(FakeEngine(ModelInfo(method="none", num_speculative_tokens=0)))
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 4, "speculation": {"num_speculative_tokens": 0}}
    status, answer = http_call(f"{s.http}/v1/completions", body)
    assert status == 200 and answer["spec_decode"]["num_speculative_tokens"] == 0
    assert answer["spec_decode"]["num_drafts"] == 0
    body["speculation"] = {"num_speculative_tokens": 1}
    status, answer = http_call(f"{s.http}/v1/completions", body)
    assert status == 400 and answer["error"]["param"] == FIELD
    assert "no speculative method" in answer["error"]["message"]
    sp = pb.SamplingParams(max_tokens=4)
    sp.speculation.num_speculative_tokens = 0
    assert s.stub.Generate(pb.GenerateRequest(prompt="hi", sampling_params=sp)).spec_decode.num_speculative_tokens == 0
    sp.speculation.num_speculative_tokens = 2
    with pytest.raises(grpc.RpcError) as e:
        s.stub.Generate(pb.GenerateRequest(prompt="hi", sampling_params=sp))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(FIELD)
    assert "no speculative method" in e.value.details()
