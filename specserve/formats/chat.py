"""A chat request's tools, tool choice, reasoning and template options, and its answer's parsing.

Protocol-neutral: the HTTP chat endpoint, the Responses API, gRPC and the offline ``LLM.chat``
hand their fields here as plain values and get back what the chat template, the grammar
and the answer need.

* :func:`parse_tools`, :func:`parse_tool_choice`: OpenAI's contract.  Function tools only
  (a custom tool is refused naming ``tools[i].type``), names ``[a-zA-Z0-9_-]{1,64}`` and
  unique, at most 128 tools, ``parameters`` a JSON Schema object (``strict`` ones checked
  against OpenAI's strict rules); ``tool_choice`` "none", "auto" (the default with tools),
  "required", ``{"type": "function", "function": {"name"}}`` or ``{"type": "allowed_tools",
  "allowed_tools": {"mode": "auto" | "required", "tools": [...]}}``.
* :func:`template_messages`: chat messages as chat templates read them: an assistant's
  ``tool_calls`` with their arguments as objects (sent as JSON strings), ``tool`` messages
  with their ``tool_call_id``, ``reasoning`` / ``reasoning_content`` as
  ``reasoning_content``.
* :func:`apply_plan`: a plan's grammar, reasoning markers and budget onto a request's
  ``SamplingParams``; :func:`reasoning_tokens`: how many of an answer's tokens are reasoning.
* :class:`ChatPlan`: one request's plan: the tools handed to the template, the grammar that
  enforces "required" and a named function (the tool-call format's own syntax, or plain
  JSON when the model has none; one call when ``parallel_tool_calls`` is false), the
  reasoning state the prompt leaves (for the engine's gate), and :class:`Answer`, the
  incremental parse of one choice's text into reasoning, content and tool calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.errors import InvalidRequestError
from specserve.formats.tools.base import (
    FunctionTool,
    ToolCall,
    ToolEvent,
    merge_events,
    new_call_id,
    resolve_tags,
    tag_token,
)
from specserve.request import ReasoningParams, SamplingParams, StructuredOutputsParams

__all__ = [
    "Answer", "ChatFormats", "ChatPlan", "MAX_TOOLS", "ToolChoice", "apply_plan", "parse_template_kwargs",
    "parse_tool_choice", "parse_tools", "reasoning_tokens", "template_messages",
]  # fmt: skip

MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Names a chat template is called with: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template",
    "continue_final_message", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip
PROMPT_TAIL_TOKENS = 64  # prompt tokens read for the reasoning state the prompt leaves


# --------------------------------------------------------------------------- tools


def _schema_problem(schema: Any, strict: bool, where: str) -> str | None:
    """Why ``schema`` breaks OpenAI's strict-mode rules (every object closed with
    ``additionalProperties: false``, every property required), or None."""
    if isinstance(schema, dict):
        props = schema.get("properties")
        if schema.get("type") == "object" or isinstance(props, dict):
            if strict and schema.get("additionalProperties") is not False:
                return f"{where}: strict schemas need additionalProperties: false on every object"
            if strict and isinstance(props, dict) and set(schema.get("required") or []) != set(props):
                return f"{where}: strict schemas need every property in required (optional ones as a null union)"
        for key, sub in schema.items():
            if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(sub, dict):
                for name, s in sub.items():
                    why = _schema_problem(s, strict, f"{where}.{key}.{name}")
                    if why:
                        return why
            elif isinstance(sub, (dict, list)) and key not in ("enum", "const", "default", "examples"):
                why = _schema_problem(sub, strict, f"{where}.{key}")
                if why:
                    return why
    elif isinstance(schema, list):
        for i, s in enumerate(schema):
            why = _schema_problem(s, strict, f"{where}[{i}]")
            if why:
                return why
    return None


def parse_tools(value: Any, field: str = "tools", flat: bool = False) -> list[FunctionTool]:
    """OpenAI's ``tools`` (``flat``: the Responses API's ``{"type": "function", "name", ...}``)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequestError(field, "must be a list of function tools")
    if len(value) > MAX_TOOLS:
        raise InvalidRequestError(field, f"at most {MAX_TOOLS} tools, got {len(value)}")
    out: list[FunctionTool] = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(where, "must be an object {\"type\": \"function\", ...}")
        if item.get("type") != "function":
            raise InvalidRequestError(f"{where}.type", f"only function tools are supported, got {str(item.get('type'))[:40]!r}")
        fn = item if flat else item.get("function")
        fwhere = where if flat else f"{where}.function"
        if not isinstance(fn, dict):
            raise InvalidRequestError(fwhere, "must be an object with name, description, parameters, strict")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(f"{fwhere}.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
        if name in seen:
            raise InvalidRequestError(f"{fwhere}.name", f"{name!r} is given twice")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise InvalidRequestError(f"{fwhere}.description", "must be a string")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise InvalidRequestError(f"{fwhere}.parameters", "must be a JSON Schema object")
            if params.get("type", "object") != "object":
                raise InvalidRequestError(f"{fwhere}.parameters", "must describe an object (type: object)")
            try:
                json.dumps(params)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(f"{fwhere}.parameters", f"is not JSON: {e}") from None
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError(f"{fwhere}.strict", "must be a boolean")
        if strict and params is not None:
            why = _schema_problem(params, True, f"{fwhere}.parameters")
            if why:
                raise InvalidRequestError(why.split(":", 1)[0], why.split(": ", 1)[1])
        out.append(FunctionTool(name, desc, params, bool(strict)))
    return out


def check_tool_schemas(tools: list[FunctionTool], field: str = "tools", flat: bool = False) -> None:
    """Each tool's parameters compile as a JSON schema grammar (llguidance); slow: call it
    off the event loop."""
    import llguidance

    from specserve.formats.tools.base import strict_schema

    for i, t in enumerate(tools):
        if t.parameters is None:
            continue
        where = f"{field}[{i}].parameters" if flat else f"{field}[{i}].function.parameters"
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(strict_schema(t.parameters))
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(where, f"is not a valid JSON schema: {str(e).splitlines()[0][:300]}") from None
        if failed:
            raise InvalidRequestError(where, f"is not a valid JSON schema: {'; '.join(messages)[:300]}")


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "none"  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    allowed: tuple[str, ...] | None = None  # allowed_tools: the tools calls may name


def _function_name(value: Any, field: str, tools: dict[str, FunctionTool], flat: bool) -> str:
    fn = value if flat else (value.get("function") if isinstance(value, dict) else None)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError(field, 'must name a function: {"type": "function", "function": {"name": ...}}')
    if name not in tools:
        raise InvalidRequestError(field, f"{name[:64]!r} is not one of the request's tools")
    return name


def parse_tool_choice(value: Any, tools: list[FunctionTool], field: str = "tool_choice", flat: bool = False) -> ToolChoice:
    by_name = {t.name: t for t in tools}
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise InvalidRequestError(field, f"{value!r} needs tools")
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        name_field = f"{field}.name" if flat else f"{field}.function.name"
        return ToolChoice("named", _function_name(value, name_field, by_name, flat))
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        spec = value if flat else value.get("allowed_tools")
        if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required"):
            raise InvalidRequestError(field, 'allowed_tools needs mode "auto" or "required" and tools')
        items = spec.get("tools")
        if not isinstance(items, list) or not items:
            raise InvalidRequestError(f"{field}.tools" if flat else f"{field}.allowed_tools.tools",
                                      "must be a non-empty list of {\"type\": \"function\", ...}")  # fmt: skip
        names = []
        for i, item in enumerate(items):
            where = f"{field}.tools[{i}]" if flat else f"{field}.allowed_tools.tools[{i}]"
            if not isinstance(item, dict) or item.get("type") != "function":
                raise InvalidRequestError(where, "only function tools are supported")
            names.append(_function_name(item, f"{where}.name" if flat else f"{where}.function.name", by_name, flat))
        return ToolChoice(spec["mode"], None, tuple(dict.fromkeys(names)))
    raise InvalidRequestError(field, 'must be "none", "auto", "required", a named function or allowed_tools')


def parse_template_kwargs(value: Any, default: dict | None = None, field: str = "chat_template_kwargs") -> dict:
    """The request's chat-template keywords over the server's defaults."""
    out = dict(default or {})
    if value is None:
        return out
    if not isinstance(value, dict):
        raise InvalidRequestError(field, "must be an object of keyword arguments for the chat template")
    for key, v in value.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidRequestError(field, f"{str(key)[:40]!r} is not a keyword name")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError(f"{field}.{key}", "is set by the server and cannot be replaced")
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"{field}.{key}", "must be a JSON value") from None
        out[key] = v
    return out


# --------------------------------------------------------------------------- messages


def _text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text") \
                    or not isinstance(part.get("text"), str):
                raise InvalidRequestError(field, "only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(field, "must be a string or a list of text parts")


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the dicts chat templates read (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "is required: a non-empty list of {role, content} objects")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidRequestError(where, "must be an object with role and content")
        role = msg.get("role")
        content = msg.get("content")
        m: dict[str, Any] = {"role": role, "content": "" if content is None else _text(content, f"{where}.content")}
        calls = msg.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise InvalidRequestError(f"{where}.tool_calls", "only assistant messages carry tool calls")
            if not isinstance(calls, list):
                raise InvalidRequestError(f"{where}.tool_calls", "must be a list of tool calls")
            m["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        elif content is None and role != "assistant":
            raise InvalidRequestError(f"{where}.content", "is required")
        if role == "tool":
            tcid = msg.get("tool_call_id")
            if not isinstance(tcid, str) or not tcid:
                raise InvalidRequestError(f"{where}.tool_call_id", "is required for a tool message: the id of the call it answers")
            m["tool_call_id"] = tcid
        if isinstance(msg.get("name"), str):
            m["name"] = msg["name"]
        for key in ("reasoning_content", "reasoning"):  # both spellings, as clients send them
            r = msg.get(key)
            if r is not None:
                if role != "assistant":
                    raise InvalidRequestError(f"{where}.{key}", "only assistant messages carry reasoning")
                m["reasoning_content"] = _text(r, f"{where}.{key}")
                break
        out.append(m)
    return out


def _history_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise InvalidRequestError(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(f"{where}.function", "must be an object with name and arguments")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise InvalidRequestError(f"{where}.function.arguments", f"is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise InvalidRequestError(f"{where}.function.arguments", "must be a JSON object")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def control_token_problem(plan: "ChatPlan", messages: list[dict[str, Any]], special: list[str]) -> None:
    """Refuse text outside message contents that spells a control token (tool definitions,
    call names and arguments, reasoning): the template puts it in the prompt as markup."""
    if not special:
        return

    def check(text: str, where: str) -> None:
        for name in special:
            if name in text:
                raise InvalidRequestError(where, f"contains the control token {name!r}")

    for i, t in enumerate(plan.tools):
        check(json.dumps(t.as_openai(), ensure_ascii=False), f"tools[{i}]")
    for i, m in enumerate(messages):
        for j, c in enumerate(m.get("tool_calls") or ()):
            check(json.dumps(c, ensure_ascii=False), f"messages[{i}].tool_calls[{j}]")
        if "reasoning_content" in m:
            check(m["reasoning_content"], f"messages[{i}].reasoning_content")
        for key in ("tool_call_id", "name"):
            if key in m:
                check(m[key], f"messages[{i}].{key}")
    for key, v in plan.template_kwargs.items():
        check(json.dumps(v, ensure_ascii=False), f"chat_template_kwargs.{key}")


# --------------------------------------------------------------------------- formats and plans


class ChatFormats:
    """The server's formats (resolved once, ``specserve.formats.resolve``) and its options."""

    def __init__(self, tool_format: str | None, reasoning_format: str | None, auto_tool_choice: bool = True,
                 reasoning_content_alias: bool = True, default_template_kwargs: dict | None = None,
                 budget_message: str = ""):  # fmt: skip
        from specserve.formats.reasoning import REASONING_FORMATS
        from specserve.formats.tools import TOOL_FORMATS

        self.tool_name = tool_format
        self.reasoning_name = reasoning_format
        self.tool = TOOL_FORMATS.get(tool_format) if tool_format else None
        self.reasoning = REASONING_FORMATS.get(reasoning_format) if reasoning_format else None
        self.auto_tool_choice = auto_tool_choice
        self.alias = reasoning_content_alias
        self.default_template_kwargs = dict(default_template_kwargs or {})
        self.budget_message = budget_message
        self._markers: tuple | None = None

    def markers(self, tokenizer: Any) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """The reasoning markers as token ids: (start spellings, end spellings, the tokens a
        thinking budget forces: its message, then the canonical end marker)."""
        if self._markers is None:
            fmt = self.reasoning

            def ids(text: str) -> list[int]:
                return list(tokenizer.encode(text, add_special_tokens=False))

            forced = (ids(self.budget_message) if self.budget_message else []) + ids(fmt.end[0])
            self._markers = ([ids(m) for m in fmt.start], [ids(m) for m in fmt.end], forced)
        return self._markers


@dataclass
class ChatPlan:
    """One chat request's tools, choice, reasoning and template options."""

    formats: ChatFormats
    tools: list[FunctionTool] = field(default_factory=list)
    choice: ToolChoice = field(default_factory=ToolChoice)
    parallel: bool = True
    template_kwargs: dict = field(default_factory=dict)
    separate_reasoning: bool = True
    thinking_token_budget: int | None = None

    @classmethod
    def from_fields(cls, formats: ChatFormats, tools: Any = None, tool_choice: Any = None,
                    parallel_tool_calls: Any = None, chat_template_kwargs: Any = None,
                    separate_reasoning: Any = None, thinking_token_budget: Any = None,
                    flat: bool = False) -> "ChatPlan":  # fmt: skip
        """Validate a request's fields (400 naming the field for each bad one)."""
        parsed = parse_tools(tools, flat=flat)
        choice = parse_tool_choice(tool_choice, parsed, flat=flat)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise InvalidRequestError("parallel_tool_calls", "must be a boolean")
        if separate_reasoning is not None and not isinstance(separate_reasoning, bool):
            raise InvalidRequestError("separate_reasoning", "must be a boolean")
        budget = thinking_token_budget
        if budget is not None:
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise InvalidRequestError("thinking_token_budget", "must be an integer >= 0")
            if formats.reasoning is None:
                raise InvalidRequestError("thinking_token_budget", "needs a reasoning format: this server has none "
                                          "(set model.reasoning_format; vLLM: --reasoning-parser)")  # fmt: skip
        plan = cls(formats, parsed, choice, parallel_tool_calls is not False,
                   parse_template_kwargs(chat_template_kwargs, formats.default_template_kwargs),
                   separate_reasoning is not False, budget)  # fmt: skip
        if choice.mode == "auto" and formats.tool is None:
            raise InvalidRequestError("tool_choice", '"auto" (the default when tools are given) needs a tool-call '
                                      "format: this model has none; set model.tool_call_format (vLLM: "
                                      "--tool-call-parser), or send tool_choice \"required\", a named function "
                                      'or "none"')  # fmt: skip
        if choice.mode == "auto" and not formats.auto_tool_choice:
            raise InvalidRequestError("tool_choice", '"auto" is off on this server (server.enable_auto_tool_choice: '
                                      "false; vLLM: --enable-auto-tool-choice)")  # fmt: skip
        return plan

    # ---------------------------------------------------------------- template and grammar

    @property
    def template_tools(self) -> list[dict] | None:
        return [t.as_openai() for t in self.tools] or None

    @property
    def parses_tools(self) -> bool:
        return self.choice.mode != "none" and bool(self.tools)

    def _callable(self) -> list[FunctionTool]:
        if self.choice.mode == "named":
            return [t for t in self.tools if t.name == self.choice.name]
        if self.choice.allowed is not None:
            return [t for t in self.tools if t.name in self.choice.allowed]
        return list(self.tools)

    def _format(self):
        if self.formats.tool is not None:
            return self.formats.tool
        from specserve.formats.tools.openai_json import OpenAIJsonFormat

        return OpenAIJsonFormat(named=self.choice.mode == "named")

    def structured(self, tokenizer: Any = None) -> StructuredOutputsParams | None:
        """The grammar that enforces "required" or a named function, or "auto" with strict
        tools where the format can (``ToolCallFormat.auto_grammar``: its call tag is one
        token of the tokenizer's); None otherwise.  The format's tags are the tokenizer's own
        tokens for them where it has some."""
        tools = self._callable()
        if self.choice.mode == "auto":
            fmt = self.formats.tool
            if not any(t.strict for t in tools) or fmt is None or fmt.open_tag is None \
                    or tag_token(tokenizer, fmt.open_tag) is None:
                return None
            grammar = fmt.auto_grammar(tools, self.parallel)
            return None if grammar is None else StructuredOutputsParams(grammar=resolve_tags(grammar, tokenizer))
        if self.choice.mode not in ("required", "named"):
            return None
        parallel = self.parallel and self.choice.mode == "required"
        return StructuredOutputsParams(grammar=resolve_tags(self._format().grammar(tools, parallel), tokenizer))

    @property
    def reasoning_on(self) -> bool:
        return self.formats.reasoning is not None

    def reasoning_params(self, tokenizer: Any, prompt_ids: list[int]) -> ReasoningParams | None:
        """What the engine's gate needs (the markers' token ids and the state the prompt
        leaves), when it has work: a thinking budget, or a grammar that starts after the
        reasoning."""
        if self.formats.reasoning is None:
            return None
        start, end, forced = self.formats.markers(tokenizer)
        return ReasoningParams(start, end, self.prompt_state(tokenizer, prompt_ids), forced)

    def prompt_state(self, tokenizer: Any, prompt_ids: list[int]) -> str:
        tail = tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        return self.formats.reasoning.initial_state(tail)

    # ---------------------------------------------------------------- answers

    def answer(self, reasoning_state: str | None = None, make_id: Callable[[], str] = new_call_id) -> "Answer":
        """The parser of one choice's text.  ``reasoning_state``: where the answer starts
        (``prompt_state``; None without a reasoning format)."""
        reasoning = None
        if self.formats.reasoning is not None and self.separate_reasoning and reasoning_state is not None:
            reasoning = self.formats.reasoning.parser(reasoning_state)
        tools = None
        if self.parses_tools:
            allowed = {t.name: t for t in self._callable()}
            tools = self._format().parser(allowed, make_id)
        return Answer(reasoning, tools, self.formats.alias, max_calls=None if self.parallel else 1)

    def finish_reason(self, reason: str | None, answer: "Answer") -> str | None:
        """OpenAI's: "tool_calls" when auto or required calls ended the answer, "stop" for a
        named function; others as the engine gave them."""
        if reason == "stop" and answer.calls and self.choice.mode in ("auto", "required"):
            return "tool_calls"
        return reason


class Answer:
    """One choice's text as reasoning, content and tool calls, fed in any pieces.

    ``feed``/``finish`` return ``ToolEvent`` s: kinds ``reasoning`` and ``content`` (text),
    ``call`` and ``args`` (tool calls); ``message()`` is the whole answer."""

    def __init__(self, reasoning: Any, tools: Any, alias: bool, max_calls: int | None = None):
        self._reasoning = reasoning
        self._tools = tools
        self.alias = alias
        self.max_calls = max_calls  # parallel_tool_calls false: calls after the first are not read
        self.reasoning = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self.has_reasoning = reasoning is not None
        self.done = False

    def _content(self, text: str, final: bool) -> list[ToolEvent]:
        if self._tools is None:
            return [ToolEvent("content", text)] if text else []
        return self._tools.feed(text) + (self._tools.finish() if final else [])

    def _route(self, pieces: list[tuple[str, str]], final: bool) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        for kind, text in pieces:
            if kind == "reasoning":
                events.append(ToolEvent("reasoning", text))
            else:
                events += self._content(text, False)
        if final:
            events += self._content("", True)
        return events

    def feed(self, text: str) -> list[ToolEvent]:
        if self._reasoning is not None:
            events = self._route(self._reasoning.feed(text), False)
        else:
            events = self._content(text, False)
        return self._record(events)

    def finish(self) -> list[ToolEvent]:
        if self.done:
            return []
        self.done = True
        if self._reasoning is not None:
            events = self._route(self._reasoning.finish(), True)
        else:
            events = self._content("", True)
        return self._record(events)

    def _record(self, events: list[ToolEvent]) -> list[ToolEvent]:
        if self.max_calls is not None:
            events = [e for e in events if e.kind not in ("call", "args") or e.index < self.max_calls]
        events = merge_events(events)
        for e in events:
            if e.kind == "reasoning":
                self.reasoning += e.text
            elif e.kind == "content":
                self.content += e.text
            elif e.kind == "call":
                self.calls.append(ToolCall(e.index, e.id, e.text))
            else:
                self.calls[e.index].arguments += e.text
        return events

    def reasoning_fields(self, text: str | None) -> dict[str, Any]:
        if not self.has_reasoning:
            return {}
        out: dict[str, Any] = {"reasoning": text}
        if self.alias:
            out["reasoning_content"] = text
        return out

    def message(self) -> dict[str, Any]:
        """OpenAI's ``message`` of the whole answer."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if self.content or not self.calls else None}
        msg.update(self.reasoning_fields(self.reasoning or None))
        if self.calls:
            msg["tool_calls"] = [call_dict(c) for c in self.calls]
        return msg

    def delta(self, e: ToolEvent) -> dict[str, Any]:
        """OpenAI's streamed ``delta`` for one event."""
        if e.kind == "reasoning":
            return self.reasoning_fields(e.text)
        if e.kind == "content":
            return {"content": e.text}
        if e.kind == "call":
            return {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                    "function": {"name": e.text, "arguments": ""}}]}  # fmt: skip
        return {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}


def call_dict(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def apply_plan(plan: ChatPlan, params: SamplingParams, prompt_ids: list[int], tokenizer: Any,
               field: str = "response_format") -> SamplingParams:  # fmt: skip
    """``params`` with the plan's grammar (a forced call), reasoning markers and budget."""
    forced = plan.structured(tokenizer)
    if forced is not None:
        if params.structured_outputs is None:
            params.structured_outputs = forced
        elif plan.choice.mode != "auto":  # (auto: the response format is the grammar)
            raise InvalidRequestError(field, f'cannot be combined with tool_choice {plan.choice.mode!r} (the call '
                                      "is the answer's format)")  # fmt: skip
    params.thinking_token_budget = plan.thinking_token_budget
    needs_gate = params.structured_outputs is not None or plan.thinking_token_budget is not None
    if plan.reasoning_on and needs_gate:
        params.reasoning = plan.reasoning_params(tokenizer, prompt_ids)
    return params


def reasoning_tokens(plan: ChatPlan, tokenizer: Any, state: str | None, token_ids: list[int]) -> int:
    """How many of an answer's tokens are reasoning: those before its end marker's tokens
    (after a start marker the answer opened with), all of them when it never ended."""
    if state is None or state == "closed" or not plan.reasoning_on:
        return 0
    starts, ends, _ = plan.formats.markers(tokenizer)
    ids = list(token_ids)
    first = 0
    if state == "optional":
        opened = [s for s in starts if s and ids[: len(s)] == s]
        if not opened:
            return 0
        first = len(opened[0])
    for k in range(first, len(ids)):
        for e in ends:
            if e and ids[k : k + len(e)] == e:
                return k - first
    return len(ids) - first
