"""Hermes / Qwen2.5 / Qwen3 tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Calls may repeat (parallel calls); text before, between and after them is content.
``parameters`` is read as ``arguments`` too, and a missing ``</tool_call>`` at the end of
the answer is tolerated.  A call ends where its JSON object ends (``JsonScanner``), never
at the first ``</tool_call>``, which may sit inside an argument's string.  A block whose
JSON fails before its call's name is known (not JSON, no name, a name that is not one of
the request's tools) is content; one that fails later keeps the call as far as it went,
and the text up to the next ``</tool_call>`` is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import ClassVar

from specserve.formats.json_scan import JsonScanner
from specserve.formats.tools.base import (
    FunctionTool,
    ToolCallFormat,
    ToolParser,
    arguments_text,
    lark_json,
    lark_string,
    lark_tag,
    new_call_id,
    partial_tag,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")
_TEXT, _JSON, _AFTER, _SKIP = range(4)


def call_object_schema(tool: FunctionTool, args_key: str = "arguments") -> dict:
    """The JSON schema of one call object ``{"name": <tool>, "<args_key>": {...}}``."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, args_key: tool.schema()},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


class JsonCallReader:
    """Reads one call object ``{"name": ..., "<arguments>": {...}}`` for a parser, emitting
    the call once its name is known and its arguments as they arrive.  Shared by the
    formats whose calls are such objects (Hermes, Llama 3.1 JSON)."""

    def __init__(self, parser: ToolParser, start: int, name_keys: tuple[str, ...] = ("name",)):
        self.p = parser
        self.scan = JsonScanner(start)
        self.name_keys = name_keys
        self.index: int | None = None  # the call, once emitted
        self.sent = 0  # offset in the buffer up to which the arguments were emitted

    def _args_member(self):
        for m in self.scan.members:
            if m.key in ARGUMENT_KEYS:
                return m
        return None

    def _name(self) -> str | None | bool:
        """The call's name once known; False when the object cannot be a call."""
        for key in self.name_keys:
            m = self.scan.member(key)
            if m is not None and m.end is not None:
                try:
                    name = json.loads(self.p.buf[m.start : m.end])
                except ValueError:
                    return False
                return name if isinstance(name, str) and name in self.p.tools else False
        return None

    def step(self, final: bool) -> str:
        """Consume what the buffer holds; returns "more" (wait for text), "done" (the object
        ended), "failed" (not a call; nothing was emitted) or "broken" (a call was emitted,
        then the text stopped being JSON)."""
        p = self.p
        p.pos = self.scan.scan(p.buf, p.pos)
        if final:
            self.scan.finish(p.buf)
        if self.index is None:
            name = self._name()
            if name is False:
                return "failed"
            if isinstance(name, str):
                self.index = p._call(name)
        if self.index is not None:
            self._emit_args()
        if self.scan.error is not None:
            return "failed" if self.index is None else "broken"
        if self.scan.done:
            if self.index is None:
                return "failed"
            if self._args_member() is None:
                p._args(self.index, "{}")
            return "done"
        if final and self.index is None:
            return "failed"
        return "more"

    def _emit_args(self) -> None:
        m = self._args_member()
        if m is None or m.start is None:
            return
        buf = self.p.buf
        if buf[m.start] == "{":  # streamed as written
            end = m.end if m.end is not None else self.p.pos
            self.sent = max(self.sent, m.start)
            if end > self.sent:
                self.p._args(self.index, buf[self.sent : end])
                self.sent = end
        elif m.end is not None and self.sent < m.end:  # a string holding the object, or worse: at its end
            self.sent = m.end
            raw = buf[m.start : m.end]
            try:
                text = arguments_text(json.loads(raw))
            except ValueError:
                text = None
            self.p._args(self.index, text if text is not None else raw)


class HermesParser(ToolParser):
    def __init__(self, tools: dict[str, FunctionTool], make_id: Callable[[], str] = new_call_id):
        super().__init__(tools, make_id)
        self.state = _TEXT
        self.block = 0  # where the current <tool_call> tag starts
        self.reader: JsonCallReader | None = None

    def _run(self, final: bool) -> None:
        buf = self.buf
        while True:
            if self.state == _TEXT:
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
                self.reader = JsonCallReader(self, self.pos)
                self.state = _JSON
            elif self.state == _JSON:
                status = self.reader.step(final)
                if status == "more":
                    return
                if status == "failed":  # the tag was text after all; read on from after it
                    self._content(OPEN)
                    self.pos = self.block + len(OPEN)
                    self.state = _TEXT
                elif status == "broken":
                    self.state = _SKIP
                else:
                    self.state = _AFTER
            elif self.state == _AFTER:
                while self.pos < len(buf) and buf[self.pos] in " \t\r\n":
                    self.pos += 1
                rest = buf[self.pos : self.pos + len(CLOSE)]
                if rest == CLOSE:
                    self.pos += len(CLOSE)
                    self.state = _TEXT
                elif CLOSE.startswith(rest) and not final:
                    return  # the closing tag may still be arriving
                else:
                    self.state = _TEXT  # no closing tag: text (or the next call) follows
            else:  # _SKIP: the rest of a broken call, up to its closing tag
                k = buf.find(CLOSE, self.pos)
                if k < 0:
                    self.pos = len(buf) - partial_tag(buf[self.pos :], CLOSE)
                    if final:
                        self.pos = len(buf)
                        self._content_end()
                    return
                self.pos = k + len(CLOSE)
                self.state = _TEXT


class HermesFormat(ToolCallFormat):
    name: ClassVar[str] = "hermes"
    open_tag: ClassVar[str | None] = OPEN

    def parser(self, tools, make_id=new_call_id) -> ToolParser:
        return HermesParser(tools, make_id)

    def _calls(self, tools: list[FunctionTool], strict_only: bool) -> list[str]:
        """The call rule and one rule per tool (its schema; with ``strict_only``, any object
        for the tools that are not strict)."""
        def schema(t: FunctionTool) -> dict:
            if strict_only and not t.strict:
                t = FunctionTool(t.name, parameters={"type": "object"})
            return call_object_schema(t)

        rules = [f"fn{i}: {lark_json(schema(t))}" for i, t in enumerate(tools)]
        body = " | ".join(f"fn{i}" for i in range(len(tools)))
        call = f"call: {lark_tag(OPEN)} {lark_string(chr(10))} ({body}) {lark_string(chr(10))} {lark_tag(CLOSE)}"
        return [call, *rules]

    def grammar(self, tools: list[FunctionTool], parallel: bool) -> str:
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([start, *self._calls(tools, False)])

    def auto_grammar(self, tools: list[FunctionTool], parallel: bool) -> str | None:
        calls = 'call ("\\n" call)*' if parallel else "call"
        return "\n".join([f"start: TEXT? ({calls})?", "TEXT: /(?s:.+)/", *self._calls(tools, True)])

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return OPEN in chat_template and "<function=" not in chat_template
