"""The offline API with tools and reasoning: ``LLM.chat(..., tools=...)`` as vLLM has it,
the answer parsed into ``content``, ``reasoning`` and ``tool_calls``; budgets on ``generate``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_chat_models import make_qwen_chat_model  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.errors import InvalidRequestError  # noqa: E402

pytestmark = pytest.mark.timeout(300)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
USER = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    path = make_qwen_chat_model(tmp_path_factory.mktemp("llm-qwen") / "m")
    plain = LLM(model=str(path), dtype="float32", num_kv_blocks=512)
    spec = LLM(model=str(path), dtype="float32", num_kv_blocks=512,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    return plain, spec


def test_chat_with_tools_parses_the_answer(llms):
    sp = SamplingParams(temperature=0, max_tokens=120, thinking_token_budget=3)
    answers = []
    for llm in llms:
        (out,) = llm.chat(USER, sp, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, use_tqdm=False)
        o = out.outputs[0]
        assert o.text.count("</think>") == 1 and o.reasoning and o.content is None
        (call,) = o.tool_calls
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert set(json.loads(call["function"]["arguments"])) == {"city", "unit"}
        answers.append((o.token_ids, o.reasoning, call["function"]["arguments"]))
    assert answers[0] == answers[1]  # greedy: the same with n-gram speculation


def test_chat_template_kwargs_and_budgets_on_generate(llms):
    plain, _ = llms
    (out,) = plain.chat(USER, SamplingParams(temperature=0, max_tokens=6),
                        chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)  # fmt: skip
    assert out.prompt.endswith("<think>\n\n</think>\n\n") and out.outputs[0].reasoning is None
    (gen,) = plain.generate(out.prompt.replace("<think>\n\n</think>\n\n", "<think>\n"),
                            SamplingParams(temperature=0, max_tokens=8, thinking_token_budget=4), use_tqdm=False)
    assert gen.outputs[0].token_ids.index(262) == 4  # </think> after exactly 4 reasoning tokens
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        plain.chat(USER, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
