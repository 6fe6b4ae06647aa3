"""Incremental detokenisation with stop-string handling (pure Python).

The text of a stream must equal one decode of all its token ids however the
ids arrive: one at a time, or several per step as speculation delivers them,
with multi-byte characters split across step boundaries.  And each step must
cost O(new tokens), whatever the text: the served path detokenises on the
server's event loop.

Method: a window of ids starting a few tokens back (``prefix``) keeps leading
spaces right; ``read`` marks where the already-emitted text ends.  New text is
decode(ids[prefix:j]) minus decode(ids[prefix:read]), where j is the end of the
pending ids less an unfinished character at their end, so only that character
waits for the next step.  ``final`` emits whatever remains, unfinished or not,
exactly as a one-shot decode would show it.

"Unfinished" is decided from the tokens' BYTES (``TokenBytes``): the pending
bytes end in an incomplete UTF-8 sequence, which is at most 3 bytes.  A genuine
U+FFFD character (the complete bytes EF BF BD) is emitted at once.  For a
tokenizer whose token bytes are unknown, the decoded text decides instead: it
ends in U+FFFD; since a character is at most 4 bytes, at most 3 trailing tokens
are then held back, so a run of genuine U+FFFD costs no more than other text.

With stop strings, the last len(longest stop) - 1 characters are held back
until the request finishes, so a client never sees part of a stop string; the
stop string completed first (as if tokens arrived one character at a time)
wins, and the text is cut before it (after it with ``include_stop``, vLLM's
``include_stop_str_in_output``: then nothing is held back, as in vLLM).

``skip_special_tokens`` False (vLLM's field) keeps special tokens' text;
``spaces_between_special_tokens`` False then joins adjacent special tokens with
nothing between them, whatever the tokenizer's decoder puts there.

:class:`TokenChars` counts the characters each token ends at, from the tokens'
bytes and in O(new tokens): the output processor holds a token back until the
text through it has been emitted, so a token (and its log-probability) never
reaches a client before its text, and one that a stop string cuts never does.
"""

from __future__ import annotations

import codecs
import json
import re
import weakref
from typing import Any

CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"
MAX_INCOMPLETE_BYTES = 3  # the longest unfinished UTF-8 sequence (a 4-byte character less one)
MAX_HELD_TOKENS = 8  # bound on tokens held back for one unfinished character (see complete_end)
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece byte-fallback tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str], include_stop: bool = False,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):  # fmt: skip
        self.tok = tokenizer
        self.skip_special = skip_special_tokens
        # None: judge unfinished text from the decoded text
        self.bytes = token_bytes(tokenizer, skip_special_tokens)
        self._joined = None  # special token ids decoded apart (spaces_between_special_tokens False)
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._joined = special_token_ids(tokenizer) or None
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.seen: str | None = None  # decode(ids[prefix:read]), once known
        self.text = ""  # all decoded text (cut at a stop string)
        self.emitted = 0  # characters of self.text already returned
        self.stop = stop
        self.include_stop = include_stop
        self.lookback = max((len(s) for s in stop), default=1) - 1  # a stop string may start this far back
        self.hold = 0 if include_stop else self.lookback  # characters not emitted before the end
        self.stopped = False  # a stop string cut the text: it is final

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` under this request's special-token settings."""
        if self.skip_special:
            return self.tok.decode(ids)
        if self._joined is None:
            return self.tok.decode(ids, skip_special_tokens=False)
        # A special token after a special token starts a new piece: no separator between them.
        out, start = [], 0
        for j in range(1, len(ids)):
            if ids[j] in self._joined and ids[j - 1] in self._joined:
                out.append(self.tok.decode(ids[start:j], skip_special_tokens=False))
                start = j
        out.append(self.tok.decode(ids[start:], skip_special_tokens=False))
        return "".join(out)

    def append(self, new_ids: list[int], final: bool = False) -> tuple[str, bool]:
        """Add tokens; return (text delta to emit, whether a stop string matched).

        On a stop match the text is cut before the stop string and everything
        before it is flushed; ``final`` flushes undecoded ids and the held-back tail.
        After a stop match the text is final: later calls add nothing (an unfinished
        character held back when the stop string matched is not shown after the cut)."""
        if self.stopped:
            return "", True
        self.ids.extend(self.bytes.keep(new_ids) if self.bytes is not None else new_ids)
        stopped = False
        if len(self.ids) > self.read:
            start = max(0, len(self.text) - self.lookback)
            self.text += self._decode_new(final)
            stopped = self.stopped = self._cut_at_stop(start)
        end = len(self.text) if (final or stopped) else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta, stopped

    def _decode_new(self, final: bool) -> str:
        """Text of the pending ids that can be shown now; advances the window.
        Decodes a bounded number of windows, each of the last step's ids plus the pending ones."""
        full = None
        if final:
            end = len(self.ids)
        elif self.bytes is not None:
            end = self.bytes.complete_end(self.ids, self.read)
        else:
            end, full = self._complete_end_by_text()
        if end <= self.read:
            return ""
        if self.seen is None:
            self.seen = self.decode(self.ids[self.prefix : self.read])
        seen = self.seen
        if full is None:
            full = self.decode(self.ids[self.prefix : end])
        self._advance(end)
        return full[len(seen) :]

    def _complete_end_by_text(self) -> tuple[int, str | None]:
        """Without token bytes: the longest pending run whose decode does not end in
        U+FFFD, looking at most MAX_INCOMPLETE_BYTES tokens back (each token is at least
        one byte, so an unfinished character cannot start earlier: a U+FFFD there is a
        real one, or bytes no later token can complete).  Returns (end, its decode)."""
        n = len(self.ids)
        floor = max(self.read, n - MAX_INCOMPLETE_BYTES)
        for j in range(n, floor, -1):
            full = self.decode(self.ids[self.prefix : j])
            if not full.endswith(REPLACEMENT):
                return j, full
        return floor, None

    def _advance(self, read: int) -> None:
        """Move the window: it now starts where the emitted text ended, stepping further
        back (a few tokens at most) while its text is empty (special tokens, say), because
        a decoder that strips the first leading space (SentencePiece) would otherwise strip
        the next token's real space."""
        prefix = self.read
        seen = self.decode(self.ids[prefix:read])
        lowest = max(0, prefix - CONTEXT_TOKENS)
        while not seen and prefix > lowest:
            prefix -= 1
            seen = self.decode(self.ids[prefix:read])
        self.prefix, self.read, self.seen = prefix, read, seen

    def _cut_at_stop(self, start: int) -> bool:
        """Cut ``text`` before the stop string that is COMPLETED first (smallest end; at a
        tie the longest), or after it with ``include_stop``, searching matches that start at
        or after ``start``.  Ranking by end, not start, makes the cut independent of how
        many tokens a step delivers."""
        match = find_stop(self.text, self.stop, start)
        if match is None:
            return False
        self.text = self.text[: match[1] if self.include_stop else match[0]]
        return True


def find_stop(text: str, stop: list[str], start: int = 0) -> tuple[int, int] | None:
    """(start, end) in ``text`` of the first-completed stop string, or None."""
    best: tuple[int, int] | None = None  # (end, start) of the winning match
    for s in stop:
        j = text.find(s, start)
        if j != -1 and (best is None or (j + len(s), j) < best):
            best = (j + len(s), j)
    return None if best is None else (best[1], best[0])


class TokenChars:
    """Where each token's text ends, in characters of the output text; a character made of
    several tokens' bytes counts on the token that completes it.  The count depends on the
    tokens only, never on how many a step delivered.

    Where a decode is the tokens' bytes joined (a byte-level vocabulary whose decoder adds
    nothing between tokens: ``TokenBytes.joined``), a running count through an incremental
    UTF-8 decoder.  Otherwise (decoders that put spaces between tokens, strip them, or turn
    each byte of an unfinished character into U+FFFD) what the tokens since the last
    character boundary add to the decode of the few tokens before them; the token bytes
    (or, without them, a trailing U+FFFD) tell where a character is unfinished."""

    def __init__(self, detok: IncrementalDetokenizer, prompt_ids: list[int]):
        self.bytes = detok.bytes
        self.joined = detok.bytes is not None and detok.bytes.joined
        self.decode = detok.decode
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        # The window: whole characters' tokens before the last boundary, a few tokens' worth
        # (a window starting inside a character would decode differently as it grows).
        tail = list(prompt_ids[-CONTEXT_TOKENS:])
        while len(tail) > 1 and self.decode(tail).startswith(REPLACEMENT):
            tail = tail[1:]
        self._groups: list[list[int]] = [tail] if tail and not self.joined else []
        self._base = len(self.decode(tail)) if self._groups else 0
        self._open: list[int] = []  # tokens since the last character boundary
        self.chars = 0  # characters through the last boundary

    @property
    def _window(self) -> list[int]:
        return [t for g in self._groups for t in g]

    def ends(self, ids: list[int]) -> list[int]:
        """The character offset where the text through each of ``ids`` ends."""
        return [self._end(t) for t in ids]

    def _end(self, t: int) -> int:
        if self.joined:
            self.chars += len(self._utf8.decode(self.bytes(t)))
            return self.chars  # an unfinished character counts on the token that completes it
        self._open.append(t)
        if self.bytes is not None:
            self._utf8.decode(self.bytes(t))
            unfinished = bool(self._utf8.getstate()[0])
            text = None
        else:
            text = self.decode(self._window + self._open)
            unfinished = text.endswith(REPLACEMENT) and len(self._open) <= MAX_INCOMPLETE_BYTES
        if unfinished:
            return self.chars
        if text is None:
            text = self.decode(self._window + self._open)
        self.chars += max(0, len(text) - self._base)
        self._groups.append(self._open)
        self._open = []
        base = None
        while len(self._groups) > 1 and sum(map(len, self._groups[1:])) >= CONTEXT_TOKENS:
            # A window must keep some text: decoders that strip a leading space would drop the
            # next token's space if the window decoded to nothing (a run of special tokens).
            rest = self.decode([t for g in self._groups[1:] for t in g])
            if not rest:
                break
            del self._groups[0]
            base = rest
        self._base = len(self.decode(self._window) if base is None else base)
        return self.chars


# --------------------------------------------------------------------------- token bytes


def incomplete_tail(data: bytes) -> int:
    """How many trailing bytes of ``data`` are an unfinished UTF-8 character: a valid
    start that later bytes could complete (0 if none).  Only the last 3 bytes can be."""
    tail = data[-MAX_INCOMPLETE_BYTES:]
    return len(tail) - codecs.utf_8_decode(tail, "replace", False)[1]


def _gpt2_char_bytes() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the vocabulary character spelling each byte in
    byte-level BPE (printable bytes spell themselves; the rest map to U+0100 onwards)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return table


_CHAR_BYTES = _gpt2_char_bytes()


class TokenBytes:
    """The bytes each token adds to a decode (``skip_special_tokens=True``), built per
    token on first sight and cached: a byte-level vocabulary spells each byte as one
    character (a token with a character outside that table is its own UTF-8, as HF's
    ByteLevel decoder does); a byte-fallback vocabulary spells lone bytes ``<0xE2>``;
    otherwise a token is text.  Special tokens add nothing: the decode skips them."""

    def __init__(self, hf: Any, byte_level: bool, byte_fallback: bool, special: frozenset[int],
                 skip_special: bool = True):  # fmt: skip
        self.hf = hf
        self.byte_level = byte_level
        self.byte_fallback = byte_fallback
        self.special = special if skip_special else frozenset()  # the tokens a decode skips
        self._names = {} if skip_special else special_names(hf, special)  # kept: their text
        self._cache: dict[int, bytes] = {}
        # Whether a decode is exactly these bytes joined (then UTF-8 with replacement): a
        # byte-level decoder alone, no clean-up of spaces, and special tokens skipped.
        self.joined = False

    def __call__(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._bytes_of(token_id)
        return b

    def _bytes_of(self, token_id: int) -> bytes:
        if token_id in self.special:
            return b""
        if token_id in self._names:
            return self._names[token_id].encode()
        piece = self.hf.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):  # an id outside the vocabulary: the decode drops it
            return b""
        if self.byte_level and all(c in _CHAR_BYTES for c in piece):
            return bytes(_CHAR_BYTES[c] for c in piece)
        if self.byte_fallback and _BYTE_PIECE.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        return piece.encode()

    def keep(self, ids: list[int]) -> list[int]:
        """``ids`` less special tokens: the decode skips them before its decoder runs, so
        dropping them changes no text, and a run of them cannot grow the window."""
        return [i for i in ids if i not in self.special] if self.special else ids

    def complete_end(self, ids: list[int], read: int) -> int:
        """The largest end j (read <= j <= len(ids)) such that the bytes of ids[read:j]
        do not end inside a character; ``read`` is at a character boundary.

        The cut falls at the token holding the first unfinished byte.  When that token
        also ends an earlier character (a token straddling two characters), the bytes
        before it may be unfinished too, so look again.  A run of straddling tokens is
        held for at most MAX_HELD_TOKENS tokens, then cut anyway (its text may then
        differ from a one-shot decode) so that the cost stays bounded."""
        j = len(ids)
        for _ in range(MAX_HELD_TOKENS):
            k, tail = j, b""
            while k > read and len(tail) < MAX_INCOMPLETE_BYTES:
                k -= 1
                tail = self(ids[k]) + tail
            missing = incomplete_tail(tail)
            if missing == 0:
                return j
            while missing > 0 and j > read:
                j -= 1
                missing -= len(self(ids[j]))
            if j <= read:
                return read
            if missing == 0:  # the cut is exactly where the unfinished character starts
                return j
        return j


_TABLES: "dict[bool, weakref.WeakKeyDictionary[Any, TokenBytes | None]]" = {
    True: weakref.WeakKeyDictionary(), False: weakref.WeakKeyDictionary()}  # fmt: skip


def token_bytes(tokenizer: Any, skip_special_tokens: bool = True) -> TokenBytes | None:
    """The byte table of ``tokenizer`` (shared by all its streams) for decodes that skip
    special tokens or keep them, or None when its token bytes cannot be known (no HF fast
    tokenizer underneath)."""
    tables = _TABLES[skip_special_tokens]
    try:
        return tables[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referable: a table of its own
        return _build_table(tokenizer, skip_special_tokens)
    table = tables[tokenizer] = _build_table(tokenizer, skip_special_tokens)
    return table


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The special tokens of ``tokenizer`` (those a decode with skip_special_tokens drops)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    added = getattr(hf, "added_tokens_decoder", None) or {}
    return frozenset(i for i, t in added.items() if getattr(t, "special", False))


def special_names(hf: Any, ids: frozenset[int]) -> dict[int, str]:
    """The text each special token decodes to when it is kept."""
    added = getattr(hf, "added_tokens_decoder", None) or {}
    return {i: str(getattr(added[i], "content", "")) for i in ids if i in added}


def _build_table(tokenizer: Any, skip_special_tokens: bool = True) -> TokenBytes | None:
    hf = getattr(tokenizer, "hf", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or not hasattr(hf, "convert_ids_to_tokens"):
        return None
    try:
        kinds = _decoder_types(backend.decoder)
        special = special_token_ids(hf)
    except (AttributeError, TypeError, ValueError):  # an unusual tokenizer: decide from the text
        return None
    table = TokenBytes(hf, "ByteLevel" in kinds, "ByteFallback" in kinds, special, skip_special_tokens)
    table.joined = kinds == {"ByteLevel"} and skip_special_tokens and not getattr(hf, "clean_up_tokenization_spaces", False)
    return table


def _decoder_types(decoder: Any) -> set[str]:
    """Every decoder type in the HF decoder (a Sequence nests others)."""
    if decoder is None:
        return set()
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(decoder.__getstate__()))
    return found
