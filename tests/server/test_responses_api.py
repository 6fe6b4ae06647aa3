"""OpenAI's Responses API (``POST /v1/responses``) through the official client's
``client.responses.create`` and ``client.responses.stream``: text, a forced tool call and
its output fed back, reasoning items, streamed and not; stateless fields refused by name."""

from __future__ import annotations

import json

import openai
import pytest
from server_testutil import http_call, wait_for
from test_tools_reasoning import MODEL, WEATHER, Served, qwen_dir  # noqa: F401  (the model fixture)

from specserve.server.responses import input_messages

pytestmark = pytest.mark.timeout(300)

TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": WEATHER["function"]["parameters"], "strict": True}  # fmt: skip
BUDGET = {"thinking_token_budget": 4}


@pytest.fixture(scope="module")
def served(qwen_dir):  # noqa: F811
    s = Served(qwen_dir, "ngram")
    yield s
    s.close()


def outputs(r) -> list[tuple]:
    """The output items without their ids."""
    out = []
    for o in r.output:
        if o.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in o.content or [])))
        elif o.type == "message":
            out.append(("message", "".join(c.text for c in o.content)))
        else:
            out.append(("function_call", o.name, o.arguments))
    return out


def stream_final(client, **kw):
    """The streamed response as the client's helper assembles it (an incomplete one: from the
    ``response.incomplete`` event, as OpenAI's streams end then)."""
    with client.responses.stream(**kw) as st:
        events = list(st)
        kinds = [e.type for e in events]
        if kinds[-1] == "response.incomplete":
            return events[-1].response, kinds
        return st.get_final_response(), kinds


def test_text_with_reasoning_streamed_and_not(served):
    kw = dict(model=MODEL, input="Say hello.", max_output_tokens=16, temperature=0, extra_body=BUDGET)
    r = served.client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o[0] for o in outputs(r)] == ["reasoning", "message"]
    assert r.usage.output_tokens == 16 and r.usage.output_tokens_details.reasoning_tokens == 4
    final, kinds = stream_final(served.client, **kw)
    assert outputs(final) == outputs(r)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "response.output_text.delta" in kinds and "response.reasoning_text.delta" in kinds


def test_a_tool_call_and_its_output_fed_back(served):
    kw = dict(model=MODEL, input="Weather in Paris?", tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=120, temperature=0, instructions="Use the tools.", extra_body=BUDGET)  # fmt: skip
    r = served.client.responses.create(**kw)
    assert r.status == "completed"
    call = next(o for o in r.output if o.type == "function_call")
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}
    final, kinds = stream_final(served.client, **kw)
    assert outputs(final) == outputs(r) and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    # the call and its output fed back as input items (the Agents SDK's loop)
    history = [{"role": "user", "content": "Weather in Paris?"}] + [o.model_dump(exclude_none=True) for o in r.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21"})
    r2 = served.client.responses.create(model=MODEL, input=history, tools=[TOOL], max_output_tokens=8, temperature=0,
                                        extra_body=BUDGET)  # fmt: skip
    assert r2.status == "incomplete" and r2.output
    # ... as the chat turns the template renders: the reasoning and the call in one assistant turn
    reasoning = next(o for o in r.output if o.type == "reasoning").content[0].text
    assert input_messages({"input": history, "instructions": "Be brief."}) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": reasoning, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21"},
    ]  # fmt: skip
    assert wait_for(served.kv_free)


@pytest.mark.parametrize("body, field", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
])  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(served, body, field):
    status, out = http_call(f"{served.http}/v1/responses", {"model": MODEL, "input": "hi", **body})
    assert status == 400 and out["error"]["param"] == field, out
    with pytest.raises(openai.BadRequestError):
        served.client.responses.create(model=MODEL, **{"input": "hi", **body})
