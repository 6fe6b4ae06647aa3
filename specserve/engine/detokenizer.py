"""Incremental detokenisation with stop-string handling (pure Python).

Decoding a window that starts a few tokens back keeps leading spaces and
multi-byte characters right: the new text is decode(window + new) minus
decode(window), taken only once it no longer ends in an incomplete character
(U+FFFD).  With stop strings, the last len(longest stop) - 1 characters are
held back until the request finishes, so a client never sees part of a stop
string.
"""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5


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
        before it is flushed; `final` flushes the held-back tail."""
        stopped = False
        if new_ids:
            self.ids.extend(new_ids)
            full = self.tok.decode(self.ids[self.prefix :])
            if not full.endswith("\ufffd"):
                seen = self.tok.decode(self.ids[self.prefix : self.read])
                start = max(0, len(self.text) - self.hold)
                self.text += full[len(seen) :]
                self.prefix, self.read = self.read, len(self.ids)
                cut = min((j for j in (self.text.find(s, start) for s in self.stop) if j != -1), default=-1)
                if cut != -1:
                    self.text = self.text[:cut]
                    stopped = True
        end = len(self.text) if (final or stopped) else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta, stopped
