"""A thin wrapper over the HF tokenizer: the only text interface the engine
and servers use."""

from __future__ import annotations

from typing import Any

from specserve.errors import InvalidRequestError

CHAT_ROLES = ("system", "user", "assistant", "tool")


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, eos_token_ids: tuple[int, ...]):
        self.hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self._max_token_chars: int | None = None

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token covers: the longest vocabulary
        entry.  (Byte-level vocabularies spell each byte as one character, so this
        bounds bytes too.)  A text of n characters is at least n / this many tokens,
        which lets a server refuse a prompt that is too long before tokenizing it."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self.hf.get_vocab()), default=1) or 1
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages", "must be a non-empty list of {role, content}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InvalidRequestError(f"messages[{i}]", "must be an object with role and content")
            role, content = m.get("role"), m.get("content")
            if role not in CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
            if not isinstance(content, str):
                raise InvalidRequestError(f"messages[{i}].content", "must be a string")
        if not getattr(self.hf, "chat_template", None):
            raise InvalidRequestError("messages", "this model has no chat template; send a prompt instead")
        text = self.hf.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in messages], tokenize=False, add_generation_prompt=True
        )
        # The template already holds any BOS it wants.
        return list(self.hf(text, add_special_tokens=False)["input_ids"])
