"""Requests, sampling parameters and outputs: pure Python, no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specserve.errors import InvalidRequestError


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the client, the server or a deadline


@dataclass
class SamplingParams:
    """Per-request sampling controls (the names OpenAI and vLLM users know).

    ``temperature == 0`` means greedy.  ``top_k == 0`` (or -1) disables top-k,
    ``top_p == 1`` disables nucleus sampling, ``min_p == 0`` disables min-p.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, max_tokens_cap: int | None = None) -> "SamplingParams":
        """Raise InvalidRequestError naming the first bad field; return self."""
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1, 0 (off) or > 0, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if max_tokens_cap is not None and self.max_tokens > max_tokens_cap:
            raise InvalidRequestError(
                "max_tokens", f"must be <= {max_tokens_cap} (the server's cap), got {self.max_tokens}"
            )
        if self.seed is not None:
            _check_int("seed", self.seed)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop", "must be a list of strings")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequestError("stop_token_ids", "must be a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", "must be a boolean")
        return self


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(name, f"must be a number, got {type(value).__name__}")
    if value != value:  # NaN
        raise InvalidRequestError(name, "must not be NaN")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {type(value).__name__}")


@dataclass
class SpecDecodeStats:
    """Per-request speculative-decoding counters (vLLM's vocabulary).

    A *draft* is one proposal round for one request; ``num_draft_tokens`` the
    tokens proposed in all rounds; ``num_accepted_tokens`` those the target
    accepted.  Mean acceptance length = 1 + accepted / drafts.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        if self.num_drafts == 0:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts


@dataclass
class RequestOutput:
    """One update for one request, as emitted after an engine step.

    ``new_token_ids``/``new_text`` are the deltas since the previous output;
    ``token_ids``/``text`` the whole completion so far.  ``finished`` is True
    exactly once, on the last output, together with ``finish_reason``.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    spec: SpecDecodeStats
    error: str | None = None  # set when the engine failed this request (INTERNAL)


def _vllm_keywords(init):
    """Wrap the dataclass ``__init__``: vLLM-style keywords (``stop="x"``, ``None``
    lists) are accepted, and any keyword this class lacks -- a vLLM one it does not
    implement, or a made-up speculative knob such as ``speculative_sampling`` --
    raises a one-line TypeError saying what to use instead (``specserve.compat``)."""

    def __init__(self, *args, **kwargs):
        from specserve.compat import sampling_params_kwargs

        init(self, *args, **sampling_params_kwargs(SamplingParams, kwargs))

    __init__.__wrapped__ = init
    __init__.__qualname__ = init.__qualname__
    return __init__


SamplingParams.__init__ = _vllm_keywords(SamplingParams.__init__)
