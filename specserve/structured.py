"""Structured outputs (JSON schema, JSON object, regex, choice, Lark grammar) through llguidance.

Why llguidance (over xgrammar and outlines-core): it is one small self-contained
wheel (Rust, abi3; no torch, no compiler or JIT at run time, nothing downloaded),
builds its token masks lazily per step in tens of microseconds (no per-schema
precompilation over the whole vocabulary as outlines-core's index needs), and its
matcher rolls back any number of consumed tokens, which speculative verification
needs: the state is advanced through a request's drafts to compute the mask at
each draft position and rolled back afterwards.  It reads any fast Hugging Face
tokenizer (the embedded SmolLM2 one included) offline.  xgrammar would do too
(vLLM's default; also rollback) but pulls a TVM runtime and compiles per schema.

The engine holds one :class:`GrammarBackend` (the tokenizer conversion costs about
a second on a 50k vocabulary, done on the first structured request); each request
with ``structured_outputs`` gets a :class:`GrammarState` at admission.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import numpy as np

from specserve.errors import InvalidRequestError
from specserve.request import StructuredOutputsParams

log = logging.getLogger(__name__)

__all__ = ["GrammarBackend", "GrammarState", "grammar_text"]

# JSON answers: no free whitespace between tokens (llguidance's default), which keeps a
# weak model from looping on spaces and newlines; the output is still valid JSON.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for a request's structured output spec."""
    import llguidance

    kind = so.kind()
    M = llguidance.LLMatcher
    try:
        if kind == "json":
            schema = so.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise InvalidRequestError("response_format", "the JSON schema must be an object")
            return M.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if kind == "regex":
            if not isinstance(so.regex, str) or not so.regex:
                raise InvalidRequestError("regex", "must be a non-empty string")
            return M.grammar_from_regex(so.regex)
        if kind == "choice":
            choices = so.choice
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidRequestError("choice", "must be a non-empty list of non-empty strings")
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if not isinstance(so.grammar, str) or not so.grammar.strip():
            raise InvalidRequestError("grammar", "must be a non-empty Lark grammar")
        return M.grammar_from_lark(so.grammar)
    except InvalidRequestError:
        raise
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(_field(kind), f"is not valid: {e}") from None


def _field(kind: str) -> str:
    return {"json": "response_format", "json_object": "response_format"}.get(kind, kind)


class GrammarBackend:
    """The llguidance view of the engine's tokenizer, and grammar compilation."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tok = None
        self._lock = threading.Lock()  # the conversion may be asked for from the server and the engine
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row

    @property
    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                import llguidance.hf

                eos = self._eos[0] if len(self._eos) == 1 else (self._eos or None)
                self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=eos)
            return self._tok

    def compile(self, so: StructuredOutputsParams) -> str:
        """The grammar text, checked against the tokenizer; InvalidRequestError naming the field if bad."""
        import llguidance

        text = grammar_text(so)
        err = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if err:
            raise InvalidRequestError(_field(so.kind()), f"cannot be compiled: {err.splitlines()[0][:300]}")
        return text

    def new_state(self, grammar: str) -> "GrammarState":
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InvalidRequestError("response_format", f"cannot be compiled: {m.get_error().splitlines()[0][:300]}")
        return GrammarState(m, self.words, self._eos)


class GrammarState:
    """One request's matcher: masks at its verified positions, advanced on commit."""

    def __init__(self, matcher: Any, words: int, eos_token_ids: list[int]):
        self.m = matcher
        self.words = words
        self.eos = eos_token_ids

    def _fill(self, row: np.ndarray) -> None:
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if not row.any():  # nothing allowed (an error state): let the request end rather than NaN
            for e in self.eos:
                row[e >> 5] |= np.int32(np.uint32(1 << (e & 31)).view(np.int32))

    def masks(self, drafts: list[int]) -> tuple[np.ndarray, int]:
        """Bitmasks (n+1, W) int32 for the positions after the committed tokens and after
        each accepted prefix of ``drafts``, and n: how many drafts the grammar allows in a
        row.  Drafts from the first refused one on cannot be emitted; only n+1 rows are
        returned.  The matcher is left as it was."""
        rows = np.zeros((len(drafts) + 1, self.words), dtype=np.int32)
        self._fill(rows[0])
        n = 0
        for d in drafts:
            if not (int(rows[n][d >> 5]) >> (d & 31)) & 1 or not self.m.consume_token(d):
                break
            n += 1
            self._fill(rows[n])
        if n:
            self.m.rollback(n)
        return rows[: n + 1], n

    def advance(self, tokens: list[int]) -> None:
        """Consume emitted tokens (after verification)."""
        for t in tokens:
            if self.m.is_stopped():
                break
            if not self.m.consume_token(t):
                log.warning("grammar refused an emitted token %d: %s", t, self.m.get_error()[:200])
                break

    @property
    def error(self) -> str:
        return self.m.get_error() if self.m.is_error() else ""
