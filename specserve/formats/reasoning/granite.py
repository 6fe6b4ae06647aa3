"""IBM Granite 3.2+ reasoning (``chat_template_kwargs: {"thinking": true}``): the answer
begins ``Here is my thought process:`` and the reply follows ``Here is my response:``
(``Here's`` is read too).  Optional: an answer that does not begin with the first marker
is all content."""

from __future__ import annotations

from typing import ClassVar

from specserve.formats.reasoning.base import ReasoningFormat


class GraniteFormat(ReasoningFormat):
    name: ClassVar[str] = "granite"
    start: ClassVar[tuple[str, ...]] = ("Here is my thought process:", "Here's my thought process:")
    end: ClassVar[tuple[str, ...]] = ("Here is my response:", "Here's my response:")

    @classmethod
    def detect(cls, chat_template: str) -> bool:
        return "Here is my thought process:" in chat_template
