"""Forced tool calls on the embedded SmolLM2 through the official client's
``client.chat.completions.parse`` with ``openai.pydantic_function_tool`` (strict tools) and
``tool_choice="required"``: parsed arguments come back, greedy answers identical with no
speculation, n-gram and the shipped EAGLE-3 head (float32, the torch path: batch-invariant).
SmolLM2 has no tool-call format, so the calls are the plain JSON vLLM forces; its template
does not render tools (the grammar alone makes the call)."""

from __future__ import annotations

from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from server_testutil import server_config, wait_for

from specserve.config import Config, SpeculativeConfig, validate_config
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import LLMEngine
from specserve.server import start_servers

pytestmark = pytest.mark.timeout(600)


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """The time in a time zone."""

    zone: Literal["UTC", "CET", "PST"]


MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today? Use celsius."}]
TOOLS = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]


@pytest.fixture(scope="module")
def answers():
    """The parsed answer of each configuration, from one module-wide set of engines."""
    base = Config()
    base.model.dtype = "float32"
    base.engine.cpu_kernel = "torch"
    base.engine.num_kv_blocks = 256
    plain = LLMEngine(validate_config(base))
    out = {}
    for name, method in (("plain", None), ("ngram", "ngram"), ("eagle3", "eagle3")):
        if method is None:
            llm = plain
        else:
            cfg = Config(model=base.model, engine=base.engine,
                         method=SpeculativeConfig(method=method, num_speculative_tokens=3))  # fmt: skip
            llm = LLMEngine(validate_config(cfg), target=plain.target)
        engine = AsyncEngine(llm, max_queue=8)
        handle = start_servers(server_config(max_tokens_cap=256), engine)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{handle.http_port}/v1", api_key="x", max_retries=0,
                               timeout=300)  # fmt: skip
        try:
            r = client.chat.completions.parse(model="smollm2-135m-instruct", messages=MESSAGES, tools=TOOLS,
                                              tool_choice="required", temperature=0, max_tokens=80)  # fmt: skip
            out[name] = (r, r.model_extra["spec_decode"])
            assert wait_for(lambda: llm.blocks.num_free == llm.blocks.num_blocks and not llm.requests)
        finally:
            client.close()
            handle.stop()
    return out


def test_parse_returns_the_parsed_arguments(answers):
    r, _ = answers["plain"]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    parsed = call.function.parsed_arguments
    assert isinstance(parsed, (GetWeather, GetTime))
    assert call.function.name == type(parsed).__name__


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_greedy_identical_with_speculation(answers, method):
    want, _ = answers["plain"]
    got, spec = answers[method]
    assert [(c.function.name, c.function.arguments) for c in got.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in want.choices[0].message.tool_calls]
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert spec["num_drafts"] > 0  # speculation (the grammar's forced drafts, the method's) ran
