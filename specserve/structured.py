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

Compiling (:class:`GrammarBackend`): a request's spec becomes llguidance grammar
text (:func:`grammar_text`; longer than ``server.grammar_max_chars`` is refused), then a matcher built under :data:`PARSER_LIMITS` (llguidance's
resource limits: they bound the work of the compile and of every later mask) whose
first mask is computed at once, because llguidance builds its lexer there (a second
for some regexes).  The result, a :class:`CompiledGrammar`, lives in a
:class:`GrammarCache` (LRU, bounded in entries), keyed by the request's cache
partition (``SamplingParams.cache_salt``: its tenant and ``cache_salt``) and the
grammar text: one compile per distinct grammar and partition, shared by the copies of
``n``/``best_of``/prompt lists and by concurrent identical requests of the same
partition (they wait for the one in flight).  A grammar another tenant compiled is
compiled again: a hit would answer in a fraction of a fresh compile's time and tell
one tenant what another sent, which the prefix cache and the suffix tree never do.  Each request gets its own cheap
:class:`GrammarState` copy (``LLMatcher.deep_copy``).  The servers compile in worker
threads (``Frontend.compile_grammar``) and hand the result to the engine on
``SamplingParams.compiled_grammar``; the offline engine compiles inline, through
the same cache.  llguidance drops the GIL while it compiles and computes masks.

A grammar that cannot go on mid-generation (it refuses an emitted token, enters an
error state, or allows no token) fails its request with ``RequestFailedError``
(:meth:`GrammarState.advance`): the output never ends as a "stop" that breaks its
constraint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np

from specserve.errors import InvalidRequestError, RequestFailedError
from specserve.request import StructuredOutputsParams

log = logging.getLogger(__name__)

__all__ = [
    "PARSER_LIMITS", "CompiledGrammar", "GrammarBackend", "GrammarCache", "GrammarRejected", "GrammarState",
    "grammar_field", "grammar_text",
]  # fmt: skip

# JSON answers: no free whitespace between tokens (llguidance's default), which keeps a
# weak model from looping on spaces and newlines; the output is still valid JSON.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}

# llguidance.LLParserLimits for every matcher.  They make the work deterministic: a compile
# (grammar size, the lexer's initial fuel and state count) and each later mask (step fuel and
# Earley items) stop at these bounds, the grammar then failing instead of running on.  The
# values are llguidance's defaults (initial fuel ~1 s of lexer building at most, a step ~15 ms),
# written out so that an upgrade cannot loosen them; errors leave out the parser's state dump.
PARSER_LIMITS: dict[str, Any] = {
    "max_grammar_size": 500_000,
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 250_000,
    "verbose_errors": False,
}


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
        raise InvalidRequestError(grammar_field(so), f"is not valid: {e}") from None


def grammar_field(so: StructuredOutputsParams) -> str:
    """The request field that errors about this spec name."""
    kind = so.kind()
    return {"json": "response_format", "json_object": "response_format"}.get(kind, kind)


class GrammarRejected(Exception):
    """llguidance refused a grammar (invalid, or over a limit); callers add the field."""


def _first_line(message: str) -> str:
    return message.splitlines()[0][:300] if message else "unknown error"


def _set_eos(row: np.ndarray, eos: list[int]) -> None:
    for e in eos:
        row[e >> 5] |= np.int32(np.uint32(1 << (e & 31)).view(np.int32))


class CompiledGrammar:
    """A matcher at the start of its grammar with the lexer built (its first mask was
    computed): the template every request with this grammar copies.  Never advanced."""

    def __init__(self, matcher: Any, words: int, eos_token_ids: list[int]):
        self._m = matcher
        self.words = words
        self.eos = eos_token_ids

    def new_state(self, field: str = "structured_outputs") -> "GrammarState":
        """A request's own matcher (a copy: microseconds, the lexer is shared)."""
        return GrammarState(self._m.deep_copy(), self.words, self.eos, field)


CacheKey = tuple  # (partition, grammar text): partition None is the common one


class _Compile:
    """One compile of one grammar text in one partition, shared by every request waiting for it."""

    __slots__ = ("key", "future", "waiters")

    def __init__(self, key: CacheKey):
        self.key = key
        self.future: Future = Future()  # CompiledGrammar, or GrammarRejected
        self.waiters = 0

    @property
    def text(self) -> str:
        return self.key[1]


class GrammarCache:
    """Compiled grammars by (partition, grammar text): finished ones (LRU, at most ``max_entries``;
    refusals are kept too, so a bad grammar is not compiled again) and those in flight.

    A compile runs once however many requests ask for it at the same time.  Each
    ``join`` is paired with a ``leave``; when the last waiter leaves a compile that has
    not started, it is dropped; one that is running finishes (its limits bound it) and
    its result is discarded, not cached."""

    def __init__(self, build: Callable[[str], CompiledGrammar], max_entries: int = 64):
        self._build = build
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._done: OrderedDict[CacheKey, CompiledGrammar | str] = OrderedDict()  # str: why it was refused
        self._running: dict[CacheKey, _Compile] = {}
        self.num_compiles = 0  # compiles started

    def __len__(self) -> int:
        return len(self._done)

    def join(self, text: str, executor: Executor | None, partition: str | None = None) -> _Compile:
        """The compile of ``text`` for requests of ``partition``: from the cache, the one in
        flight, or a new one started in ``executor`` (None: run here, in the calling thread,
        before returning).  Only requests of the same partition share a compile."""
        key = (partition, text)
        with self._lock:
            hit = self._done.get(key)
            job = self._running.get(key)
            start = hit is None and job is None
            if hit is not None:
                self._done.move_to_end(key)
                job = _Compile(key)
                if isinstance(hit, str):
                    job.future.set_exception(GrammarRejected(hit))
                else:
                    job.future.set_result(hit)
            elif job is None:
                job = self._running[key] = _Compile(key)
            job.waiters += 1
        if start:
            if executor is None:
                self._run(job)
            else:
                try:
                    executor.submit(self._run, job)
                except RuntimeError as e:  # the executor is shut down (the server is stopping)
                    self._forget(job)
                    job.future.set_exception(e)
        return job

    def leave(self, job: _Compile) -> None:
        """A waiter is done with ``job`` (it has its result, or gave up)."""
        with self._lock:
            job.waiters -= 1
            if job.waiters == 0 and job.future.cancel():  # never started: nobody wants it now
                if self._running.get(job.key) is job:
                    del self._running[job.key]

    def get(self, text: str, partition: str | None = None) -> CompiledGrammar:
        """Compile (or find) ``text`` of ``partition`` in this thread; raises GrammarRejected."""
        job = self.join(text, None, partition)
        try:
            return job.future.result()
        finally:
            self.leave(job)

    def _forget(self, job: _Compile) -> None:
        with self._lock:
            if self._running.get(job.key) is job:
                del self._running[job.key]

    def _run(self, job: _Compile) -> None:
        if not job.future.set_running_or_notify_cancel():
            return  # dropped before it started
        with self._lock:
            self.num_compiles += 1
        try:
            result: CompiledGrammar | GrammarRejected = self._build(job.text)
        except GrammarRejected as e:
            result = e
        except BaseException as e:  # a bug, not the grammar's fault: not cached
            self._forget(job)
            job.future.set_exception(e)
            return
        with self._lock:
            if self._running.get(job.key) is job:
                del self._running[job.key]
            if job.waiters > 0:  # a compile every waiter gave up on is not kept
                self._done[job.key] = str(result) if isinstance(result, GrammarRejected) else result
                while len(self._done) > self.max_entries:
                    self._done.popitem(last=False)
        if isinstance(result, GrammarRejected):
            job.future.set_exception(result)
        else:
            job.future.set_result(result)


class GrammarBackend:
    """The llguidance view of the engine's tokenizer, grammar compilation and its cache."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...], cache_entries: int = 64):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tok = None
        self._lock = threading.Lock()  # the conversion may be asked for from several threads
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row
        self.cache = GrammarCache(self.build, cache_entries)

    @property
    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                import llguidance.hf

                eos = self._eos[0] if len(self._eos) == 1 else (self._eos or None)
                self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=eos)
            return self._tok

    @staticmethod
    def text(so: StructuredOutputsParams, max_chars: int) -> str:
        """The grammar text of ``so`` (with the partition, the cache key); InvalidRequestError naming the field
        when it is bad or longer than ``max_chars``."""
        text = grammar_text(so)
        if len(text) > max_chars:
            raise InvalidRequestError(
                grammar_field(so),
                f"is {len(text)} characters as a grammar; this server compiles at most {max_chars} "
                "(server.grammar_max_chars)",
            )
        return text

    def build(self, text: str) -> CompiledGrammar:
        """Compile ``text`` (slow: run it off the engine thread); GrammarRejected if bad."""
        import llguidance

        limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        m = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=limits)
        if m.is_error():
            raise GrammarRejected(f"cannot be compiled: {_first_line(m.get_error())}")
        row = np.zeros(self.words, dtype=np.int32)
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)  # builds the lexer, here and not in a step
        if m.is_error():
            raise GrammarRejected(f"is over this server's grammar limits: {_first_line(m.get_error())}")
        if not row.any():
            raise GrammarRejected("allows no output at all")
        return CompiledGrammar(m, self.words, self._eos)

    def compile(self, so: StructuredOutputsParams, max_chars: int, partition: str | None = None) -> CompiledGrammar:
        """Compile ``so`` in this thread, through ``partition``'s part of the cache (the
        offline engine); InvalidRequestError naming the field if it is bad."""
        try:
            return self.cache.get(self.text(so, max_chars), partition)
        except GrammarRejected as e:
            raise InvalidRequestError(grammar_field(so), str(e)) from None

    async def compile_async(self, text: str, field: str, executor: Executor, timeout_s: float,
                            partition: str | None = None) -> CompiledGrammar:  # fmt: skip
        """Compile ``text`` in ``executor``, through ``partition``'s part of the cache, waiting
        at most ``timeout_s``.
        InvalidRequestError naming ``field`` if it is bad or the wait runs out.  A cancelled
        wait leaves the compile: dropped if it has not started and nobody else waits."""
        job = self.cache.join(text, executor, partition)
        waiting = asyncio.wrap_future(job.future)
        waiting.add_done_callback(_retrieve)
        try:
            return await asyncio.wait_for(asyncio.shield(waiting), timeout_s)
        except TimeoutError:
            raise InvalidRequestError(
                field, f"did not compile within {timeout_s:g} s (server.grammar_compile_timeout_s)"
            ) from None
        except GrammarRejected as e:
            raise InvalidRequestError(field, str(e)) from None
        finally:
            self.cache.leave(job)


def _retrieve(f: asyncio.Future) -> None:
    """Mark a shielded wait's outcome as seen (its waiter may have gone)."""
    if not f.cancelled():
        f.exception()


class GrammarState:
    """One request's matcher: masks at its verified positions, advanced on commit.

    ``field`` names the request field in the error that ends the request when the
    grammar cannot go on."""

    def __init__(self, matcher: Any, words: int, eos_token_ids: list[int], field: str = "structured_outputs"):
        self.m = matcher
        self.words = words
        self.eos = eos_token_ids
        self.field = field
        self._dead: int | None = None  # this step: the first position where the grammar allowed nothing

    def _fill(self, row: np.ndarray) -> bool:
        """The mask at the matcher's position; False when the grammar allows no token there
        (an error state: llguidance then allows only EOS).  Such a row holds EOS so the
        logits stay finite; the request fails when it commits that position (``advance``)."""
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self.m.is_error() or not row.any():
            row[:] = 0
            _set_eos(row, self.eos)
            return False
        return True

    def masks(self, drafts: list[int]) -> tuple[np.ndarray, int]:
        """Bitmasks (n+1, W) int32 for the positions after the committed tokens and after
        each accepted prefix of ``drafts``, and n: how many drafts the grammar allows in a
        row.  Drafts from the first refused one on cannot be emitted; only n+1 rows are
        returned.  The matcher is left as it was."""
        rows = np.zeros((len(drafts) + 1, self.words), dtype=np.int32)
        self._dead = None
        n = 0
        if not self._fill(rows[0]):
            self._dead = 0
        else:
            for d in drafts:
                if not (int(rows[n][d >> 5]) >> (d & 31)) & 1 or not self.m.consume_token(d):
                    break
                n += 1
                if not self._fill(rows[n]):
                    self._dead = n
                    break
        if n:
            self.m.rollback(n)
        return rows[: n + 1], n

    def advance(self, tokens: list[int]) -> None:
        """Consume the tokens a step emitted (after verification).  Raises
        RequestFailedError when the grammar cannot take them: a token it refuses, an error
        state, or a position where it allowed nothing (the token there was a stand-in)."""
        dead, self._dead = self._dead, None
        for i, t in enumerate(tokens):
            if i == dead or self.m.is_error():
                self._fail(t)
            if self.m.is_stopped():  # the grammar is complete: only EOS follows
                break
            if not self.m.consume_token(t):
                self._fail(t)

    def _fail(self, token: int) -> None:
        why = _first_line(self.m.get_error()) if self.m.is_error() else "it allows no next token"
        log.warning("grammar failed at token %d: %s", token, why)
        raise RequestFailedError(f"{self.field}: generation stopped because the output cannot follow the grammar ({why})")

    @property
    def error(self) -> str:
        return self.m.get_error() if self.m.is_error() else ""
