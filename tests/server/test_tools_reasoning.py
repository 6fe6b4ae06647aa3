"""Tools and reasoning on a real engine over loopback, with the official openai client.

A tiny random Qwen3 with a Qwen-style tools + thinking template (tests/tiny_chat_models.py:
the think block opened in the prompt, closed by ``enable_thinking: false``) and a tiny
Llama with a Llama 3.1-style template, both detected as their formats (hermes + qwen3,
llama3_json).  The random models never write a call on their own: calls come from
"required" and named choices, enforced by the grammar after the reasoning, whose end a
thinking budget forces.  Greedy answers are the same with n-gram speculation and without,
streamed (``client.chat.completions.stream``) and not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai
import pytest
from server_testutil import http_call, server_config, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_utils import tiny_config  # noqa: E402
from tiny_chat_models import make_llama_chat_model, make_qwen_chat_model  # noqa: E402

from specserve.engine.async_engine import AsyncEngine  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.server import start_servers  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK_END = "</think>"


class Served:
    def __init__(self, model_dir: Path, method: str | None = None, **server):
        self.llm = LLMEngine(tiny_config(model_dir, method, k=3, num_blocks=1024))
        self.engine = AsyncEngine(self.llm, max_queue=64)
        self.handle = start_servers(server_config(max_tokens_cap=512, default_max_tokens=48, **server), self.engine)
        self.http = f"http://127.0.0.1:{self.handle.http_port}"
        self.client = openai.OpenAI(base_url=f"{self.http}/v1", api_key="x", max_retries=0, timeout=60)

    def kv_free(self) -> bool:
        b = self.llm.blocks
        return b.num_free == b.num_blocks and not self.llm.requests

    def close(self) -> None:
        self.client.close()
        self.handle.stop()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return make_qwen_chat_model(tmp_path_factory.mktemp("qwen-chat") / "m")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_llama_chat_model(tmp_path_factory.mktemp("llama-chat") / "m")


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    s = Served(qwen_dir)
    yield s
    s.close()


@pytest.fixture(scope="module")
def qwen_ngram(qwen_dir):
    s = Served(qwen_dir, "ngram")
    yield s
    s.close()


@pytest.fixture(scope="module")
def llama(llama_dir):
    s = Served(llama_dir, "ngram")
    yield s
    s.close()


def rendered(s: Served, body: dict) -> str:
    status, out = http_call(f"{s.http}/tokenize", body)
    assert status == 200, out
    status, text = http_call(f"{s.http}/detokenize", {"tokens": out["tokens"]})
    return text["prompt"]


EXTRA = ("thinking_token_budget", "separate_reasoning", "chat_template_kwargs")  # not in OpenAI's signature


def _kw(kw: dict) -> dict:
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", USER)
    kw.setdefault("temperature", 0)
    extra = {k: kw.pop(k) for k in EXTRA if k in kw}
    if extra:
        kw["extra_body"] = extra
    return kw


def chat(s: Served, **kw):
    return s.client.chat.completions.create(**_kw(kw))


def stream(s: Served, **kw):
    """The answer as the openai client's stream helper assembles it."""
    with s.client.chat.completions.stream(**_kw(kw)) as st:
        for _ in st:
            pass
        snapshot = st.current_completion_snapshot
        if snapshot.choices[0].finish_reason == "length":  # the helper refuses to parse a cut answer
            return snapshot
        return st.get_final_completion()


def summary(choice) -> tuple:
    m = choice.message
    calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return m.content or None, getattr(m, "reasoning", None), calls, choice.finish_reason  # a stream's role chunk sends ""


# --------------------------------------------------------------------------- the prompt


def test_formats_are_detected_from_the_templates(qwen, llama):
    assert (qwen.llm.info.tool_call_format, qwen.llm.info.reasoning_format) == ("hermes", "qwen3")
    assert (llama.llm.info.tool_call_format, llama.llm.info.reasoning_format) == ("llama3_json", None)


def test_tools_and_history_reach_the_template(qwen, llama):
    history = USER + [
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
    ]  # fmt: skip
    text = rendered(qwen, {"messages": history, "tools": TOOLS})
    assert json.dumps(WEATHER) in text  # tools as JSON lines in <tools>
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert "<think>\nLook it up.\n</think>" in text  # reasoning_content handed back
    assert "<tool_response>\nsunny, 21\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")  # the think block opens in the prompt
    # reasoning sent back as `reasoning` is read too
    history[1] = {**history[1], "reasoning": history[1].pop("reasoning_content")}
    assert "<think>\nLook it up.\n</think>" in rendered(qwen, {"messages": history, "tools": TOOLS})
    off = rendered(qwen, {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith("<think>\n\n</think>\n\n")
    llama_text = rendered(llama, {"messages": history, "tools": TOOLS})
    assert "respond with a JSON for a function call" in llama_text and json.dumps(TIME) in llama_text
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}' in llama_text


def test_server_default_template_kwargs(qwen_dir):
    s = Served(qwen_dir, default_chat_template_kwargs={"enable_thinking": False})
    try:
        assert rendered(s, {"messages": USER}).endswith("<think>\n\n</think>\n\n")
        # the request's own keywords win
        assert rendered(s, {"messages": USER, "chat_template_kwargs": {"enable_thinking": True}}).endswith("<think>\n")
    finally:
        s.close()


# --------------------------------------------------------------------------- reasoning


def test_reasoning_split_and_budget_exact(qwen, qwen_ngram):
    """The prompt opens the think block: the answer starts as reasoning.  A budget of 7 tokens:
    exactly 7 reasoning tokens, then </think>, then content; with n-gram speculation the same."""
    out = {}
    for s in (qwen, qwen_ngram):
        r = chat(s, max_tokens=30, thinking_token_budget=7, logprobs=True)
        tokens = [t.token for t in r.choices[0].logprobs.content]
        assert tokens.index(THINK_END) == 7
        assert r.choices[0].message.model_extra["reasoning"] == r.choices[0].message.model_extra["reasoning_content"]
        out[s] = summary(r.choices[0])
        streamed = stream(s, max_tokens=30, thinking_token_budget=7, logprobs=True).choices[0]
        assert summary(streamed) == out[s]
        assert [t.token for t in streamed.logprobs.content] == tokens  # every token's logprob, once
    assert out[qwen] == out[qwen_ngram]
    reasoning = out[qwen][1]
    assert reasoning  # the budget's tokens, split off the content
    assert THINK_END not in (out[qwen][0] or "") and THINK_END not in reasoning


def test_budget_zero_and_separate_reasoning_false(qwen):
    r = chat(qwen, max_tokens=10, thinking_token_budget=0, logprobs=True)
    assert r.choices[0].logprobs.content[0].token == THINK_END
    assert r.choices[0].message.model_extra["reasoning"] is None
    r = chat(qwen, max_tokens=10, thinking_token_budget=3, separate_reasoning=False)
    assert THINK_END in r.choices[0].message.content  # left in the content as written
    assert "reasoning" not in r.choices[0].message.model_extra


def test_enable_thinking_false_is_all_content(qwen):
    r = chat(qwen, max_tokens=12, chat_template_kwargs={"enable_thinking": False})
    assert r.choices[0].message.model_extra["reasoning"] is None and r.choices[0].message.content


# --------------------------------------------------------------------------- forced calls


@pytest.mark.parametrize("parallel", [True, False])
def test_required_after_a_think_block(qwen, qwen_ngram, parallel):
    """"required": reasoning first (a budget ends it), then the grammar forces calls; the same
    greedy answer with and without speculation, streamed and not."""
    kw = dict(tools=TOOLS, tool_choice="required", thinking_token_budget=5, max_tokens=200,
              parallel_tool_calls=parallel)  # fmt: skip
    answers = []
    for s in (qwen, qwen_ngram):
        r = chat(s, **kw)
        answers.append(summary(r.choices[0]))
        assert summary(stream(s, **kw).choices[0]) == answers[-1]
        assert wait_for(s.kv_free)
    assert answers[0] == answers[1]
    content, reasoning, calls, finish = answers[0]
    assert reasoning and content is None
    assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
    if parallel:  # the random model may keep calling until max_tokens: the last call may be cut
        assert finish in ("tool_calls", "length")
        complete = calls if finish == "tool_calls" else calls[:-1]
    else:
        assert len(calls) == 1 and finish == "tool_calls"
        complete = calls
    for name, args in complete:
        parsed = json.loads(args)
        assert set(parsed) == ({"city", "unit"} if name == "get_weather" else {"zone"})


def test_named_function_finishes_with_stop(qwen_ngram, llama):
    for s in (qwen_ngram, llama):
        r = chat(s, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                 **({"thinking_token_budget": 2} if s is qwen_ngram else {}), max_tokens=100)  # fmt: skip
        (name, args), = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        assert name == "get_time" and json.loads(args)["zone"] in ("utc", "cet")
        assert r.choices[0].finish_reason == "stop"  # OpenAI's for a named function


def test_enable_thinking_false_then_required(qwen):
    """The prompt closes the think block: the grammar constrains the answer from its first token."""
    r = chat(qwen, tools=[WEATHER], tool_choice="required", chat_template_kwargs={"enable_thinking": False},
             parallel_tool_calls=False, max_tokens=100)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].message.model_extra["reasoning"] is None


def test_auto_reads_no_calls_from_plain_text(qwen):
    r = chat(qwen, tools=TOOLS, max_tokens=16, thinking_token_budget=3)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("length", "stop")


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("body, field", [
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [TIME, TIME]}, "tools[1].function.name"),
    ({"tools": [TIME] * 129}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string"}}}, "strict": True}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "nope"}}]}, "tools[0].function.parameters"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}]}, "tools[0]"),
])  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(qwen, body, field):
    status, out = http_call(f"{qwen.http}/v1/chat/completions", {"model": MODEL, "messages": USER, **body})
    assert status == 400, out
    assert out["error"]["param"] == field, out
    assert wait_for(qwen.kv_free)


def test_auto_without_a_format_names_the_key(tmp_path_factory):
    """A model with no tool-call format answers "auto" with a 400 saying which key to set."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_byte_model import make_byte_model

    s = Served(make_byte_model(tmp_path_factory.mktemp("byte-plain") / "m"))
    try:
        status, out = http_call(f"{s.http}/v1/chat/completions", {"model": MODEL, "messages": USER, "tools": TOOLS})
        assert status == 400 and out["error"]["param"] == "tool_choice"
        assert "model.tool_call_format" in out["error"]["message"]
        status, out = http_call(f"{s.http}/v1/chat/completions",
                                {"model": MODEL, "messages": USER, "thinking_token_budget": 3})  # fmt: skip
        assert status == 400 and out["error"]["param"] == "thinking_token_budget"
        # required works without a format: plain JSON, as vLLM forces it
        r = chat(s, tools=[TIME], tool_choice="required", max_tokens=60)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    finally:
        s.close()


# --------------------------------------------------------------------------- gRPC


def test_grpc_carries_tools_tool_calls_and_reasoning(qwen_ngram):
    import grpc

    from specserve.v1 import specserve_pb2 as pb
    from specserve.v1 import specserve_pb2_grpc as pb_grpc

    s = qwen_ngram
    channel = grpc.insecure_channel(f"127.0.0.1:{s.handle.grpc_port}")
    stub = pb_grpc.SpecServeStub(channel)
    try:
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert (info.tool_call_format, info.reasoning_format) == ("hermes", "qwen3")
        tools = [pb.Tool(name=t["function"]["name"], parameters_json=json.dumps(t["function"]["parameters"]))
                 for t in TOOLS]  # fmt: skip
        req = pb.GenerateRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=USER[0]["content"])]),
            sampling_params=pb.SamplingParams(temperature=0, max_tokens=200, thinking_token_budget=5),
            tools=tools, tool_choice=pb.ToolChoice(mode="required"), parallel_tool_calls=False, model=MODEL,
        )  # fmt: skip
        whole = stub.Generate(req)
        assert whole.finish_reason == pb.FINISH_REASON_TOOL_CALLS and whole.reasoning and not whole.content
        (call,) = whole.tool_calls
        # the same answer over HTTP
        http = chat(s, tools=TOOLS, tool_choice="required", thinking_token_budget=5, max_tokens=200,
                    parallel_tool_calls=False)  # fmt: skip
        assert summary(http.choices[0]) == (None, whole.reasoning, [(call.name, call.arguments)], "tool_calls")
        # streamed: a call's first delta has its id and name, then argument fragments
        reasoning, calls, finish = "", {}, None
        for msg in stub.GenerateStream(req):
            reasoning += msg.reasoning
            for c in msg.tool_calls:
                if c.id:
                    assert c.index not in calls and not c.arguments
                    calls[c.index] = [c.id, c.name, ""]
                else:
                    calls[c.index][2] += c.arguments
            finish = msg.finish_reason or finish
        assert reasoning == whole.reasoning and finish == pb.FINISH_REASON_TOOL_CALLS
        assert [(n, a) for _, n, a in calls.values()] == [(call.name, call.arguments)]
        # history with a call and its result reaches the template
        history = pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content="hi"),
            pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_time", arguments='{"zone": "utc"}')]),
            pb.ChatMessage(role="tool", tool_call_id="c1", content="12:00"),
        ])  # fmt: skip
        out = stub.Generate(pb.GenerateRequest(messages=history, model=MODEL, sampling_params=pb.SamplingParams(
            temperature=0, max_tokens=4, thinking_token_budget=1)))  # fmt: skip
        assert out.finish_reason == pb.FINISH_REASON_LENGTH and list(out.token_ids).index(262) == 1  # </think>
        for bad, field in [
            (pb.GenerateRequest(prompt="hi", tools=tools, model=MODEL), "tools"),
            (pb.GenerateRequest(messages=req.messages, tools=tools, tool_choice=pb.ToolChoice(function="nope")),
             "tool_choice.function.name"),
            (pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="tool", content="x")])),
             "messages[0].tool_call_id"),
            (pb.GenerateRequest(messages=req.messages, tools=[pb.Tool(name="f", parameters_json="{")]),
             "tools[0].parameters_json"),
        ]:  # fmt: skip
            with pytest.raises(grpc.RpcError) as e:
                stub.Generate(bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field + ":")
    finally:
        channel.close()


def test_model_chat_template_replaces_the_tokenizers(tmp_path_factory):
    """model.chat_template (vLLM's --chat-template): a plain model gets a tools + thinking
    template, and the formats are detected from it."""
    from tiny_byte_model import make_byte_model
    from tiny_chat_models import QWEN_TEMPLATE

    path = make_byte_model(tmp_path_factory.mktemp("byte-templated") / "m")
    template = tmp_path_factory.mktemp("tmpl") / "qwen.jinja"
    template.write_text(QWEN_TEMPLATE)
    cfg = tiny_config(path)
    cfg.model.chat_template = str(template)
    llm = LLMEngine(cfg)
    assert (llm.info.tool_call_format, llm.info.reasoning_format) == ("hermes", "qwen3")
    ids = llm.tokenizer.apply_chat_template(USER, tools=TOOLS)
    assert json.dumps(TIME) in llm.tokenizer.decode(ids, skip_special_tokens=False)


def test_auto_with_strict_tools_is_enforced_after_the_call_tag(qwen):
    """"auto" with a strict tool: free text, or calls whose arguments follow the schema; the
    tokenizer's <tool_call> token starts a call (a logit bias makes the random model write it)."""
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    kw = dict(tools=[strict], parallel_tool_calls=False, logit_bias={"263": 100}, max_tokens=100,
              chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    r = chat(qwen, **kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "unit"}
    assert r.choices[0].finish_reason == "tool_calls"
    assert summary(stream(qwen, **kw).choices[0]) == summary(r.choices[0])
    # not strict: read as written (the random model's text after the tag is no call)
    loose = chat(qwen, **{**kw, "tools": [WEATHER]})
    assert not loose.choices[0].message.tool_calls and "<tool_call>" in loose.choices[0].message.content
