"""vLLM-shaped front doors onto specserve's Hydra config.  Pure Python, no torch.

People arrive with vLLM code: ``LLM(model, speculative_config={...})``,
``vllm serve MODEL --speculative-config JSON`` and ``SamplingParams(...)``
keywords, and some that vLLM never had or no longer reads (``speculative_sampling=True``,
``speculative_model=``, ``speculative_ratio=``).  This module turns the real
ones into the Hydra overrides the ``specserve`` command line takes, so they
compose and validate through exactly the same path (``specserve.compose
.compose_config``) and fail with the same one-line errors; the made-up and
removed ones fail with one line saying what to write instead.

* ``engine_overrides(...)``: ``LLM(...)`` keywords / ``specserve serve`` flags -> overrides
* ``speculative_overrides(dict)``: vLLM's ``speculative_config`` -> ``+method=..``, ``method.*``
* ``SamplingParams(...)``: vLLM's ``SamplingParams`` keywords -> ``specserve.request.SamplingParams``
  (the translation is ``sampling_params_kwargs``; ``from specserve import SamplingParams`` is this one)
* ``compose(overrides)``: the CLI's compose + validate, errors raised as ``ConfigError``
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

from specserve import request
from specserve.config import EngineConfig
from specserve.errors import ConfigError, SpecServeError

SPEC_CONFIG_EXAMPLE = '{"method": "draft_model", "model": <draft>, "num_speculative_tokens": N}'
SPEC_CONFIG_JSON_EXAMPLE = '\'{"method": "draft_model", "model": "<draft>", "num_speculative_tokens": N}\''


class UnsupportedArgumentError(SpecServeError, TypeError):
    """A keyword (or flag) that specserve does not take; the message says what to use instead."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(message)


# --------------------------------------------------------------------------- Hydra values


_PLAIN = re.compile(r"[A-Za-z0-9_/][A-Za-z0-9_./:+-]*")
_HYDRA_WORDS = {"null", "true", "false", "nan", "inf", "-inf", "+inf"}


def hydra_value(value: Any) -> str:
    """One value in Hydra's override grammar (strings quoted where needed, ${ kept literal)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"cannot express {type(value).__name__} {value!r} as a Hydra override value")
    if _PLAIN.fullmatch(value) and value.lower() not in _HYDRA_WORDS and not _numeric(value):
        return value
    # Quoted: backslashes before a quote or at the end are doubled, quotes escaped,
    # and "${" escaped so OmegaConf does not read it as an interpolation.
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
    return "'" + text.replace("'", "\\'").replace("${", "\\${") + "'"


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def override(key: str, value: Any) -> str:
    try:
        return f"{key}={hydra_value(value)}"
    except TypeError as e:
        raise ConfigError(key, str(e)) from None


# --------------------------------------------------------------------------- models


def _presets(group: str) -> set[str]:
    from specserve.compose import conf_dir

    return {p.stem for p in (conf_dir() / group).glob("*.yaml")}


def _embedded_name(model: str) -> str | None:
    """``embedded:<name>`` or a bare embedded model name -> <name>; else None."""
    if model.startswith("embedded:"):
        return model.split(":", 1)[1]
    if "/" in model or os.sep in model or model.endswith(".gguf") or os.path.exists(model):
        return None
    from specserve.executor.loader import EMBEDDED  # imports torch: only for bare names

    return model if model in EMBEDDED else None


def model_overrides(model: Any, served_model_name: Any = None) -> list[str]:
    """The target model: a ``model`` preset name, ``embedded:<name>`` (or the bare
    name), a ``.gguf`` file or a local HF directory.

    Served names: ``served_model_name`` (one name or several, as vLLM's
    ``--served-model-name``) sets ``model.name`` to the first and
    ``server.served_model_aliases`` to the rest; without it the model's own name
    (``model.name``: a path as given, an embedded model's bare name, a preset's
    name) is served.  The string given always answers too: a path through
    ``model.path`` (added at validation), a preset's name as an alias."""
    out: list[str] = []
    aliases: list[str] = []
    if model is not None:
        m = os.fspath(model) if isinstance(model, os.PathLike) else model
        if not isinstance(m, str) or not m:
            raise ConfigError(
                "model.path", f"must name a local model directory, a .gguf file or embedded:<name>; got {model!r}"
            )
        if m in _presets("model"):
            out.append(f"model={m}")
            aliases.append(m)
        elif (name := _embedded_name(m)) is not None:
            out += [override("model.path", f"embedded:{name}"), override("model.name", name)]
        else:  # a path, or a Hugging Face id (served as org/name; org/name@revision answers too)
            from specserve.hub import parse_id

            hub = parse_id(m)
            out += [override("model.path", m), override("model.name", hub[0] if hub else m)]
    if served_model_name is not None:
        names = list(served_model_name) if isinstance(served_model_name, (list, tuple)) else [served_model_name]
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigError("model.name", f"served_model_name must be a name or a list of names; got {served_model_name!r}")
        out.append(override("model.name", names[0]))
        aliases = names[1:] + [a for a in aliases if a not in names]
    if aliases:
        out.append(f"server.served_model_aliases=[{','.join(hydra_value(a) for a in aliases)}]")
    return out


# --------------------------------------------------------------------------- speculative_config

def speculative_overrides(spec: Any) -> list[str]:
    """vLLM's ``speculative_config`` (a dict, or its JSON text) -> Hydra overrides.

    ``method`` selects the preset (``+method=<method>``; omitted with a ``model``
    means ``draft_model``, as vLLM infers); ``model`` is the draft (a ``draft``
    preset name, ``embedded:<name>``, a .gguf file or an HF directory); every other
    key becomes ``method.<key>=<value>`` and is checked by the same rules as on the
    command line (unknown keys and sampling keys fail naming ``method.<key>``).
    """
    if spec is None:
        return []
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise ConfigError("speculative_config", f"is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ConfigError("speculative_config", f"must be a dict (a JSON object), got {type(spec).__name__}")
    if not spec:
        return []
    spec = dict(spec)
    method = spec.pop("method", None)
    model = spec.pop("model", None)
    if method is None:
        if model is None:
            raise ConfigError("method.method", "is required in speculative_config; one of "
                              + ", ".join(sorted(_presets("method"))))
        method = "draft_model"
    if not isinstance(method, str) or not method:
        raise ConfigError("method.method", f"must be a method name, got {method!r}")
    out = [f"+method={hydra_value(method)}"]
    if model is not None:
        m = os.fspath(model) if isinstance(model, os.PathLike) else model
        if not isinstance(m, str) or not m:
            raise ConfigError("method.model", f"must name the draft model, got {model!r}")
        if m in _presets("draft"):
            out.append(f"draft={m}")
        elif (name := _embedded_name(m)) is not None:
            out.append(override("method.model", f"embedded:{name}"))
        else:
            out.append(override("method.model", m))
    out += _nested_overrides("method", spec)
    return out


def _nested_overrides(prefix: str, values: dict) -> list[str]:
    """``{key: value}`` under ``prefix`` as Hydra overrides; an object value (vLLM's nested
    ``"tree": {...}``) becomes its dotted keys, as the command line writes them."""
    out = []
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise ConfigError("speculative_config", f"keys must be non-empty strings, got {key!r}")
        if isinstance(value, dict) and value:
            out += _nested_overrides(f"{prefix}.{key}", value)
        else:
            out.append(override(f"{prefix}.{key}", value))
    return out


# --------------------------------------------------------------------------- engine keywords

ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "seed")

# vLLM engine arguments that mean nothing here: accepted (so vLLM command lines and
# scripts run) with a note saying so.  Value check -> None when fine, else the problem.
IGNORED_ENGINE_ARGS: dict[str, str] = {
    "trust_remote_code": "specserve runs its own Llama-family code, never a checkpoint's",
    "disable_log_stats": "statistics go to /metrics",
    "disable_log_requests": "requests are not logged",
}

# vLLM knobs it no longer reads (and ones it never had): the speculative_config key to use instead.
REMOVED_SPEC_KNOBS: dict[str, str | None] = {
    "speculative_model": "model",
    "num_speculative_tokens": "num_speculative_tokens",
    "speculative_draft_tensor_parallel_size": "draft_tensor_parallel_size",
    "speculative_max_model_len": "max_model_len",
    "ngram_prompt_lookup_max": "prompt_lookup_max",
    "ngram_prompt_lookup_min": "prompt_lookup_min",
    "speculative_disable_by_batch_size": None,
    "spec_decoding_acceptance_method": "rejection_sample_method",
    "speculative_sampling": None,  # made up (seed 002): speculation is on when speculative_config is set
    "speculative_ratio": "num_speculative_tokens",  # made up (seed 002)
}


_KNOB_ROLES = {
    "model": 'the draft model is "model"',
    "num_speculative_tokens": 'the tokens drafted per step are "num_speculative_tokens"',
    "draft_tensor_parallel_size": 'the draft\'s TP size is "draft_tensor_parallel_size"',
    "max_model_len": 'the draft\'s length limit is "max_model_len"',
    "prompt_lookup_max": 'the n-gram window is "prompt_lookup_min"/"prompt_lookup_max"',
    "prompt_lookup_min": 'the n-gram window is "prompt_lookup_min"/"prompt_lookup_max"',
    "rejection_sample_method": 'verification is "rejection_sample_method"',
}


def _knob_role(key: str, container: str) -> str:
    target = REMOVED_SPEC_KNOBS.get(key)
    if target is None:
        return f"speculative decoding is on when {container} is given"
    return f"{_KNOB_ROLES[target]} in {container}"


def removed_knob_message(key: str, where: str) -> str:
    """The one line for a removed or made-up speculative knob.

    ``where``: "LLM" (a keyword of LLM()), "SamplingParams", or "serve" (a flag)."""
    made_up = key in ("speculative_sampling", "speculative_ratio")
    if where == "serve":
        flag = "--" + key.replace("_", "-")
        origin = "does not exist (nor in vLLM)" if made_up else "was removed from vLLM and is not an option here"
        role = _knob_role(key, "--speculative-config")
        return f"{flag} {origin} ({role}): use --speculative-config {SPEC_CONFIG_JSON_EXAMPLE}"
    fix = f"LLM(model=..., speculative_config={SPEC_CONFIG_EXAMPLE})"
    if where == "SamplingParams":
        role = _knob_role(key, "speculative_config").replace("speculative decoding is", "it is")
        return (f"SamplingParams({key}=...) does not exist (nor in vLLM): speculative decoding is set on the engine "
                f"(a request may only lower its drafts: speculation={{'num_speculative_tokens': k}}); {role}: {fix}")
    origin = "nor in vLLM" if made_up else "vLLM removed it"
    return f"{where}({key}=...) is not an option ({origin}): {_knob_role(key, 'speculative_config')}: {fix}"


def engine_overrides(
    model: Any = None,
    speculative_config: Any = None,
    tensor_parallel_size: int | None = 1,
    dtype: Any = "auto",
    max_model_len: int | None = None,
    seed: int | None = 0,
    served_model_name: Any = None,
    where: str = "LLM",
    **options: Any,
) -> tuple[list[str], list[str]]:
    """vLLM engine arguments -> (Hydra overrides, notes for arguments accepted but ignored).

    ``options``: any ``engine.*`` key (``max_num_seqs``, ``block_size``,
    ``num_kv_blocks``, ``kv_cache_memory_gib``, ``device``, ...), vLLM's
    ``kv_cache_memory_bytes``, and the no-op vLLM arguments in ``IGNORED_ENGINE_ARGS``.
    Arguments left at their default add no override.
    """
    out = model_overrides(model, served_model_name)
    out += speculative_overrides(speculative_config)
    if tensor_parallel_size is not None and tensor_parallel_size != 1:
        out.append(override("parallelism.tensor_parallel_size", tensor_parallel_size))
    if dtype is not None and dtype != "auto":
        d = str(dtype).removeprefix("torch.")
        out.append(override("model.dtype", {"half": "float16", "float": "float32", "bf16": "bfloat16"}.get(d, d)))
    if max_model_len is not None:
        out.append(override("model.max_model_len", max_model_len))
    if seed is not None and seed != 0:
        out.append(override("engine.seed", seed))
    notes: list[str] = []
    for key, value in options.items():
        if key in ENGINE_KEYS:
            out.append(override(f"engine.{key}", value))
        elif key == "kv_cache_memory_bytes":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError("kv_cache_memory_bytes", f"must be a positive number of bytes, got {value!r}")
            out.append(override("engine.kv_cache_memory_gib", value / (1 << 30)))
        elif key == "enforce_eager":  # vLLM's switch for CUDA graphs
            if not isinstance(value, bool):
                raise ConfigError(key, f"must be a boolean, got {value!r}")
            if value:
                out.append(override("engine.cuda_graphs", "off"))
        elif key in IGNORED_ENGINE_ARGS:
            name = f"--{key.replace('_', '-')}" if where == "serve" else f"{key}={value!r}"
            notes.append(f"{name} is accepted for vLLM compatibility and has no effect: {IGNORED_ENGINE_ARGS[key]}")
        elif key in REMOVED_SPEC_KNOBS:
            raise UnsupportedArgumentError(key, removed_knob_message(key, where))
        else:
            raise UnsupportedArgumentError(
                key,
                f"{where}() got an unknown argument {key!r}; engine options: {', '.join(ENGINE_KEYS)} "
                "(any other setting: hydra_overrides=['group.key=value'])",
            )
    return out, notes


def _number(key: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, f"must be a number, got {value!r}")
    return float(value)


def compose(overrides: list[str], config_dir: Any = None):
    """Compose and validate exactly as the ``specserve`` command line does.

    Errors are ``ConfigError`` with the CLI's one line (``<key>: <what is allowed>``)."""
    from specserve.compose import UsageError, compose_config

    argv = (["--config-dir", os.fspath(config_dir)] if config_dir is not None else []) + list(overrides)
    try:
        cfg = compose_config(argv)
    except UsageError as e:
        key, sep, message = str(e).partition(": ")
        raise (ConfigError(key, message) if sep else ConfigError("config", str(e))) from None
    assert cfg is not None
    return cfg


# --------------------------------------------------------------------------- SamplingParams keywords

# vLLM SamplingParams keywords this build does not implement: accepted only at the
# value that changes nothing, else one line saying so.
_UNIMPLEMENTED_SAMPLING: dict[str, tuple[tuple[Any, ...], str]] = {
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "detokenize": ((True,), "text is always produced"),
    "guided_decoding": ((None,), "removed from vLLM: use structured_outputs=StructuredOutputsParams(...)"),
    "use_beam_search": ((False,), "beam search is not implemented"),
}


def sampling_params_kwargs(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM-style ``SamplingParams`` keywords -> the dataclass's own.

    ``stop`` may be one string; ``None`` means empty for ``stop``/``stop_token_ids``;
    vLLM keywords at their no-op value are dropped; anything else raises
    ``UnsupportedArgumentError`` (a TypeError) in one line saying what to use instead.
    """
    names = [f.name for f in dataclasses.fields(cls)]
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in names:
            if key == "stop":
                value = [] if value is None else [value] if isinstance(value, str) else value
            elif key == "stop_token_ids" and value is None:
                value = []
            elif key in ("bad_words", "allowed_token_ids") and value is not None and not isinstance(value, list):
                value = list(value) if isinstance(value, tuple) else value
            if key in ("stop", "stop_token_ids") and isinstance(value, tuple):
                value = list(value)
            out[key] = value
        elif key in REMOVED_SPEC_KNOBS or key == "speculative_config":
            raise UnsupportedArgumentError(key, removed_knob_message(key, "SamplingParams"))
        elif key in _UNIMPLEMENTED_SAMPLING:
            neutral, why = _UNIMPLEMENTED_SAMPLING[key]
            if not any(value is n or (type(value) is not bool and value == n) for n in neutral):
                shown = " or ".join(repr(n) for n in neutral)
                raise UnsupportedArgumentError(
                    key, f"SamplingParams({key}={value!r}) is not supported by specserve yet ({why}); "
                    f"leave it out or pass {shown}",
                )
        else:
            raise UnsupportedArgumentError(
                key, f"SamplingParams() got an unknown argument {key!r}; its arguments are: {', '.join(names)}"
            )
    return out


MAX_CHOICES = 16  # n and best_of: completions per prompt (the HTTP API's limit too)


def _choices(kwargs: dict[str, Any]) -> tuple[int, int]:
    """vLLM's ``n`` (completions returned per prompt) and ``best_of`` (candidates generated,
    the n with the highest cumulative log-probability returned; None = n), checked."""
    n, best_of = kwargs.pop("n", 1), kwargs.pop("best_of", None)
    for key, value in (("n", n), ("best_of", best_of)):
        if value is None and key == "best_of":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHOICES:
            raise UnsupportedArgumentError(key, f"SamplingParams({key}=...) must be an integer in [1, {MAX_CHOICES}], "
                                                f"got {value!r}")
    n = 1 if n is None else n
    if best_of is not None and best_of < n:
        raise UnsupportedArgumentError("best_of", f"SamplingParams(best_of={best_of}) must be >= n ({n})")
    return n, best_of if best_of is not None else n


class SamplingParams(request.SamplingParams):
    """vLLM's ``SamplingParams``: a ``specserve.request.SamplingParams`` made from vLLM's
    keywords by ``sampling_params_kwargs`` (one ``stop`` string, ``None`` lists, no-op vLLM
    keywords dropped; anything else a one-line ``UnsupportedArgumentError``), plus vLLM's
    ``n`` and ``best_of``, which ``LLM.generate`` reads (each choice is its own engine
    request; choice i > 0 of a seeded request samples with seed + i, as the HTTP API's do).
    The engine treats it as the plain class."""

    def __init__(self, *args: Any, **kwargs: Any):
        n, best_of = _choices(kwargs)
        super().__init__(*args, **sampling_params_kwargs(request.SamplingParams, kwargs))
        self.n, self.best_of = n, best_of
