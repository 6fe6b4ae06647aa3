"""The format registries: names, aliases, detection from chat templates, a user's own class as
``module:Class`` (config and chat alike), and the vLLM-form CLI flags that name them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from specserve.errors import ConfigError  # noqa: E402
from specserve.formats import resolve  # noqa: E402
from specserve.formats.chat import ChatFormats, ChatPlan  # noqa: E402
from specserve.formats.reasoning import REASONING_FORMATS  # noqa: E402
from specserve.formats.tools import TOOL_FORMATS  # noqa: E402
from specserve.serve_compat import translate  # noqa: E402

QWEN3 = "{%- if tools %}<tools>{{ tool }}</tools><tool_call>{%- endif %}<think>{{ enable_thinking }}</think>"
LLAMA31 = "<|python_tag|>Given the following functions, please respond with a JSON for a function call"
CODER = "<tool_call><function=x><parameter=y></parameter></function></tool_call>"
PYTHONIC = "[func_name1(params_name1=params_value1, params_name2=params_value2...)]"
R1 = "<｜Assistant｜><think>"
GRANITE = "Here is my thought process: ... Here is my response:"


@pytest.mark.parametrize("template, tools, reasoning", [
    (QWEN3, "hermes", "qwen3"), (LLAMA31, "llama3_json", None), (CODER, "qwen3_coder", None),
    (PYTHONIC, "pythonic", None), (R1, None, "deepseek_r1"), (GRANITE, None, "granite"), ("{{ m }}", None, None),
])  # fmt: skip
def test_detected_from_the_chat_template(template, tools, reasoning):
    assert resolve(None, None, template) == (tools, reasoning)


def test_names_aliases_none_and_errors():
    assert resolve("qwen", "deepseek-r1", None) == ("hermes", "deepseek_r1")
    assert resolve("none", "none", QWEN3) == (None, None)
    with pytest.raises(ConfigError, match="model.tool_call_format: unknown tool-call format 'nope'"):
        resolve("nope", None, None)
    with pytest.raises(ConfigError, match="model.reasoning_format: cannot load"):
        REASONING_FORMATS.get("no_such_module:Thing")
    with pytest.raises(ConfigError, match="not a subclass"):
        TOOL_FORMATS.get("json:JSONDecoder")


def test_a_users_own_format_as_module_class():
    name = "user_format:LineFormat"
    assert resolve(name, None, None) == (name, None)
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}}]  # fmt: skip
    plan = ChatPlan.from_fields(ChatFormats(name, None), tools=tools)
    answer = plan.answer()
    events = []
    for ch in 'Sure.\nCALL ping {"n": 3}\n':
        events += answer.feed(ch)
    events += answer.finish()
    msg = answer.message()
    assert msg["content"] == "Sure." and msg["tool_calls"][0]["function"] == {"name": "ping", "arguments": '{"n": 3}'}
    assert "CALL ping" in ChatPlan.from_fields(ChatFormats(name, None), tools=tools, tool_choice="required").structured().grammar


def test_vllm_flags_map_to_keys(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    overrides, _, _ = translate(["embedded:smollm2-135m-instruct", "--enable-auto-tool-choice", "--tool-call-parser",
                                 "hermes", "--reasoning-parser", "qwen3", "--chat-template", str(template),
                                 "--default-chat-template-kwargs", json.dumps({"enable_thinking": False})])  # fmt: skip
    assert "server.enable_auto_tool_choice=true" in overrides
    assert "model.tool_call_format=hermes" in overrides and "model.reasoning_format=qwen3" in overrides
    assert f"model.chat_template={template}" in overrides
    assert "server.default_chat_template_kwargs={enable_thinking:false}" in overrides
    from specserve.compat import compose

    cfg = compose(overrides)
    assert (cfg.model.tool_call_format, cfg.model.reasoning_format) == ("hermes", "qwen3")
    assert cfg.server.default_chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="model.tool_call_format"):
        compose(translate(["--tool-call-parser", "nope"])[0])


def test_chat_template_from_a_file_or_text(tmp_path):
    from specserve.formats import load_chat_template

    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_chat_template(str(f)) == f.read_text()
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    assert load_chat_template(None) is None
    with pytest.raises(ConfigError, match="model.chat_template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
