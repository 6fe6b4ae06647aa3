"""Forced tool calls for a model without a tool-call format: plain JSON, as vLLM forces them.

Used only for ``tool_choice`` "required" and a named function when the model has no format
(``model.tool_call_format`` unset and none detected): the answer is the grammar's JSON.
A named function's answer is its arguments object; "required" answers a list of
``{"name": ..., "parameters": {...}}`` objects (one item when ``parallel_tool_calls`` is
false).  Never used for "auto": free text cannot be read as calls without a format.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import ClassVar

from specserve.formats.tools.base import FunctionTool, ToolCallFormat, ToolParser, new_call_id, strict_schema
from specserve.formats.tools.hermes import JsonCallReader, call_object_schema

_OPEN, _CALL, _NEXT, _DONE = range(4)


class NamedParser(ToolParser):
    """The whole answer is the arguments of the one named function."""

    def __init__(self, tools: dict[str, FunctionTool], make_id: Callable[[], str] = new_call_id):
        super().__init__(tools, make_id)
        self.index: int | None = None

    def _run(self, final: bool) -> None:
        if self.index is None:
            self.index = self._call(next(iter(self.tools)))
        self._args(self.index, self.buf[self.pos :])
        self.pos = len(self.buf)


class ListParser(ToolParser):
    """``[{"name": ..., "parameters": {...}}, ...]``."""

    def __init__(self, tools: dict[str, FunctionTool], make_id: Callable[[], str] = new_call_id):
        super().__init__(tools, make_id)
        self.state = _OPEN
        self.reader: JsonCallReader | None = None

    def _skip_ws(self) -> int:
        while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
            self.pos += 1
        return self.pos

    def _run(self, final: bool) -> None:
        buf = self.buf
        while self.state != _DONE:
            i = self._skip_ws()
            if self.state == _CALL:
                if self.reader is None:
                    if i == len(buf):
                        return
                    self.reader = JsonCallReader(self, i)
                status = self.reader.step(final)
                if status == "more":
                    return
                self.reader = None
                self.state = _NEXT if status == "done" else _DONE
                continue
            if i == len(buf):
                return
            c = buf[i]
            self.pos = i + 1
            if self.state == _OPEN:
                self.state = _CALL if c == "[" else _DONE
            else:  # _NEXT
                self.state = _CALL if c == "," else _DONE


class OpenAIJsonFormat(ToolCallFormat):
    name: ClassVar[str] = "openai_json"

    def __init__(self, named: bool):
        self.named = named

    def parser(self, tools, make_id=new_call_id) -> ToolParser:
        return NamedParser(tools, make_id) if self.named else ListParser(tools, make_id)

    def schema(self, tools: list[FunctionTool], parallel: bool) -> dict:
        """The answer's JSON schema."""
        if self.named:
            return strict_schema(tools[0].schema())
        item = {"anyOf": [call_object_schema(t, "parameters") for t in tools]}
        out = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            out["maxItems"] = 1
        return strict_schema(out)

    def grammar(self, tools: list[FunctionTool], parallel: bool) -> str:
        return "start: %json " + json.dumps(self.schema(tools, parallel), ensure_ascii=False)
