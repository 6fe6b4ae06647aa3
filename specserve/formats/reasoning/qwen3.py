"""Qwen3 reasoning: an optional ``<think>...</think>`` block at the start of the answer.

Qwen3's hybrid template leaves it to the model (``enable_thinking: false`` in
``chat_template_kwargs`` makes the template write an empty ``<think>\\n\\n</think>\\n\\n``
into the prompt: the answer then starts after the reasoning); Qwen3-Thinking-2507's template
opens ``<think>\\n`` in the prompt, so the answer starts inside it.  Both are read from the
prompt (``ReasoningFormat.initial_state``)."""

from __future__ import annotations

from typing import ClassVar

from specserve.formats.reasoning.base import ReasoningFormat


class Qwen3Format(ReasoningFormat):
    name: ClassVar[str] = "qwen3"

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return "<think>" in chat_template
