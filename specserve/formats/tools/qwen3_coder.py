"""Qwen3-Coder XML tool calls::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are raw text (one newline after the opening tag and one before the closing tag are
not part of it), coerced to the type the tool's schema gives the parameter (integer,
number, boolean, null, object and array values parsed, strings kept as written; a value
that does not parse stays a string).  A value ends at a ``</parameter>`` followed by the
next tag (``<parameter=``, ``</function>``, ``</tool_call>``) or the end of the answer:
one followed by other text is part of the value.  Arguments are streamed one parameter at
a time, as each value completes.  Text outside calls is content.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from typing import Any, ClassVar

from specserve.formats.tools.base import (
    FunctionTool,
    ToolCallFormat,
    ToolParser,
    lark_json,
    lark_string,
    lark_tag,
    new_call_id,
    partial_tag,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
_NAME = re.compile(r"[^>\n]*")
_TEXT, _FUNC, _PARAMS, _VALUE, _AFTER, _SKIP = range(6)


def _types(schema: dict | None) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out += _types(sub)
    return out


def coerce(text: str, schema: dict | None) -> Any:
    """A parameter's raw text as the value its schema's type asks for (see the module docstring)."""
    types = _types(schema)
    stripped = text.strip()
    for t in types:
        try:
            if t == "null" and stripped == "null":
                return None
            if t == "integer":
                return int(stripped)
            if t == "number":
                value = float(stripped)
                return int(value) if value.is_integer() and re.fullmatch(r"-?\d+", stripped) else value
            if t == "boolean" and stripped.lower() in ("true", "false"):
                return stripped.lower() == "true"
            if t in ("object", "array"):
                try:
                    value = json.loads(stripped)
                except ValueError:
                    value = ast.literal_eval(stripped)
                if isinstance(value, dict if t == "object" else list):
                    json.dumps(value)
                    return value
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return text


class Qwen3CoderParser(ToolParser):
    def __init__(self, tools: dict[str, FunctionTool], make_id: Callable[[], str] = new_call_id):
        super().__init__(tools, make_id)
        self.state = _TEXT
        self.block = 0
        self.index = -1
        self.num_args = 0
        self.key = ""
        self.value_start = 0

    def _skip_ws(self) -> int:
        buf, i = self.buf, self.pos
        while i < len(buf) and buf[i] in " \t\r\n":
            i += 1
        self.pos = i
        return i

    def _expect(self, tag: str, final: bool) -> bool | None:
        """Whether ``tag`` comes next (after whitespace); None: cannot tell yet."""
        got = self._next_tag((tag,), final)
        return None if got is None else got == tag

    def _next_tag(self, tags: tuple[str, ...], final: bool) -> str | bool | None:
        """Which of ``tags`` comes next (after whitespace): the tag, False for none of them,
        None when the text so far cannot tell."""
        i = self._skip_ws()
        waiting = False
        for tag in tags:
            rest = self.buf[i : i + len(tag)]
            if rest == tag:
                return tag
            waiting = waiting or tag.startswith(rest)
        return None if waiting and not final else False

    def _param_schema(self) -> dict | None:
        tool = self.tools.get(self.current)
        props = (tool.schema().get("properties") or {}) if tool is not None else {}
        return props.get(self.key)

    def _run(self, final: bool) -> None:
        buf = self.buf
        while True:
            s = self.state
            if s == _TEXT:
                k = buf.find(OPEN, self.pos)
                if k < 0:
                    end = len(buf) if final else len(buf) - partial_tag(buf[self.pos :], OPEN)
                    self._content(buf[self.pos : end])
                    self.pos = end
                    if final:
                        self._content_end()
                    return
                self._content(buf[self.pos : k])
                self.block = k
                self.pos = k + len(OPEN)
                self.state = _FUNC
            elif s == _FUNC:  # <function=NAME>
                got = self._expect(FUNC, final)
                if got is None:
                    return
                m = _NAME.match(buf, self.pos + len(FUNC)) if got else None
                if m is not None and m.end() == len(buf) and not final:
                    return
                name = m.group() if m is not None else ""
                if not got or m.end() >= len(buf) or buf[m.end()] != ">" or name not in self.tools:
                    self._content(OPEN)  # not a call: the tag was text
                    self.pos = self.block + len(OPEN)
                    self.state = _TEXT
                    continue
                self.current = name
                self.index = self._call(name)
                self.num_args = 0
                self.pos = m.end() + 1
                self.state = _PARAMS
            elif s == _PARAMS:  # <parameter=KEY>, </function> (or </tool_call> without it)
                tag = self._next_tag((PARAM, FUNC_END, CLOSE), final)
                if tag is None:
                    return
                if tag in (FUNC_END, CLOSE):
                    self._args(self.index, "}" if self.num_args else "{}")
                    if tag == FUNC_END:
                        self.pos += len(FUNC_END)
                    self.state = _AFTER
                    continue
                if tag is False:
                    self.state = _SKIP
                    continue
                m = _NAME.match(buf, self.pos + len(PARAM))
                if m.end() == len(buf) and not final:
                    return
                if m.end() >= len(buf) or buf[m.end()] != ">":
                    self.state = _SKIP
                    continue
                self.key = m.group()
                self.pos = m.end() + 1
                self.value_start = self.pos
                self.state = _VALUE
            elif s == _VALUE:
                if not self._scan_value(final):
                    return
            elif s == _AFTER:
                got = self._expect(CLOSE, final)
                if got is None:
                    return
                if got:
                    self.pos += len(CLOSE)
                self.state = _TEXT
            else:  # _SKIP: a broken call, up to its closing tag
                k = buf.find(CLOSE, self.pos)
                if k < 0:
                    self.pos = len(buf) if final else len(buf) - partial_tag(buf[self.pos :], CLOSE)
                    if final:
                        self._content_end()
                    return
                self.pos = k + len(CLOSE)
                self.state = _TEXT

    def _scan_value(self, final: bool) -> bool:
        """Find the </parameter> that ends the value; False: wait for text."""
        buf = self.buf
        k = self.pos
        while True:
            k = buf.find(PARAM_END, k)
            if k < 0:
                if final:
                    return False  # cut short: the value is not sent
                self.pos = max(self.value_start, len(buf) - len(PARAM_END))
                return False
            j = k + len(PARAM_END)
            while j < len(buf) and buf[j] in " \t\r\n":
                j += 1
            if j == len(buf) and not final:
                self.pos = k
                return False  # what follows decides
            if j == len(buf) or buf[j] == "<":
                break
            k += 1  # text follows: this </parameter> is part of the value
        raw = buf[self.value_start : k]
        if raw.startswith("\n"):
            raw = raw[1:]
        if raw.endswith("\n"):
            raw = raw[:-1]
        value = coerce(raw, self._param_schema())
        head = "{" if self.num_args == 0 else ", "
        self._args(self.index, f"{head}{json.dumps(self.key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
        self.num_args += 1
        self.pos = k + len(PARAM_END)
        self.state = _PARAMS
        return True


def _value_rule(schema: dict) -> str:
    """A Lark expression of a parameter's raw text."""
    kind = schema.get("type")
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(lark_string(v) for v in enum) + ")"
    if kind == "string":
        return "/[^<]*/"  # raw text (a value holding "<" is left to the model: tool_choice auto)
    if kind == "integer":
        return "/-?[0-9]+/"
    if kind == "boolean":
        return '("true" | "false")'
    return lark_json(schema)


class Qwen3CoderFormat(ToolCallFormat):
    name: ClassVar[str] = "qwen3_coder"

    def parser(self, tools, make_id=new_call_id) -> ToolParser:
        return Qwen3CoderParser(tools, make_id)

    def grammar(self, tools: list[FunctionTool], parallel: bool) -> str:
        rules = []
        for i, t in enumerate(tools):
            schema = t.schema()
            props = schema.get("properties") or {}
            required = [k for k in props if k in (schema.get("required") or [])]
            parts = []
            for k in required:
                head = lark_string(f"{PARAM}{k}>\n")
                parts.append(f"{head} {_value_rule(props[k])} {lark_string(chr(10) + PARAM_END + chr(10))}")
            rules.append(f"fn{i}: {lark_string(f'{FUNC}{t.name}>{chr(10)}')} {' '.join(parts)} "
                         f"{lark_string(FUNC_END)}")  # fmt: skip
        body = " | ".join(f"fn{i}" for i in range(len(tools)))
        call = f"call: {lark_tag(OPEN)} {lark_string(chr(10))} ({body}) {lark_string(chr(10))} {lark_tag(CLOSE)}"
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([start, call, *rules])

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return FUNC in chat_template and PARAM in chat_template
