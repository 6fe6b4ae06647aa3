"""A thin wrapper over the HF tokenizer: the only text interface the engine
and servers use.

Chat templates: only the template's own markup may produce special tokens.
Message contents are encoded as plain text, so a user who writes
``<|im_start|>system`` in a message gets those characters, not a control token
that opens a turn of its own.  The contents are located in the rendered text by
rendering the template once more with markers in their place; a template that
rewrites contents beyond trimming them hides where they are, and then a content
that spells a control token is refused (``messages[i].content``).

Roles: system, developer, user, assistant, tool.  ``developer`` is OpenAI's newer
name for system: a template that never mentions it renders it as ``system``.
"""

from __future__ import annotations

import bisect
import re
import uuid
from typing import Any

from specserve.errors import InvalidRequestError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's newer name for the system role: a template that does not know it gets "system".
DEVELOPER_ROLE, DEVELOPER_FALLBACK = "developer", "system"


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, eos_token_ids: tuple[int, ...]):
        self.hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self._max_token_chars: int | None = None
        self._special_ids: frozenset[int] | None = None

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token covers: the longest vocabulary
        entry.  (Byte-level vocabularies spell each byte as one character, so this
        bounds bytes too.)  A text of n characters is at least n / this many tokens,
        which lets a server refuse a prompt that is too long before tokenizing it."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self.hf.get_vocab()), default=1) or 1
        return self._max_token_chars

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special (control) tokens: those parsed out of raw text by name."""
        if self._special_ids is None:
            added = getattr(self.hf, "added_tokens_decoder", None) or {}
            ids = {i for i, t in added.items() if getattr(t, "special", False)}
            self._special_ids = frozenset(ids | set(getattr(self.hf, "all_special_ids", ()) or ()))
        return self._special_ids

    @property
    def special_texts(self) -> list[str]:
        """The names of the special tokens (the text that the tokenizer turns into them)."""
        return [t for t in self.hf.convert_ids_to_tokens(sorted(self.special_ids)) if t]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_plain(self, text: str) -> list[int]:
        """``text`` as plain text: a special token's name gives its characters' tokens."""
        return list(self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """The number of token ids the tokenizer knows (added tokens included)."""
        return len(self.hf)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token as the vocabulary spells it (vLLM's ``token_strs``)."""
        return [t if t is not None else "" for t in self.hf.convert_ids_to_tokens(list(ids))]

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """``ids`` with the special tokens the tokenizer adds around a text (e.g. BOS) added,
        as ``encode(text, add_special_tokens=True)`` adds them."""
        bare = self.encode("a", add_special_tokens=False)
        full = self.encode("a", add_special_tokens=True)
        for k in range(len(full) - len(bare) + 1):
            if full[k:k + len(bare)] == bare:
                return full[:k] + list(ids) + full[k + len(bare):]
        return list(ids)

    def _template_roles(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` with the developer role renamed to system for a template that lacks it."""
        if DEVELOPER_ROLE in str(getattr(self.hf, "chat_template", None) or ""):
            return messages
        return [{**m, "role": DEVELOPER_FALLBACK} if m["role"] == DEVELOPER_ROLE else m for m in messages]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages", "must be a non-empty list of {role, content}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InvalidRequestError(f"messages[{i}]", "must be an object with role and content")
            role, content = m.get("role"), m.get("content")
            if role not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}; got {role!r:.80}"
                )
            if not isinstance(content, str):
                raise InvalidRequestError(f"messages[{i}].content", "must be a string")
        if not getattr(self.hf, "chat_template", None):
            raise InvalidRequestError("messages", "this model has no chat template; send a prompt instead")
        messages = self._template_roles(messages)
        contents = [m["content"] for m in messages]
        text = self._render(messages, contents, add_generation_prompt)
        spans = _content_spans(text, self._render_marked(messages, add_generation_prompt), contents)
        if spans is not None:
            return self._encode_rendered(text, spans)
        # The template rewrites contents (beyond trimming), so where they lie is unknown:
        # keep its exact output, but refuse contents that spell a control token.
        for i, c in enumerate(contents):
            for name in self.special_texts:
                if name in c:
                    raise InvalidRequestError(
                        f"messages[{i}].content",
                        f"contains the control token {name!r}, which this model's chat template cannot keep as text",
                    )
        return self.encode(text, add_special_tokens=False)  # the template holds any BOS it wants

    def _render(self, messages: list[dict[str, str]], contents: list[str], add_generation_prompt: bool = True) -> str:
        convo = [{"role": m["role"], "content": c} for m, c in zip(messages, contents)]
        return self.hf.apply_chat_template(convo, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _render_marked(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[str] | None:
        """The template rendered with a marker in place of each content, split at the
        markers: [markup, message index, markup, ..., markup]; None if the template
        altered a marker (digits and private-use characters: case changes and trimming
        leave them alone)."""
        while True:  # markers that no content contains
            nonce = f"{uuid.uuid4().int % 10**12:012d}"
            if not any(nonce in m["content"] for m in messages):
                break
        marked = self._render(messages, [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))],
                              add_generation_prompt)  # fmt: skip
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", marked)
        return None if any(nonce in p for p in pieces[::2]) else pieces

    def _encode_rendered(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """Tokenize the rendered ``text`` as a whole (the template holds any BOS it wants),
        unless a special token comes out of a content span: then only the markup's special
        tokens are kept and the text between them is encoded as plain text."""
        try:
            enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # a slow tokenizer has no offsets: markup and contents apart
            return self._encode_pieces(text, spans)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        special = self.special_ids
        starts = [s for s, _ in spans]

        def in_content(a: int, b: int) -> bool:
            j = bisect.bisect_right(starts, b - 1) - 1  # the last span starting before b
            return j >= 0 and a < spans[j][1] and b > spans[j][0]

        if not any(t in special and in_content(a, b) for t, (a, b) in zip(ids, offsets)):
            return ids
        out: list[int] = []
        pos = 0
        for t, (a, b) in zip(ids, offsets):
            if t in special and not in_content(a, b):
                out += self.encode_plain(text[pos:a]) if a > pos else []
                out.append(t)
                pos = b
        return out + (self.encode_plain(text[pos:]) if pos < len(text) else [])

    def _encode_pieces(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        out: list[int] = []
        pos = 0
        for s, e in spans:
            out += self.encode(text[pos:s], add_special_tokens=False) + self.encode_plain(text[s:e])
            pos = e
        return out + self.encode(text[pos:], add_special_tokens=False)


def _content_spans(text: str, pieces: list[str] | None, contents: list[str]) -> list[tuple[int, int]] | None:
    """Where the contents lie in the rendered ``text``, given the marked rendering's pieces.
    A template may trim a content; any other rewrite of one gives None."""
    if pieces is None or not text.startswith(pieces[0]):
        return None
    spans, pos = [], len(pieces[0])
    for k in range(1, len(pieces), 2):
        content, after = contents[int(pieces[k])], pieces[k + 1]
        found = next((c for c in (content, content.strip()) if text.startswith(c + after, pos)), None)
        if found is None:
            return None
        spans.append((pos, pos + len(found)))
        pos += len(found) + len(after)
    return spans if pos == len(text) else None


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's tokenizations of ``bad_words``: each word (leading spaces dropped) as it would
    start the text, and after a space when that gives a different first token and the same
    number of tokens (a word of its own then)."""
    out: list[list[int]] = []
    for word in words:
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            continue
        out.append(bare)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out
