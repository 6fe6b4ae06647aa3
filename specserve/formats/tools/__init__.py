"""Tool-call formats: how a model writes tool calls, one module per format (``base.py`` says
what a format implements).

Built in: ``hermes`` (Hermes, Qwen2.5, Qwen3: ``<tool_call>{json}</tool_call>``; alias
``qwen``), ``llama3_json`` (Llama 3.1-3.3; alias ``llama3``), ``qwen3_coder`` (Qwen3-Coder
XML; alias ``qwen3_xml``) and ``pythonic`` (``[f(a=1)]``; alias ``llama4_pythonic``).  The
server's format is ``model.tool_call_format`` (a name here, or a user's class as
``"package.module:Class"`` subclassing ``base.ToolCallFormat``), else the first format
whose ``detect`` recognises the chat template, else none.  Adding one: a module with a
``ToolCallFormat`` subclass, and one ``TOOL_FORMATS.register`` line below (or no edit at
all: name it as ``module:Class`` in the config).
"""

from __future__ import annotations

from specserve.formats.registry import FormatRegistry

TOOL_FORMATS = FormatRegistry("tool-call format", "model.tool_call_format",
                              "specserve.formats.tools.base:ToolCallFormat")  # fmt: skip
TOOL_FORMATS.register("hermes", "specserve.formats.tools.hermes:HermesFormat", aliases=("qwen", "qwen2_5", "qwen3"))
TOOL_FORMATS.register("qwen3_coder", "specserve.formats.tools.qwen3_coder:Qwen3CoderFormat", aliases=("qwen3_xml",))
TOOL_FORMATS.register("llama3_json", "specserve.formats.tools.llama3_json:Llama3JsonFormat",
                      aliases=("llama3", "llama3.1"))  # fmt: skip
TOOL_FORMATS.register("pythonic", "specserve.formats.tools.pythonic:PythonicFormat", aliases=("llama4_pythonic",))

__all__ = ["TOOL_FORMATS"]
