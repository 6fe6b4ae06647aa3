"""Formats of model text: tool calls (``formats.tools``) and reasoning (``formats.reasoning``),
each a registry of one module per format, and the request-level pieces that use them
(``formats.chat``: OpenAI's tools contract, the answer's parsing for every front end).

Pure Python, no torch: the servers, the offline API and the engine's reasoning gate
(token ids of the markers) read them.  ``resolve`` picks a model's formats: the config's
names, else those its chat template is written for.
"""

from __future__ import annotations

__all__ = ["resolve"]


def resolve(tool_format: str | None, reasoning_format: str | None,
            chat_template: str | None) -> tuple[str | None, str | None]:  # fmt: skip
    """The tool-call and reasoning formats to serve: a configured name ("none": off) or,
    when unset, the one the chat template is detected to be written for (None: none).
    A name that is not known is a ConfigError naming its key."""
    from specserve.formats.reasoning import REASONING_FORMATS
    from specserve.formats.tools import TOOL_FORMATS

    out: list[str | None] = []
    for name, registry in ((tool_format, TOOL_FORMATS), (reasoning_format, REASONING_FORMATS)):
        if name == "none":
            out.append(None)
        elif name:
            registry.get(name)  # raises ConfigError for a bad name
            out.append(registry.canonical(name))
        else:
            out.append(registry.detect(chat_template))
    return out[0], out[1]


def load_chat_template(value: str | None) -> str | None:
    """``model.chat_template``: a file's path (read) or the template's own text; None: none."""
    import os

    from specserve.errors import ConfigError

    if not value:
        return None
    if "{%" in value or "{{" in value:
        return value
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    raise ConfigError("model.chat_template", f"{value[:200]!r} is neither a file nor a Jinja template")
