"""An incremental scanner of one JSON value in a growing text (pure Python, no imports of the package).

Tool-call parsers read JSON that a model is still writing: they must know where a value
ends (never trusting a closing tag that may sit inside a string), which members of an
object have been seen, and where a member's value starts, before the text is complete.
:class:`JsonScanner` walks the text once, left to right, whatever pieces it arrives in:
``scan(buf, i)`` consumes ``buf[i:]`` (the caller appends to ``buf`` between calls) and
stops when the value is complete, when the text is not JSON, or at the end of ``buf``.
It records the top-level members of an object value (``members``: key, value start,
value end, as offsets into ``buf``).  The complete value is finally checked with
``json.loads``, so ``error`` is set for anything the structural scan let through.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["JsonScanner", "Member"]

_STRING_RUN = re.compile(r'[^"\\]+')
_LITERAL_CHARS = frozenset("0123456789+-.eEtrufalsn")
_WS = frozenset(" \t\n\r")

# what the innermost container expects next
_VALUE, _KEY, _KEY_OR_END, _COLON, _COMMA_OR_END, _VALUE_OR_END = range(6)


@dataclass
class Member:
    """A member of the top-level object: its key (None while the key is being read) and
    where its value lies in the buffer (``end`` None while the value is being read)."""

    key: str | None
    key_start: int
    start: int | None = None
    end: int | None = None


class JsonScanner:
    """Scans one JSON value (leading whitespace allowed) starting at ``start`` in a buffer."""

    def __init__(self, start: int):
        self.start = start  # where the value's text begins (leading whitespace included)
        self.value_start: int | None = None  # its first character
        self.stack: list[str] = []  # open containers: "{" or "["
        self.expect = _VALUE
        self.in_string = False
        self.escape = False
        self.literal_start: int | None = None  # a number / true / false / null being read
        self.members: list[Member] = []
        self.done = False
        self.end: int | None = None  # offset just past the value, once done
        self.error: str | None = None

    # ---------------------------------------------------------------- results

    def member(self, key: str) -> Member | None:
        for m in self.members:
            if m.key == key:
                return m
        return None

    def value(self, buf: str) -> Any:
        """The parsed value (only when ``done`` and not ``error``)."""
        return json.loads(buf[self.value_start : self.end])

    # ---------------------------------------------------------------- scanning

    def _fail(self, why: str, i: int) -> int:
        self.error = why
        return i

    def _value_done(self, end: int) -> None:
        """A value ended just before ``end`` at the current depth."""
        depth = len(self.stack)
        if depth == 0:
            self.done, self.end = True, end
            return
        if depth == 1 and self.stack[0] == "{" and self.members and self.members[-1].end is None:
            self.members[-1].end = end
        self.expect = _COMMA_OR_END

    def scan(self, buf: str, i: int) -> int:
        """Consume ``buf[i:]`` up to the end of the value; returns the offset reached."""
        n = len(buf)
        while i < n and not self.done and self.error is None:
            if self.in_string:
                m = _STRING_RUN.match(buf, i)
                if m is not None and not self.escape:
                    i = m.end()
                    continue
                c = buf[i]
                i += 1
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.expect == _COLON:  # it was a key
                        if len(self.stack) == 1 and self.stack[0] == "{":
                            mem = self.members[-1]
                            try:
                                mem.key = json.loads(buf[mem.key_start : i])
                            except ValueError:
                                return self._fail("a key is not a valid JSON string", i)
                    else:
                        self._value_done(i)
                continue
            c = buf[i]
            if self.literal_start is not None:
                if c in _LITERAL_CHARS:
                    i += 1
                    continue
                start, self.literal_start = self.literal_start, None
                try:
                    json.loads(buf[start:i])
                except ValueError:
                    return self._fail(f"{buf[start:i]!r} is not a JSON value", i)
                self._value_done(i)
                if self.done:
                    return i
                continue  # the terminating character is read below as structure
            if c in _WS:
                i += 1
                continue
            e = self.expect
            if e in (_VALUE, _VALUE_OR_END):
                if e == _VALUE_OR_END and c == "]":
                    self.stack.pop()
                    i += 1
                    self._value_done(i)
                    continue
                if self.value_start is None:
                    self.value_start = i
                if len(self.stack) == 1 and self.stack[0] == "{" and self.members:
                    self.members[-1].start = i
                if c == "{":
                    self.stack.append("{")
                    self.expect = _KEY_OR_END
                elif c == "[":
                    self.stack.append("[")
                    self.expect = _VALUE_OR_END
                elif c == '"':
                    self.in_string = True
                    self.expect = _VALUE
                elif c in _LITERAL_CHARS:
                    self.literal_start = i
                else:
                    return self._fail(f"unexpected {c!r} where a value should start", i)
                i += 1
                continue
            if e in (_KEY, _KEY_OR_END):
                if e == _KEY_OR_END and c == "}":
                    self.stack.pop()
                    i += 1
                    self._value_done(i)
                    continue
                if c != '"':
                    return self._fail(f"unexpected {c!r} where a key should start", i)
                if len(self.stack) == 1:
                    self.members.append(Member(None, i))
                self.in_string = True
                self.expect = _COLON
                i += 1
                continue
            if e == _COLON:
                if c != ":":
                    return self._fail(f"unexpected {c!r} where ':' should follow a key", i)
                self.expect = _VALUE
                i += 1
                continue
            # _COMMA_OR_END
            top = self.stack[-1]
            if c == ",":
                self.expect = _KEY if top == "{" else _VALUE
            elif (c == "}" and top == "{") or (c == "]" and top == "["):
                self.stack.pop()
                i += 1
                self._value_done(i)
                continue
            else:
                return self._fail(f"unexpected {c!r} after a value", i)
            i += 1
        if self.done and self.error is None:
            try:
                json.loads(buf[self.value_start : self.end])
            except ValueError as e:  # what the structural scan let through (bad escapes, ...)
                self.error = str(e)
        return i

    def finish(self, buf: str) -> None:
        """The text ended: a top-level literal still being read ends here."""
        if self.literal_start is not None and not self.stack and self.error is None:
            start, self.literal_start = self.literal_start, None
            try:
                json.loads(buf[start:])
            except ValueError:
                self.error = f"{buf[start:]!r} is not a JSON value"
                return
            self._value_done(len(buf))
