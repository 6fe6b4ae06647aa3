"""What every tool-call format implements, and the pieces the built-in ones share.

A format (one module per format, registered in ``specserve.formats.tools``) knows how a
model writes tool calls in its text.  It gives:

* ``parser(tools)``: a fresh :class:`ToolParser` for one answer.  ``feed(text)`` takes any
  piece of the answer's text (one character, one token's, several tokens' as speculative
  decoding delivers them, or all of it) and returns :class:`ToolEvent` s; ``finish()``
  ends the text.  The events of any chunking, merged, are the same: a parser consumes its
  text left to right and decides only what the characters seen so far settle, holding
  back what the next ones might change (a partial tag, whitespace that may precede a
  call).  A non-streamed answer is the same parser fed the whole text, so a stream
  assembles to exactly the non-streamed message by construction.
* ``grammar(tools, parallel)``: a Lark grammar (llguidance's dialect, ``%json`` for the
  arguments' schemas) of one call (``parallel`` False) or one or more calls in the
  format's own syntax: ``tool_choice`` "required" and a named function are enforced with
  it, and the output is parsed by the same parser.
* ``detect(chat_template)``: whether a chat template is written for this format.

Events: ``content`` (text outside calls), ``call`` (a new call: its ``index``, ``id`` and
function ``text`` = name; its arguments start empty), ``args`` (a fragment of the
arguments of call ``index``).  Arguments are a JSON object's text, streamed as the model
writes them; a call cut short by ``max_tokens`` keeps the arguments written so far.
Content adjacent to a call loses the whitespace between them (held back while streaming
until something other than whitespace follows).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "ContentBuffer", "FunctionTool", "ParsedOutput", "ToolCall", "ToolCallFormat", "ToolEvent", "ToolParser",
    "assemble", "lark_tag", "merge_events", "new_call_id", "partial_tag", "resolve_tags", "strict_schema", "tag_token",
]  # fmt: skip


@dataclass(frozen=True)
class FunctionTool:
    """One function tool of a request (OpenAI's ``tools[i].function``)."""

    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema of the arguments object; None: no arguments
    strict: bool = False

    def schema(self) -> dict:
        """The arguments' schema (an object with no properties when none was given)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters

    def as_openai(self) -> dict:
        """The tool as OpenAI's request shape (what chat templates are given)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.schema()
        return {"type": "function", "function": fn}


@dataclass
class ToolEvent:
    kind: str  # "content", "call" or "args"
    text: str = ""  # content text, the call's name, or an arguments fragment
    index: int = 0  # the call (call, args)
    id: str = ""  # the call's id (call)


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""


@dataclass
class ParsedOutput:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def merge_events(events: Iterable[ToolEvent]) -> list[ToolEvent]:
    """Adjacent content events, and adjacent fragments of one call's arguments, as one."""
    out: list[ToolEvent] = []
    for e in events:
        if e.kind == "content" and not e.text:
            continue
        if e.kind == "args" and not e.text:
            continue
        last = out[-1] if out else None
        if last is not None and e.kind == last.kind and e.kind in ("content", "args") and e.index == last.index:
            out[-1] = ToolEvent(e.kind, last.text + e.text, e.index, last.id)
        else:
            out.append(e)
    return out


def assemble(events: Iterable[ToolEvent], into: ParsedOutput | None = None) -> ParsedOutput:
    """The message the events spell (added to ``into`` when given)."""
    out = into if into is not None else ParsedOutput()
    for e in events:
        if e.kind == "content":
            out.content += e.text
        elif e.kind == "call":
            out.calls.append(ToolCall(e.index, e.id, e.text))
        else:
            out.calls[e.index].arguments += e.text
    return out


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (a tag still arriving)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ContentBuffer:
    """Content text between calls: whitespace next to a call is dropped, so a segment's
    trailing whitespace is held back until text follows it (or the answer ends)."""

    def __init__(self) -> None:
        self.held = ""
        self.after_call = False

    def text(self, s: str) -> str:
        """Add ``s``; returns what is settled."""
        if self.after_call:
            s = s.lstrip()
            if not s:
                return ""
            self.after_call = False
        s = self.held + s
        body = s.rstrip()
        self.held = s[len(body) :]
        return body

    def call(self) -> None:
        """A call begins: the whitespace before it goes."""
        self.held = ""
        self.after_call = True

    def end(self) -> str:
        """The answer ended outside a call: the held whitespace is content after all."""
        out, self.held = self.held, ""
        return out


class ToolParser:
    """One answer's incremental parser (see the module docstring).  Subclasses implement
    ``_run(final)``, which consumes ``self.buf`` from ``self.pos`` and emits with
    ``_content``, ``_call`` and ``_args``."""

    def __init__(self, tools: dict[str, FunctionTool], make_id: Callable[[], str] = new_call_id):
        self.tools = tools
        self.make_id = make_id
        self.buf = ""
        self.pos = 0
        self.events: list[ToolEvent] = []
        self.content = ContentBuffer()
        self.num_calls = 0
        self.finished = False

    def feed(self, text: str) -> list[ToolEvent]:
        if text:
            self.buf += text
            self._run(final=False)
        return self._take()

    def finish(self) -> list[ToolEvent]:
        if not self.finished:
            self.finished = True
            self._run(final=True)
        return self._take()

    def parse(self, text: str) -> ParsedOutput:
        """A whole answer at once (the non-streamed path: the same parser)."""
        return assemble(merge_events(self.feed(text) + self.finish()))

    def _take(self) -> list[ToolEvent]:
        out, self.events = merge_events(self.events), []
        return out

    def _run(self, final: bool) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------- emitting

    def _content(self, text: str) -> None:
        settled = self.content.text(text)
        if settled:
            self.events.append(ToolEvent("content", settled))

    def _content_end(self) -> None:
        rest = self.content.end()
        if rest:
            self.events.append(ToolEvent("content", rest))

    def _call(self, name: str) -> int:
        self.content.call()
        index = self.num_calls
        self.num_calls += 1
        self.events.append(ToolEvent("call", name, index, self.make_id()))
        return index

    def _args(self, index: int, fragment: str) -> None:
        if fragment:
            self.events.append(ToolEvent("args", fragment, index))


def arguments_text(value: Any) -> str | None:
    """A finished arguments value as the JSON object text OpenAI sends; None when it is not
    an object (nor a string holding one)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def strict_schema(schema: dict) -> dict:
    """``schema`` with llguidance's compact-JSON option (no free whitespace), as response
    formats compile (``specserve.structured``)."""
    out = dict(schema)
    guidance = dict(out.get("x-guidance") or {})
    guidance.setdefault("whitespace_flexible", False)
    out["x-guidance"] = guidance
    return out


class ToolCallFormat:
    """A tool-call format: see the module docstring.  Subclasses set ``name`` and implement
    ``parser``, ``grammar`` and ``detect``."""

    name: ClassVar[str] = ""
    # Whether calls must come first in the answer for the format (the Llama 3.1 JSON and
    # pythonic formats: an answer is either text or calls).
    calls_only: ClassVar[bool] = False

    def parser(self, tools: dict[str, FunctionTool], make_id: Callable[[], str] = new_call_id) -> ToolParser:
        raise NotImplementedError

    def grammar(self, tools: list[FunctionTool], parallel: bool) -> str:
        raise NotImplementedError

    # The tag that opens a call, for ``auto_grammar``: the grammar applies only where the
    # tokenizer holds it as one token (free text can then never spell it).
    open_tag: ClassVar[str | None] = None

    def auto_grammar(self, tools: list[FunctionTool], parallel: bool) -> str | None:
        """A grammar for tool_choice "auto" with strict tools: free text, or text then calls
        whose arguments follow the strict tools' schemas (others: any JSON object).  None:
        the format cannot tell text from a call's start in a grammar (then "auto" is parsed
        as written)."""
        return None

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return False


def lark_json(schema: dict) -> str:
    """A Lark rule body holding a JSON schema (llguidance's ``%json``)."""
    return "%json " + json.dumps(strict_schema(schema), ensure_ascii=False)


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


_TAG = re.compile(r'\x00("(?:[^"\\]|\\.)*")\x00')


def lark_tag(text: str) -> str:
    """A format's tag (``<tool_call>``) in a grammar: resolved by :func:`resolve_tags` to the
    tokenizer's one token for it where it has one (as the model writes it), else the text."""
    return "\x00" + json.dumps(text, ensure_ascii=False) + "\x00"


def tag_token(tokenizer: Any, text: str) -> int | None:
    """The tokenizer's one token for a tag (Qwen's ``<tool_call>``), or None."""
    if tokenizer is None or len(text) < 2:
        return None
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == text:
        return ids[0]
    return None


def resolve_tags(grammar: str, tokenizer: Any = None) -> str:
    """``grammar`` with its tags (``lark_tag``) as token references (``<[id]>``) where the
    tokenizer encodes a tag as one token of its own, else as text literals."""

    def one(m: re.Match) -> str:
        text = json.loads(m.group(1))
        token = tag_token(tokenizer, text)
        return f"<[{token}]>" if token is not None else lark_string(text)

    return _TAG.sub(one, grammar)
