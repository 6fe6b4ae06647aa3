"""Sampling parameters, outputs and finish reasons: plain dataclasses, no torch.

The bottom of the package: imports only the standard library and ``specserve.errors``.
``SamplingParams`` takes its own field names and checks its own ranges (``validate``);
vLLM's keyword spellings (``stop="x"``, ``n=1``, ...) are translated at the vLLM-shaped
door, ``specserve.compat.SamplingParams`` (``from specserve import SamplingParams``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from specserve.errors import InvalidRequestError


# Temperatures below this are greedy (argmax), as in vLLM: dividing logits by a
# denormal temperature would overflow to inf and turn the softmax into NaN.
GREEDY_EPS = 1e-5
MAX_TEMPERATURE = 2.0
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's chat limit)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
LOGIT_BIAS_RANGE = 100.0  # |bias| <= this (OpenAI's range)
PENALTY_RANGE = 2.0  # presence/frequency penalties in [-2, 2] (OpenAI's range)
MAX_BAD_WORDS = 128  # bad_words entries (vLLM's default bound on their tokenizations)
MAX_BAD_WORD_CHARS = 512


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the client, the server or a deadline


@dataclass
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's name and fields); exactly one is set.

    ``json``: a JSON schema (dict or its JSON text); ``json_object``: any JSON
    object; ``regex``: a regular expression the whole output matches; ``choice``:
    one of these strings; ``grammar``: a Lark grammar (llguidance's dialect).
    Compiled by ``specserve.structured`` (llguidance) when the request is admitted.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def kind(self) -> str:
        """The one field that is set; raises InvalidRequestError unless exactly one is."""
        given = [n for n, v in (("json", self.json), ("regex", self.regex), ("choice", self.choice),
                                ("grammar", self.grammar)) if v is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs", f"exactly one of json, regex, choice, grammar, json_object must be set, got {given}"
            )
        return given[0]


@dataclass
class SpeculationParams:
    """A request's own speculative-decoding control (OpenAI's body field ``speculation``).

    ``num_speculative_tokens``: the most drafts the request verifies per step, 0 .. the
    server's K (``method.num_speculative_tokens``); 0 turns speculation off for this
    request alone (it decodes as plain decoding does, and the method never sees it);
    None leaves it to the server.
    """

    num_speculative_tokens: int | None = None

    @classmethod
    def from_dict(cls, value: Any, name: str = "speculation") -> SpeculationParams:
        """From its wire form, an object of these fields; an unknown key names itself."""
        if isinstance(value, SpeculationParams):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(name, f"must be an object such as {{\"num_speculative_tokens\": 0}}, "
                                            f"got {type(value).__name__}")
        for key in value:
            if key != "num_speculative_tokens":
                shown = key if isinstance(key, str) and key.isprintable() and len(key) <= 64 else repr(key)[:64]
                raise InvalidRequestError(f"{name}.{shown}", "is not a known key (known: num_speculative_tokens)")
        return cls(num_speculative_tokens=value.get("num_speculative_tokens"))


@dataclass
class ReasoningParams:
    """The reasoning markers of a request's model as token ids, for the engine's gate
    (``specserve.engine.reasoning_gate``): a grammar starts after the reasoning ends, and
    ``SamplingParams.thinking_token_budget`` forces its end.  Built by the front ends from
    the server's reasoning format (``specserve.formats.reasoning``).

    ``start_token_ids`` / ``end_token_ids``: each spelling of the start and end markers;
    ``state``: where the output starts, as the prompt leaves it ("open": inside the
    reasoning, "closed": after it, "optional": it may open it); ``forced_token_ids``: what
    a budget that runs out forces (an optional message, then the end marker)."""

    start_token_ids: list[list[int]] = field(default_factory=list)
    end_token_ids: list[list[int]] = field(default_factory=list)
    state: str = "optional"
    forced_token_ids: list[int] = field(default_factory=list)


@dataclass
class SamplingParams:
    """Per-request sampling controls (the names OpenAI and vLLM users know).

    Ranges (checked by ``validate``, the same on every front end):
    ``temperature`` in [0, 2] (OpenAI's range); values below ``GREEDY_EPS``
    (0 included) mean greedy, as in vLLM.  ``top_k`` -1 or 0 = off, else
    1 .. the vocabulary size (the engine checks the upper bound).  ``top_p`` in
    (0, 1] (1 = off), ``min_p`` in [0, 1] (0 = off).  ``seed`` any 64-bit
    integer, signed or unsigned: [-2**63, 2**64 - 1].  ``max_tokens`` >= 1 (and
    <= the server's cap).  At most ``MAX_STOP_STRINGS`` stop strings of at most
    ``MAX_STOP_STRING_CHARS`` characters, at most ``MAX_STOP_TOKEN_IDS`` stop ids.
    ``speculation.num_speculative_tokens`` in [0, the server's K] (``SpeculationParams``).
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
    # Predicted Outputs: the tokens of the output the client expects (OpenAI's
    # `prediction`); drafted where the output follows them, never changing it.
    prediction_token_ids: list[int] | None = None

    # Logits controls, applied to the target's logits at every verified position (draft
    # positions included, against the tokens that precede them): OpenAI's presence and
    # frequency penalties (output tokens; [-2, 2]), vLLM's repetition_penalty (prompt and
    # output tokens; > 0, 1 = off), logit_bias ({token id: bias in [-100, 100]}) and
    # min_tokens (EOS and stop_token_ids banned until that many tokens were emitted).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    # Log-probabilities: None = none; k >= 0 = each emitted token's log-probability plus
    # the k most likely tokens (at most MAX_LOGPROBS).  prompt_logprobs likewise for the
    # prompt's tokens (the first has none).  See specserve.sampling.logits_controls.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # structured_outputs compiled (a specserve.structured.CompiledGrammar): the servers attach
    # it after compiling off the engine thread; None: the engine compiles it when admitting.
    compiled_grammar: Any = field(default=None, repr=False, compare=False)
    # The cache partition: requests share prefix-cache blocks and suffix-decoding responses only
    # with requests of the same value (None: with the others that have none).  Set by the
    # server from the caller's API key and its `cache_salt` (an opaque digest, never the key).
    cache_salt: str | None = None
    # Per-request speculation: a cap on this request's drafts per step (0 = off), or None
    # for the server's choice.  A dict of SpeculationParams' fields is taken too.
    speculation: SpeculationParams | None = None
    # The recording of a transcription request (a specserve.audio.AudioClip, 16 kHz mono),
    # attached by the audio doors; its prompt holds the model's audio positions.
    audio: Any = field(default=None, repr=False, compare=False)
    # Reasoning models: at most this many tokens of reasoning, then its end is forced (vLLM's
    # thinking_token_budget; needs ``reasoning``); ``reasoning``: the markers, set by the front ends.
    thinking_token_budget: int | None = None
    reasoning: ReasoningParams | None = None

    # vLLM's output and vocabulary controls, as vLLM defines them.
    # include_stop_str_in_output: the text ends after the stop string that ended it (not before).
    # skip_special_tokens: special tokens add no text (False: their text is kept);
    # spaces_between_special_tokens (with skip_special_tokens False): False joins adjacent
    # special tokens with nothing between them.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # bad_words: words never generated: each word is tokenized as it would start the text and
    # after a space (vLLM's rule, ``engine.tokenizer.bad_words_token_ids``); its last token is
    # banned wherever the output ends with the others (a one-token word: everywhere).
    # allowed_token_ids: only these tokens may be generated.  Both apply at every verified
    # position, as the logits controls above do.
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # bad_words tokenized (set by the server off the engine thread, else by the engine).
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    # truncate_prompt_tokens k: only the last k prompt tokens are used (-1: the last
    # max_model_len - 1); applied where prompts are tokenized (``truncate_prompt``).
    truncate_prompt_tokens: int | None = None

    @property
    def num_speculative_tokens(self) -> int | None:
        """The request's cap on drafts per step (0: no speculation), None: the server's K."""
        sp = self.speculation
        return sp.num_speculative_tokens if isinstance(sp, SpeculationParams) else None

    @property
    def has_logits_processors(self) -> bool:
        """Whether any control beyond temperature/top-k/top-p/min-p changes the logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
            or self.min_tokens or self.structured_outputs is not None or self.bad_words
            or self.allowed_token_ids is not None or self.thinking_token_budget is not None
        )

    def truncate_prompt(self, ids: list[int], max_model_len: int | None = None) -> list[int]:
        """``ids`` cut to their last ``truncate_prompt_tokens`` (-1: the last
        ``max_model_len - 1``, room for one output token), as vLLM truncates prompts."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            if max_model_len is None:
                return ids
            k = max(1, max_model_len - 1)
        return ids[-k:] if len(ids) > k else ids

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def _validate_logits_controls(self, vocab_size: int | None) -> None:
        """Ranges of the logits controls and log-probability fields (part of ``SamplingParams.validate``)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise InvalidRequestError(name, f"must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise InvalidRequestError("repetition_penalty", f"must be in (0, 100] (1 = off), got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError("logit_bias", "must be an object mapping token ids to biases")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                ok = (isinstance(key, int) and not isinstance(key, bool) and key >= 0) or (
                    isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20
                )
                if not ok:
                    raise InvalidRequestError("logit_bias", f"keys must be token ids (non-negative integers), got {key!r}")
                tok = int(key)
                if vocab_size is not None and tok >= vocab_size:
                    raise InvalidRequestError("logit_bias", f"token id {tok} is not < the vocabulary size ({vocab_size})")
                _check_number("logit_bias", value)
                if not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
                    raise InvalidRequestError(
                        "logit_bias", f"biases must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {value}"
                    )
                bias[tok] = float(value)
            self.logit_bias = bias
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_int(name, value)
            if not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise InvalidRequestError("structured_outputs", "must be a StructuredOutputsParams")
            so.kind()
        self._validate_vocabulary_controls(vocab_size)

    def _validate_vocabulary_controls(self, vocab_size: int | None) -> None:
        """vLLM's output and vocabulary fields (part of ``validate``)."""
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, f"must be a boolean, got {type(getattr(self, name)).__name__}")
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
                raise InvalidRequestError("bad_words", "must be a list of strings")
            if len(words) > MAX_BAD_WORDS:
                raise InvalidRequestError("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(words)}")
            for w in words:
                if not w.strip():
                    raise InvalidRequestError("bad_words", "words must not be empty or only spaces")
                if len(w) > MAX_BAD_WORD_CHARS:
                    raise InvalidRequestError("bad_words", f"each word must be at most {MAX_BAD_WORD_CHARS} characters")
                check_text("bad_words", w)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError("allowed_token_ids", "must be a list of integer token ids")
            if not ids:
                raise InvalidRequestError("allowed_token_ids", "must not be empty (no token could be generated)")
            if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in ids):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise InvalidRequestError("allowed_token_ids", f"every id must be in {bound}")
        k = self.truncate_prompt_tokens
        if k is not None:
            _check_int("truncate_prompt_tokens", k)
            if k < 1 and k != -1:
                raise InvalidRequestError("truncate_prompt_tokens", f"must be >= 1, or -1 for max_model_len, got {k}")

    def _validate_speculation(self, max_speculative_tokens: int | None) -> None:
        """``speculation`` (part of ``validate``): a SpeculationParams (a dict becomes one)
        whose cap is an integer in [0, max_speculative_tokens] (the server's K; 0 when the
        server has no speculative method, so only 0 passes there)."""
        if self.speculation is None:
            return
        self.speculation = SpeculationParams.from_dict(self.speculation)
        k = self.speculation.num_speculative_tokens
        if k is None:
            return
        name = "speculation.num_speculative_tokens"
        _check_int(name, k)
        if k < 0:
            raise InvalidRequestError(name, f"must be >= 0 (0 turns speculation off for this request), got {k}")
        if max_speculative_tokens is None or k <= max_speculative_tokens:
            return
        if max_speculative_tokens == 0:
            raise InvalidRequestError(name, f"must be 0: this server runs no speculative method (it is started "
                                            f"without +method=...), got {k}")
        raise InvalidRequestError(name, f"must be in [0, {max_speculative_tokens}] (the server's "
                                        f"num_speculative_tokens), got {k}")

    def validate(self, max_tokens_cap: int | None = None, vocab_size: int | None = None,
                 max_speculative_tokens: int | None = None) -> "SamplingParams":
        """Raise InvalidRequestError naming the first bad field; return self.
        ``max_speculative_tokens``: the server's K, the bound of ``speculation`` (None: unchecked)."""
        _check_number("temperature", self.temperature)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1, 0 (off) or > 0, got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise InvalidRequestError("top_k", f"must be <= the vocabulary size ({vocab_size}), or -1/0 for off; got {self.top_k}")
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
            if not SEED_MIN <= self.seed <= SEED_MAX:
                raise InvalidRequestError("seed", f"must be a 64-bit integer in [-2**63, 2**64 - 1], got {self.seed}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop", "must be a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if s == "":
                raise InvalidRequestError("stop", "stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError("stop", f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters")
            check_text("stop", s)
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequestError("stop_token_ids", "must be a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"every id must be < the vocabulary size ({vocab_size})")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", "must be a boolean")
        self._validate_logits_controls(vocab_size)
        if self.prediction_token_ids is not None:
            p = self.prediction_token_ids
            if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
                raise InvalidRequestError("prediction", "must be a list of non-negative integer token ids")
            if vocab_size is not None and any(t >= vocab_size for t in p):
                raise InvalidRequestError("prediction", f"every token id must be < the vocabulary size ({vocab_size})")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidRequestError("cache_salt", "must be a non-empty string when given")
        self._validate_speculation(max_speculative_tokens)
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget)
            if self.thinking_token_budget < 0:
                raise InvalidRequestError("thinking_token_budget", f"must be >= 0, got {self.thinking_token_budget}")
            if self.reasoning is None:
                raise InvalidRequestError("thinking_token_budget", "needs a reasoning format (model.reasoning_format)")
        return self


def check_text(name: str, value: str) -> None:
    """Refuse text that cannot be encoded as UTF-8 (a lone surrogate such as "\\ud800",
    which JSON can carry): tokenizers and the wire would fail on it later."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            name, f"is not valid Unicode text (a lone surrogate at character {exc.start})"
        ) from None


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
    # Predicted Outputs (OpenAI's usage.completion_tokens_details): drafted prediction
    # tokens that appear in the output, and those verified that do not.
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    # +method=ctc: the stage that settled the transcription ("entropy": the CTC text passed
    # the entropy gate, no LLM forward; "verified": the one-pass verification accepted the
    # hypothesis; "decoded": decoding went on past it); None for other requests.
    ctc_stage: str | None = None

    @property
    def mean_acceptance_length(self) -> float:
        if self.num_drafts == 0:
            return 1.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts


@dataclass
class TokenLogprob:
    """A token's log-probability (``specserve.sampling.logits_controls`` defines which
    distribution) and the ``k`` most likely tokens at its position, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 + the tokens more likely than it at its position, where computed


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
    spec: SpecDecodeStats  # its speculative-decoding counters so far (not the method's config)
    error: str | None = None  # set when the engine itself failed (INTERNAL; the engine is dead)
    # Set when handling this one request failed (bad input found late -> InvalidRequestError,
    # anything else -> RequestFailedError); the engine keeps serving the others.
    failure: Exception | None = None
    # With params.logprobs: one entry per new token (new_logprobs) and per token so far
    # (logprobs, filled by the OutputProcessor like token_ids).  With prompt_logprobs: one
    # entry per prompt token (None for the first), on the first output that carries tokens.
    new_logprobs: list[TokenLogprob] | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None  # set together with prompt_logprobs (echo)
