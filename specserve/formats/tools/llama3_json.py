"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the answer is ``{"name": ..., "parameters": {...}}``.

The call may follow ``<|python_tag|>`` (when the tokenizer keeps it as text), and several
calls may be separated by ``;``.  An answer is either calls or text: the first character
other than whitespace decides (``{`` or the tag: calls; anything else: text).  A JSON object
that is not a call of one of the request's tools (no name, an unknown one) is text, from
its first character; text after the calls is content.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from specserve.formats.tools.base import (
    FunctionTool,
    ToolCallFormat,
    ToolParser,
    lark_json,
    new_call_id,
)
from specserve.formats.tools.hermes import JsonCallReader, call_object_schema

PYTHON_TAG = "<|python_tag|>"
_START, _JSON, _BETWEEN, _TEXT, _SKIP = range(5)


class Llama3JsonParser(ToolParser):
    def __init__(self, tools: dict[str, FunctionTool], make_id: Callable[[], str] = new_call_id):
        super().__init__(tools, make_id)
        self.state = _START
        self.block = 0
        self.reader: JsonCallReader | None = None
        self.tagged = False  # <|python_tag|> seen

    def _run(self, final: bool) -> None:
        buf = self.buf
        while True:
            if self.state in (_START, _BETWEEN):
                i = self.pos
                while i < len(buf) and buf[i] in " \t\r\n":
                    i += 1
                if self.state == _START:
                    self._content(buf[self.pos : i])  # held: dropped if a call follows
                self.pos = i
                if i == len(buf):
                    if final:
                        self.state = _TEXT
                        continue
                    return
                if self.state == _BETWEEN:
                    if buf[i] != ";":
                        self.state = _TEXT
                        continue
                    self.pos = i + 1
                    self.state = _START
                    continue
                rest = buf[i : i + len(PYTHON_TAG)]
                if not self.tagged and rest == PYTHON_TAG:
                    self.tagged = True
                    self.pos = i + len(PYTHON_TAG)
                    continue
                if not self.tagged and PYTHON_TAG.startswith(rest) and not final:
                    return  # the tag may still be arriving
                if buf[i] != "{":
                    self.pos = i
                    self.state = _TEXT
                    continue
                self.block = i
                self.reader = JsonCallReader(self, i)
                self.state = _JSON
            elif self.state == _JSON:
                status = self.reader.step(final)
                if status == "more":
                    return
                if status == "failed":  # not a call: text from the object's first character
                    self.pos = self.block
                    self.state = _TEXT
                elif status == "broken":
                    self.state = _SKIP
                else:
                    self.state = _BETWEEN
            elif self.state == _SKIP:
                self.pos = len(buf)
                return
            else:  # _TEXT: the rest is content
                self._content(buf[self.pos :])
                self.pos = len(buf)
                if final:
                    self._content_end()
                return


class Llama3JsonFormat(ToolCallFormat):
    name: ClassVar[str] = "llama3_json"
    calls_only: ClassVar[bool] = True

    def parser(self, tools, make_id=new_call_id) -> ToolParser:
        return Llama3JsonParser(tools, make_id)

    def grammar(self, tools: list[FunctionTool], parallel: bool) -> str:
        rules = [f"fn{i}: {lark_json(call_object_schema(t, 'parameters'))}" for i, t in enumerate(tools)]
        body = " | ".join(f"fn{i}" for i in range(len(tools)))
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return "\n".join([start, f"call: {body}", *rules])

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return PYTHON_TAG in chat_template or "respond with a JSON for a function call" in chat_template
