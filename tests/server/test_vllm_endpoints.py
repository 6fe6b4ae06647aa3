"""vLLM's extra routes and defaults on the HTTP server, against the fake engine.

``/version``, ``/tokenize``, ``/detokenize``, ``/ping`` (GET and POST, open like
``/health``); tokenizing off the event loop; the served names and their aliases
(HTTP and gRPC); max_tokens defaults sized by the context instead of fixed caps;
the ``developer`` chat role on a real HF tokenizer.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from fake_engine import FakeEngine, FakeTokenizer, ModelInfo
from server_testutil import http_call, wait_for

import specserve
from specserve.config import ServerConfig
from specserve.engine.tokenizer import Tokenizer
from specserve.v1 import specserve_pb2 as pb

BOS = 257  # the test tokenizer's special token, added around a text like a BOS


class VllmTokenizer(FakeTokenizer):
    """The fake tokenizer with the real one's keywords: special tokens, the generation
    prompt, token texts; ``gate`` holds any encode of "HOLD" until it is set."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text == "HOLD":
            self.entered.set()
            self.gate.wait()
        ids = super().encode(text)
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        parts, run = [], []
        for t in ids:
            if t == BOS:
                parts.append(super().decode(run))
                run = []
                if not skip_special_tokens:
                    parts.append("<s>")
            else:
                run.append(t)
        return "".join(parts) + super().decode(run)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        ids = FakeTokenizer().apply_chat_template(messages)  # the template holds no BOS
        return ids if add_generation_prompt else ids[: -len(plain_ids("<|assistant|>"))]

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        return [BOS, *ids]

    def token_texts(self, ids: list[int]) -> list[str]:
        return ["<s>" if t == BOS else FakeTokenizer.decode(self, [t]) for t in ids]


def plain_ids(text: str) -> list[int]:
    return FakeTokenizer().encode(text)


def vllm_engine(max_model_len: int = 256, **kw) -> FakeEngine:
    engine = FakeEngine(ModelInfo(max_model_len=max_model_len), **kw)
    engine.tokenizer = VllmTokenizer()
    return engine


def defaults_config(**overrides) -> ServerConfig:
    """Loopback and no key, with the schema's own max_tokens defaults (no explicit limits)."""
    base = dict(host="127.0.0.1", grpc_port=0, http_port=0, api_key=None, api_key_env="", metrics_key_env="",
                drain_timeout_s=5.0)  # fmt: skip
    return ServerConfig(**{**base, **overrides})


@pytest.fixture
def vllm_served(make_served):
    return make_served(vllm_engine())


# --------------------------------------------------------------------------- /version, /ping


def test_version_and_ping(vllm_served):
    assert http_call(f"{vllm_served.http}/version") == (200, {"version": specserve.__version__})
    assert http_call(f"{vllm_served.http}/ping") == (200, {"status": "ok"})
    assert http_call(f"{vllm_served.http}/ping", {}) == (200, {"status": "ok"})  # POST, as SageMaker sends it
    vllm_served.engine.fail()
    assert wait_for(lambda: http_call(f"{vllm_served.http}/ping")[0] == 503)
    assert http_call(f"{vllm_served.http}/ping", {})[0] == 503


def test_the_api_key_guards_every_route_but_the_probes(make_served):
    s = make_served(vllm_engine(), api_key="sekret")
    key = {"Authorization": "Bearer sekret"}
    assert http_call(f"{s.http}/ping")[0] == 200 and http_call(f"{s.http}/ping", {})[0] == 200
    for path, body in (("/version", None), ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [105]})):
        status, answer = http_call(s.http + path, body)
        assert status == 401 and answer["error"]["type"] == "authentication_error", path
        assert http_call(s.http + path, body, headers=key)[0] == 200, path


# --------------------------------------------------------------------------- /tokenize, /detokenize


def test_tokenize_a_prompt_as_completions_does(vllm_served):
    status, out = http_call(f"{vllm_served.http}/tokenize", {"model": "fake-model", "prompt": "hello"})
    assert status == 200 and out == {"count": 6, "max_model_len": 256, "tokens": [BOS, *plain_ids("hello")]}
    done = vllm_served.openai().completions.create(model="fake-model", prompt="hello", max_tokens=2)
    assert done.usage.prompt_tokens == out["count"]
    status, out = http_call(f"{vllm_served.http}/tokenize",
                            {"prompt": "hi", "add_special_tokens": False, "return_token_strs": True})  # fmt: skip
    assert status == 200 and out["tokens"] == plain_ids("hi") and out["token_strs"] == ["h", "i"]


def test_tokenize_messages_as_chat_does(vllm_served):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    status, out = http_call(f"{vllm_served.http}/tokenize", {"messages": messages})
    flat = [messages[0], {"role": "user", "content": "hi"}]
    assert status == 200 and out["tokens"] == FakeTokenizer().apply_chat_template(flat)  # no BOS: the template's own
    done = vllm_served.openai().chat.completions.create(model="fake-model", messages=messages, max_tokens=2)
    assert done.usage.prompt_tokens == out["count"]
    _, bare = http_call(f"{vllm_served.http}/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert bare["tokens"] == out["tokens"][: -len(plain_ids("<|assistant|>"))]
    _, special = http_call(f"{vllm_served.http}/tokenize", {"messages": messages, "add_special_tokens": True})
    assert special["tokens"] == [BOS, *out["tokens"]]


def test_detokenize_round_trips_and_keeps_special_tokens(vllm_served):
    _, tok = http_call(f"{vllm_served.http}/tokenize", {"prompt": "héllo"})
    assert http_call(f"{vllm_served.http}/detokenize", {"tokens": tok["tokens"]}) == (200, {"prompt": "<s>héllo"})


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "continue_final_message": True},
     "continue_final_message"),
    ("/detokenize", {"tokens": [1, 300]}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])  # fmt: skip
def test_bad_tokenize_requests_are_400_naming_the_field(vllm_served, path, body, param):
    status, out = http_call(vllm_served.http + path, body)
    assert status == 400 and out["error"]["param"] == param, out


def test_unknown_model_on_tokenize_is_404(vllm_served):
    status, out = http_call(f"{vllm_served.http}/tokenize", {"model": "gpt-17", "prompt": "x"})
    assert status == 404 and out["error"]["code"] == "model_not_found"


def test_tokenizing_runs_off_the_event_loop(vllm_served):
    """While a /tokenize call is held inside the tokenizer, the server still answers."""
    tok = vllm_served.engine.tokenizer
    tok.gate.clear()
    result: list = []
    worker = threading.Thread(target=lambda: result.append(http_call(f"{vllm_served.http}/tokenize", {"prompt": "HOLD"})))
    worker.start()
    try:
        assert tok.entered.wait(30)
        assert http_call(f"{vllm_served.http}/ping") == (200, {"status": "ok"})
        assert http_call(f"{vllm_served.http}/version")[0] == 200
    finally:
        tok.gate.set()
        worker.join(30)
    assert result and result[0][0] == 200 and result[0][1]["count"] == 5


# --------------------------------------------------------------------------- served names


def test_every_served_name_is_listed_and_answers(make_served):
    s = make_served(vllm_engine(), served_model_aliases=["embedded:fake", "fake-b", "fake-model"])
    client = s.openai()
    assert [m.id for m in client.models.list().data] == ["fake-model", "embedded:fake", "fake-b"]
    for name in ("fake-model", "embedded:fake", "fake-b"):
        done = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert done.model == "fake-model"  # responses carry the first served name, as in vLLM
        assert client.models.retrieve(name).id == name
        assert s.stub.Generate(pb.GenerateRequest(model=name, prompt="hi")).usage.completion_tokens > 0
    status, out = http_call(f"{s.http}/v1/completions", {"model": "fake", "prompt": "hi"})
    assert status == 404 and out["error"]["code"] == "model_not_found"
    with pytest.raises(grpc.RpcError) as err:
        s.stub.Generate(pb.GenerateRequest(model="fake", prompt="hi"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


# --------------------------------------------------------------------------- max_tokens defaults


# The schema's own limits (server_config() sets small ones for the other tests): none, the context decides.
NO_LIMITS = dict(max_tokens_cap=ServerConfig().max_tokens_cap, default_max_tokens=ServerConfig().default_max_tokens)


def test_schema_defaults_leave_max_tokens_to_the_context():
    assert (ServerConfig().max_tokens_cap, ServerConfig().default_max_tokens) == (None, None)


def test_a_request_without_max_tokens_gets_the_room_the_context_leaves(make_served):
    s = make_served(vllm_engine(max_model_len=1024), **NO_LIMITS)
    messages = [{"role": "user", "content": "hi"}]
    n = len(FakeTokenizer().apply_chat_template(messages))
    done = s.openai().chat.completions.create(model="fake-model", messages=messages)
    assert done.usage.completion_tokens == 1024 - n and done.choices[0].finish_reason == "length"
    s.stub.Generate(pb.GenerateRequest(request_id="g", prompt="hello"))
    assert s.engine.requests["g"].params.max_tokens == 1024 - 6  # gRPC: the room too
    done = s.openai().completions.create(model="fake-model", prompt="hello")
    assert done.usage.completion_tokens == 16  # /v1/completions: OpenAI's and vLLM's 16


def test_max_tokens_is_capped_by_the_context_not_a_fixed_cap(make_served):
    s = make_served(vllm_engine(max_model_len=4200, step_delay_s=0.0), **NO_LIMITS)
    done = s.openai().completions.create(model="fake-model", prompt="hello", max_tokens=4100)
    assert done.usage.completion_tokens == 4100
    status, out = http_call(f"{s.http}/v1/completions", {"prompt": "hello", "max_tokens": 4200 - 5})
    assert status == 400 and out["error"]["param"] == "max_tokens"  # prompt + max_tokens beyond max_model_len


def test_the_default_fits_the_kv_cache_and_the_explicit_limits(make_served):
    engine = vllm_engine(max_model_len=1024)
    engine.output_room = lambda n: 4 * 16 - 3 - n  # as LLMEngine.output_room answers: 4 blocks of 16, K = 3
    s = make_served(engine, **NO_LIMITS)
    s.stub.Generate(pb.GenerateRequest(request_id="kv", prompt="hello"))
    assert engine.requests["kv"].params.max_tokens == 4 * 16 - 3 - 6  # one request's KV room, not max_model_len's
    t = make_served(vllm_engine(max_model_len=1024), max_tokens_cap=100, default_max_tokens=40)
    t.stub.Generate(pb.GenerateRequest(request_id="set", prompt="hello"))
    assert t.engine.requests["set"].params.max_tokens == 40
    assert t.openai().completions.create(model="fake-model", prompt="hello").usage.completion_tokens == 40
    status, out = http_call(f"{t.http}/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 101})  # fmt: skip
    assert status == 400 and out["error"]["param"] == "max_completion_tokens"
    u = make_served(vllm_engine(max_model_len=1024), max_tokens_cap=30, default_max_tokens=None)
    u.stub.Generate(pb.GenerateRequest(request_id="cap", prompt="hello"))
    assert u.engine.requests["cap"].params.max_tokens == 30  # the room, within the cap


# --------------------------------------------------------------------------- the developer role


def _role_tokenizer(template: str) -> Tokenizer:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "[", "]", "system", "developer", "user", "assistant", "be", "brief", "hi"]
    raw = RawTokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    hf.chat_template = template
    return Tokenizer(hf, (2,))


GENERIC = "{% for m in messages %}[ {{ m['role'] }} {{ m['content'] }} ] {% endfor %}{% if add_generation_prompt %}[ assistant {% endif %}"
WITH_DEVELOPER = "{# knows developer #}" + GENERIC


def test_the_developer_role_is_system_for_a_template_without_it():
    tok = _role_tokenizer(GENERIC)
    as_developer = tok.apply_chat_template([{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}])
    as_system = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert as_developer == as_system and tok.hf.convert_ids_to_tokens(as_system[:2]) == ["[", "system"]
    kept = _role_tokenizer(WITH_DEVELOPER).apply_chat_template([{"role": "developer", "content": "be brief"}])
    assert _role_tokenizer(WITH_DEVELOPER).hf.convert_ids_to_tokens(kept[:2]) == ["[", "developer"]
    bare = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert tok.hf.convert_ids_to_tokens(bare) == ["[", "user", "hi", "]"]
    assert tok.with_special_tokens(bare) == bare  # this tokenizer adds nothing around a text
