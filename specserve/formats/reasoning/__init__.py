"""Reasoning formats: how a model sets its reasoning apart from its answer, one module per
format (``base.py`` says what a format implements).

Built in: ``deepseek_r1`` (``<think>...</think>``, the answer starting inside it),
``qwen3`` (an optional ``<think>`` block, opened or closed by the template in the prompt)
and ``granite`` (``Here is my thought process:`` / ``Here is my response:``).  The
server's format is ``model.reasoning_format`` (a name here, or a user's class as
``"package.module:Class"`` subclassing ``base.ReasoningFormat``), else the first format
whose ``detect`` recognises the chat template, else none.  Adding one: a module with a
``ReasoningFormat`` subclass and one ``REASONING_FORMATS.register`` line below (or name it
as ``module:Class`` in the config).
"""

from __future__ import annotations

from specserve.formats.registry import FormatRegistry

REASONING_FORMATS = FormatRegistry("reasoning format", "model.reasoning_format",
                                   "specserve.formats.reasoning.base:ReasoningFormat")  # fmt: skip
REASONING_FORMATS.register("deepseek_r1", "specserve.formats.reasoning.deepseek_r1:DeepSeekR1Format",
                           aliases=("deepseek-r1",))  # fmt: skip
REASONING_FORMATS.register("qwen3", "specserve.formats.reasoning.qwen3:Qwen3Format")
REASONING_FORMATS.register("granite", "specserve.formats.reasoning.granite:GraniteFormat")

__all__ = ["REASONING_FORMATS"]
