"""Every tool-call and reasoning format: the streamed answer, assembled by the official
openai client's stream accumulator (``ChatCompletionStreamState``, what
``client.chat.completions.stream`` runs), equals the non-streamed answer for every
chunking of the text: one character, one token, random runs of 1..K+1 tokens (what
speculative decoding delivers in a step), the whole text; and both equal the calls the
text was written from.  The texts hold arguments that contain the closing tags, braces
and quotes in strings, several calls, text before the calls, and cuts at any point
(``finish_reason: length``)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from specserve.formats.chat import ChatFormats, ChatPlan

K = 4  # drafts per step: a step delivers 1..K+1 tokens
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "hot": {"type": "boolean"}, "extra": {"type": "object"}},
        "required": ["city", "days", "hot", "extra"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "tags": {"type": "array"}},
        "required": ["query", "tags"]}}},
    {"type": "function", "function": {"name": "noop"}},
]  # fmt: skip
_TOKEN = re.compile(r"\w+|\s+|[^\w\s]")

TRICKY = ["</tool_call>", "{", "}", '"', "\\", "[", "]", "(", ")", "<tool_call>", "</think>", "é", "\n", ",", "=", "'"]
text_st = st.lists(st.one_of(st.sampled_from(TRICKY), st.text("abc xyz", min_size=1, max_size=6)), max_size=6).map("".join)
plain_st = st.lists(st.text("abcdefgh XYZ.!?", min_size=1, max_size=8), min_size=1, max_size=4).map("".join)


def values(tool: str, strings):
    if tool == "get_weather":
        return st.fixed_dictionaries({
            "city": strings, "days": st.integers(-5, 10_000), "hot": st.booleans(),
            "extra": st.dictionaries(st.sampled_from(["a", "b"]), st.one_of(st.integers(0, 9), strings), max_size=2),
        })  # fmt: skip
    if tool == "search":
        return st.fixed_dictionaries({"query": strings, "tags": st.lists(st.integers(0, 9), max_size=3)})
    return st.just({})


def calls_st(strings):
    one = st.sampled_from(["get_weather", "search", "noop"]).flatmap(lambda n: values(n, strings).map(lambda a: (n, a)))
    return st.lists(one, min_size=1, max_size=3)


# ------------------------------------------------------------------- rendering per format


def render_hermes(pre: str, calls) -> str:
    blocks = [f'<tool_call>\n{json.dumps({"name": n, "arguments": a}, ensure_ascii=False)}\n</tool_call>' for n, a in calls]
    return (pre + "\n\n" if pre else "") + "\n".join(blocks)


def render_llama3(pre: str, calls) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


def render_pythonic(pre: str, calls) -> str:
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"


def _xml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False)
    return str(v)


def render_qwen3_coder(pre: str, calls) -> str:
    blocks = []
    for n, a in calls:
        params = "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n" for k, v in a.items())
        blocks.append(f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
    return (pre + "\n\n" if pre else "") + "\n".join(blocks)


# XML values are raw text: a string may not hold "<" followed by a tag, nor start or end with a newline
xml_text_st = st.text("abc xyz{}\"'[](),=é", max_size=12).filter(lambda s: s.strip() == s and s != "")
FORMATS = {
    "hermes": (render_hermes, text_st, True),
    "llama3_json": (render_llama3, text_st, False),
    "pythonic": (render_pythonic, text_st, False),
    "qwen3_coder": (render_qwen3_coder, xml_text_st, True),
}


# ------------------------------------------------------------------- chunkings and assembly


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def chunkings(text: str, runs: list[int]) -> dict[str, list[str]]:
    toks = tokens(text)
    assert "".join(toks) == text
    grouped, i, r = [], 0, 0
    while i < len(toks):
        n = runs[r % len(runs)] if runs else 1
        grouped.append("".join(toks[i : i + n]))
        i += n
        r += 1
    return {"char": list(text), "token": toks, "runs": grouped, "whole": [text]}


def plan_for(tool_format: str | None, reasoning: str | None = None, choice="auto") -> ChatPlan:
    return ChatPlan.from_fields(ChatFormats(tool_format, reasoning), tools=TOOLS, tool_choice=choice)


def streamed(plan: ChatPlan, pieces: list[str], state: str | None = None, reason: str = "stop"):
    """The chunks the server sends for these text pieces, through the openai accumulator."""
    acc = ChatCompletionStreamState()
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": "m"}

    def send(delta, finish=None):
        acc.handle_chunk(ChatCompletionChunk.model_validate(
            {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))

    send({"role": "assistant", "content": ""})
    answer = plan.answer(state)
    for i, piece in enumerate(pieces):
        for e in answer.feed(piece):
            send(answer.delta(e))
    for e in answer.finish():
        send(answer.delta(e))
    send({}, plan.finish_reason(reason, answer))
    if reason == "length":  # the helper refuses to parse a cut answer: read its snapshot
        return acc.current_completion_snapshot.choices[0]
    return acc.get_final_completion().choices[0]


def whole(plan: ChatPlan, text: str, state: str | None = None, reason: str = "stop"):
    answer = plan.answer(state)
    answer.feed(text)
    answer.finish()
    return answer.message(), plan.finish_reason(reason, answer)


def same(choice, message: dict, finish: str) -> None:
    got = choice.message
    assert (got.content or None) == (message["content"] or None)
    assert getattr(got, "reasoning", None) == message.get("reasoning")
    calls = [(c.function.name, c.function.arguments) for c in got.tool_calls or []]
    assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert choice.finish_reason == finish


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], report_multiple_bugs=False)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@SETTINGS
@given(data=st.data())
def test_streamed_equals_whole_and_the_calls(fmt, data):
    render, strings, content_first = FORMATS[fmt]
    calls = data.draw(calls_st(strings))
    pre = data.draw(plain_st).strip() if content_first and data.draw(st.booleans()) else ""
    text = render(pre, calls)
    runs = data.draw(st.lists(st.integers(1, K + 1), min_size=1, max_size=8))
    plan = plan_for(fmt)
    message, finish = whole(plan, text)
    # the non-streamed answer is what the text was written from
    assert (message["content"] or "") == pre
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
    assert finish == "tool_calls"
    for name, pieces in chunkings(text, runs).items():
        same(streamed(plan, pieces), message, finish)
    # cut anywhere (max_tokens): streamed still equals whole
    cut = data.draw(st.integers(0, len(text)))
    message, finish = whole(plan, text[:cut], reason="length")
    for name, pieces in chunkings(text[:cut], runs).items():
        same(streamed(plan, pieces, reason="length"), message, finish)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@SETTINGS
@given(text=st.text("abc {}[]<>/\"'=_()\n,;é", max_size=60), runs=st.lists(st.integers(1, K + 1), min_size=1))
def test_any_text_streams_as_it_parses(fmt, text, runs):
    """Text that is mostly not calls: whatever the parse, every chunking gives it."""
    plan = plan_for(fmt)
    message, finish = whole(plan, text)
    for name, pieces in chunkings(text, runs).items():
        same(streamed(plan, pieces), message, finish)


REASONING = {
    # format: (render(reasoning, content) -> text, prompt state)
    "qwen3": (lambda r, c: f"<think>\n{r}\n</think>\n\n{c}", "optional"),
    "deepseek_r1": (lambda r, c: f"{r}\n</think>\n\n{c}", "open"),
    "granite": (lambda r, c: f"Here is my thought process:\n{r}\nHere is my response:\n{c}", "optional"),
}


@pytest.mark.parametrize("fmt", sorted(REASONING))
@SETTINGS
@given(data=st.data())
def test_reasoning_streams_as_it_parses(fmt, data):
    render, state = REASONING[fmt]
    reasoning = data.draw(plain_st).strip() or "hm"
    content = data.draw(plain_st).strip() or "ok"
    text = render(reasoning, content)
    plan = ChatPlan.from_fields(ChatFormats(None, fmt))
    message, finish = whole(plan, text, state)
    assert (message["reasoning"], message["content"]) == (reasoning, content)
    runs = data.draw(st.lists(st.integers(1, K + 1), min_size=1, max_size=8))
    for name, pieces in chunkings(text, runs).items():
        same(streamed(plan, pieces, state), message, finish)
    cut = data.draw(st.integers(0, len(text)))
    message, finish = whole(plan, text[:cut], state, "length")
    for name, pieces in chunkings(text[:cut], runs).items():
        same(streamed(plan, pieces, state, "length"), message, finish)


@SETTINGS
@given(data=st.data())
def test_reasoning_then_tool_calls(data):
    """Qwen3: a think block, text, then Hermes calls, split in any pieces."""
    calls = data.draw(calls_st(text_st))
    reasoning = data.draw(plain_st).strip() or "hm"
    text = f"<think>\n{reasoning}\n</think>\n\n" + render_hermes("", calls)
    plan = ChatPlan.from_fields(ChatFormats("hermes", "qwen3"), tools=TOOLS)
    message, finish = whole(plan, text, "optional")
    assert message["reasoning"] == reasoning and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == calls
    runs = data.draw(st.lists(st.integers(1, K + 1), min_size=1, max_size=8))
    for name, pieces in chunkings(text, runs).items():
        same(streamed(plan, pieces, "optional"), message, finish)


def test_hermes_arguments_end_where_the_json_ends():
    plan = plan_for("hermes")
    text = '<tool_call>\n{"name": "search", "arguments": {"query": "</tool_call>\\n<tool_call>", "tags": []}}\n</tool_call>'
    message, _ = whole(plan, text)
    assert json.loads(message["tool_calls"][0]["function"]["arguments"])["query"] == "</tool_call>\n<tool_call>"
    assert message["content"] is None and len(message["tool_calls"]) == 1


def test_unknown_function_is_text():
    plan = plan_for("hermes")
    text = 'Hi <tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    message, finish = whole(plan, text)
    assert message["content"] == text and "tool_calls" not in message and finish == "stop"


def test_qwen3_coder_coerces_to_the_schema():
    plan = plan_for("qwen3_coder")
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n 7 \n"
            "</parameter>\n<parameter=hot>\nTrue\n</parameter>\n<parameter=extra>\n{'a': 1}\n</parameter>\n"
            "</function>\n</tool_call>")  # fmt: skip
    args = json.loads(whole(plan, text)[0]["tool_calls"][0]["function"]["arguments"])
    assert args == {"city": "42", "days": 7, "hot": True, "extra": {"a": 1}}


def test_named_and_required_without_a_format_read_plain_json():
    named = ChatPlan.from_fields(ChatFormats(None, None), tools=TOOLS,
                                 tool_choice={"type": "function", "function": {"name": "search"}})  # fmt: skip
    message, finish = whole(named, '{"query": "x", "tags": [1]}')
    assert message["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"query": "x", "tags": [1]}'}
    assert finish == "stop"  # OpenAI's finish reason for a named function
    required = ChatPlan.from_fields(ChatFormats(None, None), tools=TOOLS, tool_choice="required")
    message, finish = whole(required, '[{"name": "noop", "parameters": {}}, {"name": "search", "parameters": {"query": "q", "tags": []}}]')
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["noop", "search"]
    assert finish == "tool_calls"


def test_allowed_tools_and_one_call_when_not_parallel():
    text = render_hermes("", [("search", {"query": "a", "tags": []}), ("get_weather", {"city": "x", "days": 1,
                                                                                      "hot": True, "extra": {}})])
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}}  # fmt: skip
    plan = ChatPlan.from_fields(ChatFormats("hermes", None), tools=TOOLS, tool_choice=allowed)
    message, _ = whole(plan, text)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]  # search is not allowed: text
    assert "search" in message["content"]
    required = ChatPlan.from_fields(ChatFormats("hermes", None), tools=TOOLS, tool_choice={**allowed, "allowed_tools": {
        **allowed["allowed_tools"], "mode": "required"}})  # fmt: skip
    grammar = required.structured().grammar
    assert '"get_weather"' in grammar and '"search"' not in grammar and "noop" not in grammar
    single = ChatPlan.from_fields(ChatFormats("hermes", None), tools=TOOLS, parallel_tool_calls=False)
    message, _ = whole(single, text)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["search"]
    for pieces in chunkings(text, [2, 3]).values():
        same(streamed(single, pieces), message, "tool_calls")
