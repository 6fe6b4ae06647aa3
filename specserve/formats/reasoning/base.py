"""What every reasoning format implements, and the marker-based parser the built-in ones share.

A reasoning format knows how a model sets its reasoning apart from its answer: the
markers that open and close it (``start`` and ``end``, each a tuple of spellings, the
first one canonical) and whether an answer begins inside the reasoning.  It gives:

* ``initial_state(prompt_tail)``: where the answer starts, read from the end of the
  prompt's text (a chat template may open the reasoning in the prompt, as
  Qwen3-Thinking's does with ``<think>\\n``, or open and close it, as Qwen3's does with
  ``enable_thinking: false``): ``"open"`` (the answer starts inside the reasoning),
  ``"closed"`` (it starts after it) or ``"optional"`` (it may start with the start marker);
* ``parser(state)``: a :class:`ReasoningParser` for one answer: ``feed(text)`` takes any
  piece of the answer and returns ``(kind, text)`` pieces, kind ``"reasoning"`` or
  ``"content"``; ``finish()`` ends it.  As for tool calls, any chunking yields the same
  pieces once merged: the parser decides only what the characters so far settle.
  Whitespace next to a marker is dropped (held back while streaming).  An answer that
  ends inside the reasoning (cut by ``max_tokens``) is all reasoning;
* ``detect(chat_template)``: whether a chat template is written for this format.

The engine reads the same markers as token ids (``specserve.engine.reasoning_gate``):
a grammar starts after the end marker, and a thinking budget forces it.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["MarkerParser", "ReasoningFormat", "ReasoningParser", "merge_pieces"]

OPEN, CLOSED, OPTIONAL = "open", "closed", "optional"
STATES = (OPEN, CLOSED, OPTIONAL)


def merge_pieces(pieces: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind, text in pieces:
        if not text:
            continue
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


class ReasoningParser:
    def feed(self, text: str) -> list[tuple[str, str]]:
        raise NotImplementedError

    def finish(self) -> list[tuple[str, str]]:
        raise NotImplementedError

    def split(self, text: str) -> tuple[str, str]:
        """A whole answer at once: (reasoning, content)."""
        reasoning = content = ""
        for kind, t in self.feed(text) + self.finish():
            if kind == "reasoning":
                reasoning += t
            else:
                content += t
        return reasoning, content


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """The longest end of ``text`` that begins one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def _find(text: str, markers: tuple[str, ...], start: int) -> tuple[int, str]:
    """The first occurrence of any marker at or after ``start``: (index, marker); (-1, "")."""
    best, found = -1, ""
    for m in markers:
        k = text.find(m, start)
        if k >= 0 and (best < 0 or k < best):
            best, found = k, m
    return best, found


_LEAD, _REASONING, _CONTENT = range(3)


class MarkerParser(ReasoningParser):
    """Reasoning between a start and an end marker (see the module docstring)."""

    def __init__(self, start: tuple[str, ...], end: tuple[str, ...], state: str):
        self.start, self.end = start, end
        self.state = {CLOSED: _CONTENT}.get(state, _LEAD)
        self.optional = state == OPTIONAL  # LEAD decides between reasoning and content
        self.buf = ""
        self.pos = 0
        self.held = ""  # whitespace that may precede the end marker
        self.strip = state != CLOSED  # drop leading whitespace of the next segment
        self.out: list[tuple[str, str]] = []
        self.done = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        self._run(False)
        return self._take()

    def finish(self) -> list[tuple[str, str]]:
        if not self.done:
            self.done = True
            self._run(True)
        return self._take()

    def _take(self) -> list[tuple[str, str]]:
        out, self.out = merge_pieces(self.out), []
        return out

    def _emit(self, kind: str, text: str, hold: bool) -> None:
        if self.strip:
            text = text.lstrip()
            if not text:
                return
            self.strip = False
        if hold:
            text = self.held + text
            body = text.rstrip()
            self.held = text[len(body) :]
            text = body
        if text:
            self.out.append((kind, text))

    def _run(self, final: bool) -> None:
        buf = self.buf
        while True:
            if self.state == _LEAD:  # an optional (or redundant) start marker, after whitespace
                i = self.pos
                while i < len(buf) and buf[i].isspace():
                    i += 1
                rest = buf[i:]
                marker = next((m for m in self.start if rest.startswith(m)), None)
                if marker is not None:
                    self.pos = i + len(marker)
                    self.state = _REASONING
                    self.strip = True
                    continue
                if i == len(buf) or any(m.startswith(rest) for m in self.start):
                    if not final:
                        return  # cannot tell yet
                if self.optional:
                    self.state = _CONTENT
                    self.strip = False  # an answer without reasoning keeps its text as written
                else:
                    self.state = _REASONING
            elif self.state == _REASONING:
                k, marker = _find(buf, self.end, self.pos)
                if k < 0:
                    end = len(buf) if final else len(buf) - _partial(buf[self.pos :], self.end)
                    self._emit("reasoning", buf[self.pos : end], hold=not final)
                    self.pos = end
                    if final and self.held:
                        self.out.append(("reasoning", self.held))
                        self.held = ""
                    return
                self._emit("reasoning", buf[self.pos : k], hold=True)
                self.held = ""
                self.pos = k + len(marker)
                self.state = _CONTENT
                self.strip = True
            else:
                self._emit("content", buf[self.pos :], hold=False)
                self.pos = len(buf)
                return


class ReasoningFormat:
    """A reasoning format: see the module docstring."""

    name: ClassVar[str] = ""
    start: ClassVar[tuple[str, ...]] = ("<think>",)
    end: ClassVar[tuple[str, ...]] = ("</think>",)
    # Where an answer starts when the prompt says nothing: "optional" (the model may open
    # its reasoning) or "open" (it starts inside it: DeepSeek-R1 may not write <think>).
    default_state: ClassVar[str] = OPTIONAL

    def initial_state(self, prompt_tail: str) -> str:
        """Read the end of the prompt (see the module docstring): a start marker followed
        only by whitespace opens the reasoning; an end marker followed only by whitespace,
        after a start marker, closes it."""
        s_at, s_marker = _last(prompt_tail, self.start)
        e_at, e_marker = _last(prompt_tail, self.end)
        if s_at >= 0 and s_at > e_at and not prompt_tail[s_at + len(s_marker) :].strip():
            return OPEN
        if e_at >= 0 and e_at > s_at >= 0 and not prompt_tail[e_at + len(e_marker) :].strip():
            return CLOSED
        return self.default_state

    def parser(self, state: str) -> ReasoningParser:
        return MarkerParser(self.start, self.end, state)

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return False


def _last(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    best, found = -1, ""
    for m in markers:
        k = text.rfind(m)
        if k > best:
            best, found = k, m
    return best, found
