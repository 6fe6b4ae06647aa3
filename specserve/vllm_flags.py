"""vLLM's everyday ``vllm serve`` flags, as ``specserve serve`` takes them (pure Python).

Each flag either maps to its key, is accepted with one note where specserve always
behaves that way, or fails with one line naming what is supported.  ``FLAGS`` is the
table (docs/vllm-compat.md lists the same); ``vllm_flag`` applies one.

======================================  ================================================
``--enable-prefix-caching [BOOL]``      ``engine.enable_prefix_caching=true`` (or BOOL)
``--no-enable-prefix-caching``          ``engine.enable_prefix_caching=false``
``--tokenizer T``                       ``model.tokenizer=T`` (a directory or a hub id)
``--revision R``                        the model id pinned: ``org/name@R``
``--max-logprobs N``                    ``server.max_logprobs=N`` (at most 20)
``--uvicorn-log-level L``               ``server.log_level=L`` (trace = DEBUG)
``--generation-config auto|vllm|DIR``   ``model.generation_config=...``
``--disable-log-stats``                 ``server.log_stats_interval_s=0``
``--disable-log-requests``              ``server.log_requests=false`` (no access lines)
``--disable-uvicorn-access-log``        ``server.log_requests=false``
``--enable-log-requests``               ``server.log_requests=true``
``--enable-chunked-prefill``            a note: prompts are always prefilled in chunks
``--swap-space N``                      a note: no CPU swap space (preempted requests recompute)
``--kv-cache-dtype auto``               nothing; any other dtype: one line
``--quantization M``                    one line: unquantized weights only
======================================  ================================================
"""

from __future__ import annotations

from specserve.errors import ConfigError

MAX_LOGPROBS = 20  # specserve.request.MAX_LOGPROBS: the most top log-probabilities per token
LOG_LEVELS = {"critical": "CRITICAL", "error": "ERROR", "warning": "WARNING", "info": "INFO", "debug": "DEBUG",
              "trace": "DEBUG"}

# flag -> (what it becomes, for --help and the docs)
FLAGS: dict[str, str] = {
    "enable-prefix-caching": "engine.enable_prefix_caching=true (or the value given)",
    "no-enable-prefix-caching": "engine.enable_prefix_caching=false",
    "tokenizer": "model.tokenizer (a directory or a Hugging Face id)",
    "revision": "pins the model's Hugging Face id: org/name@REVISION",
    "max-logprobs": f"server.max_logprobs (at most {MAX_LOGPROBS})",
    "uvicorn-log-level": "server.log_level",
    "generation-config": "model.generation_config: auto (generation_config.json), vllm (none) or a directory",
    "disable-log-stats": "server.log_stats_interval_s=0 (no periodic stats line)",
    "disable-log-requests": "server.log_requests=false (no access log line per request)",
    "disable-uvicorn-access-log": "server.log_requests=false",
    "enable-log-requests": "server.log_requests=true (the default)",
    "enable-chunked-prefill": "accepted, no effect: long prompts are always prefilled in chunks",
    "no-enable-chunked-prefill": "accepted, no effect: long prompts are always prefilled in chunks",
    "swap-space": "accepted, no effect: no CPU swap space (a preempted request recomputes its KV)",
    "kv-cache-dtype": "auto only (the KV cache is in the model's dtype)",
    "quantization": "refused: specserve serves unquantized weights",
}
VLLM_SWITCHES = ("enable-prefix-caching", "no-enable-prefix-caching", "disable-log-stats", "disable-log-requests",
                 "disable-uvicorn-access-log", "enable-log-requests", "enable-chunked-prefill",
                 "no-enable-chunked-prefill")
VLLM_VALUED = ("tokenizer", "revision", "max-logprobs", "uvicorn-log-level", "generation-config", "swap-space",
               "kv-cache-dtype", "quantization")

_CHUNKED = ("long prompts are always prefilled in chunks of up to engine.max_num_batched_tokens tokens "
            "(engine.long_prefill_token_threshold caps one prompt's share while others wait)")


def _bool(flag: str, value: str) -> bool:
    text = value.strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(flag.replace("-", "_"), f"--{flag} takes true or false, got {value!r}")


def _no_effect(flag: str, why: str) -> str:
    return f"--{flag} is accepted for vLLM compatibility and has no effect: {why}"


def vllm_flag(flag: str, value: str | None) -> tuple[list[str], str | None, str | None]:
    """One of vLLM's flags (``flag`` without dashes, ``value`` None for a bare switch) ->
    (Hydra overrides, a note or None, the revision for ``--revision`` or None).
    ConfigError (one line, naming the flag) for a value specserve cannot honour."""
    from specserve.compat import hydra_value

    key = flag.replace("-", "_")
    if flag in VLLM_SWITCHES and flag not in VLLM_VALUED and value is not None and flag not in (
            "enable-prefix-caching", "enable-chunked-prefill"):
        raise ConfigError(key, f"--{flag} takes no value")
    if flag == "enable-prefix-caching":
        on = True if value is None else _bool(flag, value)
        return [f"engine.enable_prefix_caching={'true' if on else 'false'}"], None, None
    if flag == "no-enable-prefix-caching":
        return ["engine.enable_prefix_caching=false"], None, None
    if flag in ("enable-chunked-prefill", "no-enable-chunked-prefill"):
        if value is not None:
            _bool(flag, value)
        return [], _no_effect(flag, _CHUNKED), None
    if flag == "disable-log-stats":
        return ["server.log_stats_interval_s=0"], None, None
    if flag in ("disable-log-requests", "disable-uvicorn-access-log"):
        return ["server.log_requests=false"], None, None
    if flag == "enable-log-requests":
        return ["server.log_requests=true"], None, None
    assert value is not None
    if flag == "tokenizer":
        return [f"model.tokenizer={hydra_value(value)}"], None, None
    if flag == "revision":
        if not value or any(c.isspace() for c in value) or "@" in value:
            raise ConfigError(key, f"--revision takes a branch, tag or commit of the model's Hugging Face repository, "
                                   f"got {value!r}")
        return [], None, value
    if flag == "max-logprobs":
        try:
            n = int(value)
        except ValueError:
            raise ConfigError(key, f"--max-logprobs must be an integer, got {value!r}") from None
        if not 0 <= n <= MAX_LOGPROBS:
            raise ConfigError(key, f"--max-logprobs must be in [0, {MAX_LOGPROBS}] in this build "
                                   f"(at most {MAX_LOGPROBS} top log-probabilities per token), got {n}")
        return [f"server.max_logprobs={n}"], None, None
    if flag == "uvicorn-log-level":
        level = LOG_LEVELS.get(value.strip().lower())
        if level is None:
            raise ConfigError(key, f"--uvicorn-log-level must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
        return [f"server.log_level={level}"], None, None
    if flag == "generation-config":
        return [f"model.generation_config={hydra_value(value)}"], None, None
    if flag == "swap-space":
        try:
            float(value)
        except ValueError:
            raise ConfigError(key, f"--swap-space takes a size in GiB, got {value!r}") from None
        return [], _no_effect(flag, "specserve keeps no CPU swap space (a preempted request recomputes its KV cache)"), None
    if flag == "kv-cache-dtype":
        if value.strip().lower() != "auto":
            raise ConfigError(key, f"--kv-cache-dtype {value}: only auto is supported (the KV cache is kept in the "
                                   "model's dtype, --dtype)")
        return [], None, None
    if flag == "quantization":
        if value.strip().lower() in ("none", "null"):
            return [], None, None
        raise ConfigError(key, f"--quantization {value}: not supported; specserve serves unquantized weights in "
                               "float32, bfloat16 or float16 (--dtype) and dequantizes .gguf files when it loads them")
    raise ConfigError(key, f"--{flag} is not a flag specserve knows")


def flags_help() -> str:
    """The table for ``specserve serve --help``."""
    width = max(len(f) for f in FLAGS) + 4
    return "\n".join(f"  --{flag:<{width - 2}} {what}" for flag, what in FLAGS.items())
