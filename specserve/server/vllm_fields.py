"""vLLM's extra request fields on the OpenAI endpoints, parsed once for both of them.

vLLM's OpenAI server takes fields beyond OpenAI's (its ``CompletionRequest`` and
``ChatCompletionRequest``); clients written for vLLM send them and expect them to act.
Each is honoured here as vLLM defines it, or refused in one line naming it:

* output text: ``include_stop_str_in_output``, ``skip_special_tokens``,
  ``spaces_between_special_tokens`` (``SamplingParams`` carries them; the output
  processor applies them);
* vocabulary: ``bad_words``, ``allowed_token_ids`` (logits controls at every verified
  position, so speculation stays lossless);
* the prompt: ``add_special_tokens`` (default true on completions, false on chat, where
  the template holds the special tokens), ``truncate_prompt_tokens`` (the last k tokens;
  -1: as many as the context allows), ``prompt_logprobs`` (k alternatives per prompt
  token, in each completion choice and at the top of a chat response; not with
  ``stream: true``, as in vLLM);
* ``request_id`` (or the ``X-Request-Id`` header, which wins, as in vLLM): the response's
  id is ``cmpl-<id>`` / ``chatcmpl-<id>``; ids are a namespace per API key;
* ``use_beam_search: true`` is refused (no beam search here); ``guided_decoding_backend``
  takes vLLM's backend names and changes nothing: llguidance serves every grammar.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from specserve.errors import InvalidRequestError
from specserve.request import MAX_LOGPROBS

log = logging.getLogger("specserve.server.http")

# vLLM's structured-output backends (its --structured-outputs-config backend names, and the
# older guided_decoding_backend values).
GUIDED_DECODING_BACKENDS = frozenset({
    "auto", "xgrammar", "guidance", "llguidance", "outlines", "lm-format-enforcer",
    "xgrammar:disable-any-whitespace", "guidance:disable-any-whitespace",
})  # fmt: skip
_noted_backends: set[str] = set()

_BOOL_FIELDS = ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")


@dataclass
class VllmFields:
    """The vLLM fields of one request body."""

    fields: dict[str, Any] = field(default_factory=dict)  # extra SamplingFields
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None  # shown in the response when set
    request_id: str | None = None  # the client's (body or X-Request-Id header)


def _bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(name, f"must be a boolean, got {type(value).__name__}")
    return value


def parse_vllm_fields(body: dict, chat: bool, stream: bool, header_request_id: str | None = None) -> VllmFields:
    v = VllmFields(add_special_tokens=not chat)
    for name in _BOOL_FIELDS:
        value = _bool(body, name)
        if value is not None:
            v.fields[name] = value
    for name in ("bad_words", "allowed_token_ids"):
        if body.get(name) is not None:
            v.fields[name] = body[name]  # SamplingParams checks them, naming the field
    add = _bool(body, "add_special_tokens")
    if add is not None:
        v.add_special_tokens = add
    k = body.get("truncate_prompt_tokens")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1):
            raise InvalidRequestError("truncate_prompt_tokens", f"must be an integer >= 1, or -1 for the model's "
                                                                f"context length, got {k!r}")
        v.truncate_prompt_tokens = k
        v.fields["truncate_prompt_tokens"] = k
    plp = body.get("prompt_logprobs")
    if plp is not None:
        if isinstance(plp, bool) or not isinstance(plp, int):
            raise InvalidRequestError("prompt_logprobs", f"must be an integer, got {type(plp).__name__}")
        if stream and (plp > 0 or plp == -1):
            raise InvalidRequestError("prompt_logprobs", "is not available with stream: true")
        if not 0 <= plp <= MAX_LOGPROBS:
            raise InvalidRequestError("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {plp}")
        v.prompt_logprobs = plp
        v.fields["prompt_logprobs"] = plp
    if body.get("use_beam_search") not in (None, False):
        if not isinstance(body["use_beam_search"], bool):
            raise InvalidRequestError("use_beam_search", "must be a boolean")
        raise InvalidRequestError("use_beam_search", "beam search is not supported by this server; "
                                                     "use best_of / n with sampling instead")
    backend = body.get("guided_decoding_backend")
    if backend is not None:
        if not isinstance(backend, str) or backend not in GUIDED_DECODING_BACKENDS:
            raise InvalidRequestError("guided_decoding_backend",
                                      f"must be one of {', '.join(sorted(GUIDED_DECODING_BACKENDS))}")
        if backend not in _noted_backends:
            _noted_backends.add(backend)
            log.info("guided_decoding_backend=%s: accepted; llguidance serves every structured output here", backend)
    rid = header_request_id if header_request_id is not None else body.get("request_id")
    if rid is not None and rid != "":
        if not isinstance(rid, str):
            raise InvalidRequestError("request_id", f"must be a string, got {type(rid).__name__}")
        v.request_id = rid
    return v
