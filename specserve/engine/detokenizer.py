"""Incremental detokenisation with stop-string handling (pure Python).

The text of a stream must equal one decode of all its token ids however the
ids arrive: one at a time, or several per step as speculation delivers them,
with multi-byte characters split across step boundaries.

Method: a window of ids starting a few tokens back (``prefix``) keeps leading
spaces right; ``read`` marks where the already-emitted text ends.  New text is
decode(ids[prefix:j]) minus decode(ids[prefix:read]) for the LONGEST j whose
decode does not end in an incomplete character (U+FFFD), so the complete part
of a multi-token delivery is emitted at once and only an unfinished character
waits for the next step.  ``final`` emits whatever remains, unfinished or not,
exactly as a one-shot decode would show it.

With stop strings, the last len(longest stop) - 1 characters are held back
until the request finishes, so a client never sees part of a stop string; the
stop string completed first (as if tokens arrived one character at a time)
wins, and the text is cut before it.
"""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str]):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""  # all decoded text (cut at a stop string)
        self.emitted = 0  # characters of self.text already returned
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1

    def append(self, new_ids: list[int], final: bool = False) -> tuple[str, bool]:
        """Add tokens; return (text delta to emit, whether a stop string matched).

        On a stop match the text is cut before the stop string and everything
        before it is flushed; ``final`` flushes undecoded ids and the held-back tail."""
        self.ids.extend(new_ids)
        stopped = False
        if len(self.ids) > self.read:
            start = max(0, len(self.text) - self.hold)
            self.text += self._decode_new(final)
            stopped = self._cut_at_stop(start)
        end = len(self.text) if (final or stopped) else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta, stopped

    def _decode_new(self, final: bool) -> str:
        """Text of the pending ids that can be shown now; advances the window."""
        seen = self.tok.decode(self.ids[self.prefix : self.read])
        for j in range(len(self.ids), self.read, -1):  # longest complete prefix of the pending ids
            full = self.tok.decode(self.ids[self.prefix : j])
            if final or not full.endswith(REPLACEMENT):
                self._advance(j)
                return full[len(seen) :]
            final = False  # only the whole pending run may be flushed unfinished
        return ""

    def _advance(self, read: int) -> None:
        """Move the window: it now starts where the emitted text ended, stepping further
        back while its text is empty (only special tokens, say), because a decoder that
        strips the first leading space (SentencePiece) would otherwise strip the next
        token's real space."""
        prefix = self.read
        while prefix > 0 and not self.tok.decode(self.ids[prefix:read]):
            prefix -= 1
        self.prefix, self.read = prefix, read

    def _cut_at_stop(self, start: int) -> bool:
        """Cut ``text`` before the stop string that is COMPLETED first (smallest end; at a
        tie the longest), searching matches that start at or after ``start``.  Ranking by
        end, not start, makes the cut independent of how many tokens a step delivers."""
        cut = find_stop(self.text, self.stop, start)
        if cut is None:
            return False
        self.text = self.text[:cut]
        return True


def find_stop(text: str, stop: list[str], start: int = 0) -> int | None:
    """Where ``text`` is cut by the first-completed stop string, or None."""
    best: tuple[int, int] | None = None  # (end, start) of the winning match
    for s in stop:
        j = text.find(s, start)
        if j != -1 and (best is None or (j + len(s), j) < best):
            best = (j + len(s), j)
    return None if best is None else best[1]
