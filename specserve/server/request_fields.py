"""The request fields the completion endpoints know, and what happens to the others.

A field is known when OpenAI's API or vLLM's protocol has it for that endpoint (whether
or not specserve implements it: those it does not are refused by the handlers, naming
the field) or it is one of specserve's own (``speculation``).  Any other field, a typo
such as ``"tempreture"`` most often, is by default ignored as vLLM ignores it, but not
silently: its name is logged once per server (WARNING, with the closest known name) and
every response to a request that sent it carries ``X-Specserve-Ignored-Fields: <names>``.
With ``server.strict_fields: true`` such a request is refused (400 naming the field).
"""

from __future__ import annotations

import difflib
import logging
import threading
from typing import Any

from specserve.errors import InvalidRequestError

log = logging.getLogger("specserve.server.http")

IGNORED_FIELDS_HEADER = "X-Specserve-Ignored-Fields"

# OpenAI's and vLLM's sampling fields (both endpoints).
_SAMPLING = {
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "max_completion_tokens", "n", "presence_penalty", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "user", "best_of", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "bad_words", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "structural_tag", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "priority", "request_id", "echo", "add_special_tokens", "prediction",
    "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
    "speculation",  # specserve's: the request's cap on drafts per step
}
CHAT_FIELDS = frozenset(_SAMPLING | {
    "messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "functions", "function_call", "reasoning_effort", "include_reasoning", "thinking", "verbosity", "modalities",
    "audio", "web_search_options", "add_generation_prompt", "continue_final_message", "documents",
    "chat_template", "chat_template_kwargs", "mm_processor_kwargs",
    "separate_reasoning", "thinking_token_budget",  # SGLang's, vLLM's (docs/server.md "Tools and reasoning")
})
COMPLETION_FIELDS = frozenset(_SAMPLING | {"prompt", "suffix", "prompt_embeds"})


class UnknownFields:
    """Finds a body's unknown fields; logs each name once; refuses them when ``strict``."""

    def __init__(self, strict: bool):
        self.strict = strict
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def check(self, body: dict[str, Any], chat: bool) -> list[str]:
        """The unknown field names of ``body`` (sorted); InvalidRequestError under strict."""
        known = CHAT_FIELDS if chat else COMPLETION_FIELDS
        unknown = sorted(k for k in body if k not in known)
        if not unknown:
            return []
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        if self.strict:
            name = unknown[0]
            raise InvalidRequestError(name, f"is not a field of {endpoint}{_hint(name, known)} "
                                            "(server.strict_fields is on)")
        with self._lock:
            new = [k for k in unknown if k not in self._logged]
            self._logged.update(new)
        for name in new:  # once per name: a client that always sends it does not flood the log
            log.warning("request field %r is not a field of %s and was ignored%s (logged once per name; "
                        "server.strict_fields=true refuses it)", _printable(name), endpoint, _hint(name, known))
        return unknown


def _hint(name: str, known: frozenset[str]) -> str:
    match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return f"; did you mean {match[0]}?" if match else ""


def _printable(name: str, limit: int = 64) -> str:
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in name[:limit])
    return text + ("..." if len(name) > limit else "")


def header_value(names: list[str], limit: int = 512) -> str:
    """The names for the response header: printable ASCII, comma-separated, bounded."""
    text = ", ".join(_printable(n).encode("ascii", "backslashreplace").decode("ascii") for n in names)
    return text if len(text) <= limit else text[: limit - 3] + "..."
