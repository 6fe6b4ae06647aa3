"""A registry of formats by name, each a class named as ``"module:Class"`` and imported on first use.

Tool-call formats (``specserve.formats.tools``) and reasoning formats
(``specserve.formats.reasoning``) each keep one.  A config value is a registered name
(or an alias), or a user's own class as ``"package.module:Class"``, importable from the
server's environment; either way :meth:`FormatRegistry.get` returns an instance, and a
name that is neither is a ``ConfigError`` naming the config key and the known names.
"""

from __future__ import annotations

import importlib
from typing import Any

from specserve.errors import ConfigError

__all__ = ["FormatRegistry"]


class FormatRegistry:
    def __init__(self, kind: str, key: str, base: str):
        self.kind = kind  # "tool-call format", for messages
        self.key = key  # the config key that names one
        self.base = base  # "module:Class" every format subclasses
        self._targets: dict[str, str] = {}
        self._aliases: dict[str, str] = {}
        self._instances: dict[str, Any] = {}

    def register(self, name: str, target: str, aliases: tuple[str, ...] = ()) -> None:
        """Add the format ``name`` implemented by ``target`` ("module:Class")."""
        self._targets[name] = target
        for alias in aliases:
            self._aliases[alias] = name

    def names(self) -> list[str]:
        return list(self._targets)

    def canonical(self, name: str) -> str:
        return self._aliases.get(name, name)

    def get(self, name: str) -> Any:
        """An instance of the format ``name`` (registered name, alias or "module:Class")."""
        name = self.canonical(name)
        inst = self._instances.get(name)
        if inst is not None:
            return inst
        target = self._targets.get(name)
        if target is None:
            if ":" not in name:
                known = ", ".join(self.names() + sorted(self._aliases))
                raise ConfigError(self.key, f"unknown {self.kind} {name!r}; known: {known}, or your own as "
                                            f"'package.module:Class'")
            target = name
        cls = _load(self.key, target)
        base = _load(self.key, self.base)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(self.key, f"{target} is not a subclass of {self.base.replace(':', '.')}")
        try:
            inst = cls()
        except Exception as e:
            raise ConfigError(self.key, f"{target}() failed: {type(e).__name__}: {e}") from None
        self._instances[name] = inst
        return inst

    def detect(self, chat_template: str | None) -> str | None:
        """The first registered format whose ``detect`` accepts the chat template."""
        if not chat_template:
            return None
        for name in self._targets:
            if self.get(name).detect(chat_template):
                return name
        return None


def _load(key: str, target: str) -> Any:
    module, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(key, f"cannot load {target!r}: {type(e).__name__}: {e}") from None
    return obj
