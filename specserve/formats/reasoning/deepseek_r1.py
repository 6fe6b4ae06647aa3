"""DeepSeek-R1 reasoning: ``<think>...</think>`` then the answer.  The answer starts inside
the reasoning whether or not the model writes ``<think>`` (R1-0528's template opens it in
the prompt; earlier checkpoints sometimes leave it out): everything before ``</think>`` is
reasoning, and an answer without ``</think>`` is all reasoning."""

from __future__ import annotations

from typing import ClassVar

from specserve.formats.reasoning.base import OPEN, ReasoningFormat


class DeepSeekR1Format(ReasoningFormat):
    name: ClassVar[str] = "deepseek_r1"
    default_state: ClassVar[str] = OPEN

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return "<think>" in chat_template and "｜Assistant｜" in chat_template
