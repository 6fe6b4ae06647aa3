"""Sampling defaults from a model's ``generation_config.json`` (vLLM's ``--generation-config``).

Pure Python (json).  ``model.generation_config``:

* ``auto`` (the default, as in vLLM): the model directory's ``generation_config.json``;
* ``vllm`` or ``none``: no defaults from the model (the built-in ones: temperature 1, ...);
* a directory: its ``generation_config.json``.

Of the file, the keys vLLM reads are kept: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (the default ``max_tokens``).  They apply to a
request that leaves the field out (HTTP, gRPC, and ``LLM.generate`` without
``SamplingParams``); a field the request sends always wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specserve.errors import ConfigError

SAMPLING_KEYS = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "max_new_tokens": int,
}
BUILT_IN = ("vllm", "none")


def read_defaults(setting: str, model_dir: Path | str | None, key: str = "model.generation_config") -> dict[str, Any]:
    """The sampling defaults ``setting`` selects for a model loaded from ``model_dir``:
    ``{"temperature": 0.6, "top_p": 0.95, ...}`` (SamplingParams' names; ``max_tokens``
    for ``max_new_tokens``), empty when there are none."""
    if setting in BUILT_IN:
        return {}
    if setting == "auto":
        if model_dir is None:
            return {}
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return {}
    else:
        path = Path(setting).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ConfigError(key, f"{setting!r} is not auto, vllm or a directory holding a generation_config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(key, f"cannot read {path}: {e}") from None
    out: dict[str, Any] = {}
    if not isinstance(raw, dict):
        return out
    for name, kind in SAMPLING_KEYS.items():
        value = raw.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out["max_tokens" if name == "max_new_tokens" else name] = kind(value)
    return out


def describe(defaults: dict[str, Any]) -> str:
    """``temperature=0.6, top_p=0.95`` for the start-up log; "" when empty."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in defaults.items())
