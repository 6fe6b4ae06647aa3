"""Pythonic tool calls (Llama 3.2 / 4 style): the answer is ``[get_weather(city="Paris"), other()]``.

An answer is either a list of calls or text: the first character other than whitespace
decides (``[``: calls).  Arguments are keyword arguments whose values are Python literals
(JSON literals are read too); they become the JSON object OpenAI sends, streamed one
argument at a time as each value completes.  A list whose first item is not a call of one
of the request's tools is text; text after the list is content.
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
    new_call_id,
)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_START, _CALL, _ARGS, _VALUE, _NEXT, _TEXT, _SKIP = range(7)
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def literal(text: str) -> Any:
    """A Python (or JSON) literal's value, as JSON can hold it; raises ValueError."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        try:
            return json.loads(text)
        except ValueError:
            raise ValueError(f"{text[:80]!r} is not a literal") from None
    json.dumps(value)  # tuples become lists; anything JSON cannot hold raises
    return value


class PythonicParser(ToolParser):
    def __init__(self, tools: dict[str, FunctionTool], make_id: Callable[[], str] = new_call_id):
        super().__init__(tools, make_id)
        self.state = _START
        self.block = 0
        self.index = -1
        self.num_args = 0
        self.key = ""
        self.value_start = 0
        self.stack: list[str] = []
        self.quote = ""  # the open string's quote while in one
        self.escape = False

    def _skip_ws(self) -> int:
        buf, i = self.buf, self.pos
        while i < len(buf) and buf[i] in " \t\r\n":
            i += 1
        self.pos = i
        return i

    def _fail(self) -> None:
        """Not calls after all (nothing emitted): text from the list's start, else skip the rest."""
        if self.num_calls == 0:
            self.pos = self.block
            self.state = _TEXT
        else:
            self.state = _SKIP

    def _run(self, final: bool) -> None:
        buf = self.buf
        while True:
            s = self.state
            if s == _START:
                i = self.pos
                self._content(buf[i : self._skip_ws()])  # held: dropped if calls follow
                if self.pos == len(buf):
                    if final:
                        self.state = _TEXT
                        continue
                    return
                if buf[self.pos] != "[":
                    self.state = _TEXT
                    continue
                self.block = self.pos
                self.pos += 1
                self.state = _CALL
            elif s == _CALL:  # a function name up to "("
                i = self._skip_ws()
                m = _NAME.match(buf, i)
                end = m.end() if m else i
                if end == len(buf) and not final:
                    return
                if m is None or end >= len(buf) or buf[end] != "(" or m.group() not in self.tools:
                    self._fail()
                    continue
                self.index = self._call(m.group())
                self.num_args = 0
                self.pos = end + 1
                self.state = _ARGS
            elif s == _ARGS:  # a keyword up to "=", or ")"
                i = self._skip_ws()
                if i == len(buf):
                    if final:
                        return
                    return
                if buf[i] == ")":
                    self._args(self.index, "}" if self.num_args else "{}")
                    self.pos = i + 1
                    self.state = _NEXT
                    continue
                if buf[i] == "," and self.num_args:
                    self.pos = i + 1
                    continue
                m = _NAME.match(buf, i)
                end = m.end() if m else i
                j = end
                while j < len(buf) and buf[j] in " \t":
                    j += 1
                if j == len(buf) and not final:
                    return
                if m is None or j >= len(buf) or buf[j] != "=":
                    self.state = _SKIP
                    continue
                self.key = m.group()
                self.pos = j + 1
                self.value_start = self.pos
                self.stack, self.quote, self.escape = [], "", False
                self.state = _VALUE
            elif s == _VALUE:
                if not self._scan_value(final):
                    return
            elif s == _NEXT:  # "," and the next call, or "]"
                i = self._skip_ws()
                if i == len(buf):
                    if final:
                        self.state = _TEXT
                        continue
                    return
                if buf[i] == ",":
                    self.pos = i + 1
                    self.state = _CALL
                elif buf[i] == "]":
                    self.pos = i + 1
                    self.state = _TEXT
                else:
                    self.state = _SKIP
            elif s == _SKIP:
                self.pos = len(buf)
                return
            else:  # _TEXT
                self._content(buf[self.pos :])
                self.pos = len(buf)
                if final:
                    self._content_end()
                return

    def _scan_value(self, final: bool) -> bool:
        """Read a keyword's value up to the "," or ")" that ends it; False: wait for text."""
        buf, i = self.buf, self.pos
        while i < len(buf):
            c = buf[i]
            if self.quote:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == self.quote:
                    self.quote = ""
            elif c in "'\"":
                self.quote = c
            elif c in _CLOSERS:
                self.stack.append(_CLOSERS[c])
            elif self.stack and c == self.stack[-1]:
                self.stack.pop()
            elif not self.stack and c in ",)":
                self.pos = i
                try:
                    value = literal(buf[self.value_start : i].strip())
                except ValueError:
                    self.state = _SKIP
                    return True
                head = "{" if self.num_args == 0 else ", "
                self._args(self.index, f"{head}{json.dumps(self.key)}: {json.dumps(value, ensure_ascii=False)}")
                self.num_args += 1
                self.state = _ARGS
                return True
            elif c in ")]}":
                self.state = _SKIP
                self.pos = i
                return True
            i += 1
        self.pos = i
        return False


def python_value_rule(schema: dict) -> str:
    """A Lark expression of a value of ``schema`` written as a Python literal."""
    kind = schema.get("type")
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    return lark_json(schema)


class PythonicFormat(ToolCallFormat):
    name: ClassVar[str] = "pythonic"
    calls_only: ClassVar[bool] = True

    def parser(self, tools, make_id=new_call_id) -> ToolParser:
        return PythonicParser(tools, make_id)

    def grammar(self, tools: list[FunctionTool], parallel: bool) -> str:
        rules = []
        for i, t in enumerate(tools):
            schema = t.schema()
            props = schema.get("properties") or {}
            required = [k for k in props if k in (schema.get("required") or [])]
            parts = [f"{lark_string(k + '=')} {python_value_rule(props[k])}" for k in required]
            args = ' ", " '.join(parts)
            rules.append(f"fn{i}: {lark_string(t.name + '(')} {args} \")\"" if parts
                         else f"fn{i}: {lark_string(t.name + '()')}")  # fmt: skip
        body = " | ".join(f"fn{i}" for i in range(len(tools)))
        start = 'start: "[" call (", " call)* "]"' if parallel else 'start: "[" call "]"'
        return "\n".join([start, f"call: {body}", *rules])

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return "[func_name1(" in chat_template or "[func_name(" in chat_template
