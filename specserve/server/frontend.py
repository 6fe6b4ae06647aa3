"""What both front ends share: admission, tokenization, defaults, the stream.

The gRPC servicer and the HTTP app translate their wire formats into a
``PreparedRequest`` here and consume ``Frontend.stream``, so validation,
queueing, health and abort-on-disconnect behave the same on both.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from specserve.config import ServerConfig
from specserve.errors import EngineDeadError, EngineDrainingError, InvalidRequestError, QueueFullError
from specserve.metrics import SpecServeMetrics
from specserve.request import RequestOutput, SamplingParams, check_text
from specserve.server.errors import EngineRequestError, UnknownModelError, classify

log = logging.getLogger("specserve.server")

MAX_NAME_CHARS = 256  # a model name or request id a client sends
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's and vLLM's default)
MAX_CACHE_SALT_CHARS = 1024


def check_name(field: str, value: str) -> None:
    """Refuse an over-long name before it is echoed in errors or logs."""
    if len(value) > MAX_NAME_CHARS:
        raise InvalidRequestError(field, f"is {len(value)} characters; at most {MAX_NAME_CHARS} are allowed")


def printable(text: str, limit: int = 256) -> str:
    """Client text made safe for a log line or an error message: control and other
    non-printable characters escaped as Python writes them, at most ``limit`` kept."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out + (f"... ({len(text) - limit} more characters)" if len(text) > limit else "")


@dataclass
class PreparedRequest:
    """One engine request as a front end hands it to ``Frontend.stream``.

    ``request_id`` is the id the client knows (echoed in replies); ids are a namespace per
    ``tenant`` (the caller's key digest, None without keys): two tenants may use the same id
    at once, one tenant may not use an id twice while it is in flight.  ``claim`` False: the
    caller has claimed the id of the response this request is one choice of
    (``Frontend.claimed``), and ``request_id`` is that id plus the choice's suffix."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str | None = None
    claim: bool = True
    answer: Any = None  # gRPC: the answer's parser (grpc_chat.GrpcAnswer) when it reads tools or reasoning

    @property
    def engine_id(self) -> str:
        """The id the engine runs it under: unique across tenants (never shown to a client)."""
        return self.request_id if self.tenant is None else f"{self.tenant[:16]}/{self.request_id}"


@dataclass
class SamplingFields:
    """Sampling fields as received; None means "not sent" and takes the default."""

    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    min_p: Any = None
    max_tokens: Any = None
    seed: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    # Logits controls, log-probabilities and structured outputs
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    min_tokens: Any = None
    logprobs: Any = None  # None = none; k = the token's log-probability + top k
    prompt_logprobs: Any = None
    structured_outputs: Any = None  # a StructuredOutputsParams
    cache_salt: Any = None  # the client's cache partition within its tenant (vLLM's field): a string
    speculation: Any = None  # a SpeculationParams (or its dict): the request's own cap on drafts per step
    # vLLM's output and vocabulary fields (SamplingParams defines them)
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    truncate_prompt_tokens: Any = None


def cache_partition(tenant: str | None, salt: Any) -> str | None:
    """The engine's cache partition (``SamplingParams.cache_salt``) of a request: its tenant
    (a digest of its API key) and its own ``cache_salt``, hashed together; None (shared with
    every other request without either) only when there is neither."""
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise InvalidRequestError("cache_salt", "must be a non-empty string")
        if len(salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError("cache_salt", f"is {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS}")
        check_text("cache_salt", salt)
        if not salt.isprintable():  # like a request id: it names a partition, never carries bytes
            raise InvalidRequestError("cache_salt", f"must not contain control characters: {printable(salt)}")
    if tenant is None and salt is None:
        return None
    # Length-prefixed parts: no (tenant, salt) pair can spell another's input.
    parts = [p.encode("utf-8") for p in (tenant or "", salt or "")]
    return hashlib.sha256(b"".join(len(p).to_bytes(4, "big") + p for p in parts)).hexdigest()


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


class HealthState:
    """SERVING unless draining or the engine has failed; notifies watchers on change."""

    def __init__(self, engine: Any):
        self._engine = engine
        self.draining = False
        self.engine_failed = False
        self._last: bool | None = None
        self._watchers: list[Callable[[bool], None]] = []

    @property
    def serving(self) -> bool:
        return not self.draining and not self.engine_failed and bool(self._engine.healthy)

    @property
    def reason(self) -> str:
        if self.draining:
            return "draining"
        if self.engine_failed or not self._engine.healthy:
            return "engine_dead"
        return "ok"

    def watch(self, callback: Callable[[bool], None]) -> None:
        self._watchers.append(callback)

    def refresh(self) -> bool:
        serving = self.serving
        if serving != self._last:
            self._last = serving
            if not serving:
                log.warning("health: NOT_SERVING (%s)", self.reason)
            for callback in self._watchers:
                callback(serving)
        return serving

    def mark_draining(self) -> None:
        self.draining = True
        self.refresh()

    def mark_engine_failed(self) -> None:
        self.engine_failed = True
        self.refresh()


class Frontend:
    def __init__(self, engine: Any, cfg: ServerConfig, metrics: SpecServeMetrics, health: HealthState):
        self.engine = engine
        self.cfg = cfg
        self.metrics = metrics
        self.health = health
        self.model_name: str = engine.info.model_name
        # Every name the model answers to: model.name first (the id in responses), then the
        # aliases (server.served_model_aliases: further served names, the path as given).
        self.served_model_names: list[str] = [self.model_name] + [
            a for a in dict.fromkeys(cfg.served_model_aliases) if a != self.model_name
        ]
        # Defaults for fields a request leaves out: the model's generation_config.json.
        self.sampling_defaults: dict[str, Any] = dict(getattr(engine.info, "sampling_defaults", None) or {})
        self._inflight: set[tuple[str | None, str]] = set()  # (tenant, request id) claimed
        self._consumers: dict[str, asyncio.Task] = {}  # engine id -> the handler task reading it
        self._failed: set[str] = set()  # engine ids whose handler was cancelled by fail_stuck_requests
        self._idle = asyncio.Event()
        self._idle.set()
        # Tokenizing and chat templating run here, never on the event loop both
        # servers share: a huge prompt must not stall other requests or health probes.
        self._pool = ThreadPoolExecutor(max_workers=cfg.tokenizer_threads, thread_name_prefix="specserve-tokenize")
        # Grammars compile in their own threads: a long compile delays neither tokenizing nor the engine.
        self._grammar_pool = ThreadPoolExecutor(max_workers=cfg.grammar_compile_threads,
                                                thread_name_prefix="specserve-grammar")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    async def run_off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run slow per-request work (tokenizing, JSON parsing) in the worker pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def check_length_bound(self, field: str, num_chars: int) -> None:
        """Refuse at once text whose character count alone proves it longer than the
        context (no tokenizer call): at least num_chars / max_token_chars tokens."""
        per_token = getattr(self.engine.tokenizer, "max_token_chars", None)
        limit = self.engine.info.max_model_len
        if per_token and num_chars > limit * per_token:
            raise InvalidRequestError(
                field,
                f"is {num_chars} characters: at least {num_chars // per_token} tokens, beyond the model's "
                f"max_model_len ({limit})",
            )

    async def tokenize_prompt_async(self, prompt: str, add_special_tokens: bool = True,
                                    truncate: int | None = None) -> list[int]:  # fmt: skip
        """A completion prompt's tokens; ``truncate`` (truncate_prompt_tokens) keeps the last
        ones, so a prompt longer than the context is not refused for its length then."""
        check_text("prompt", prompt)
        if truncate is None:
            self.check_length_bound("prompt", len(prompt))
        ids = await self.run_off_loop(self.tokenize_prompt, prompt, add_special_tokens)
        return self.truncate(ids, truncate)

    def truncate(self, ids: list[int], truncate: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the last ``truncate`` tokens (-1: max_model_len - 1)."""
        return SamplingParams(truncate_prompt_tokens=truncate).truncate_prompt(ids, self.engine.info.max_model_len)

    async def tokenize_prediction_async(self, text: str) -> list[int] | None:
        """Predicted Outputs: the expected output's tokens (no special tokens), or None for ""."""
        check_text("prediction", text)
        self.check_length_bound("prediction", len(text))
        if text == "":
            return None
        return await self.run_off_loop(lambda: list(self.engine.tokenizer.encode(text, add_special_tokens=False)))

    def _check_message_texts(self, messages: list[dict[str, str]], bounded: bool = True) -> None:
        chars = 0
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                check_text(f"messages[{i}].content", content)
                chars += len(content)
            if isinstance(m, dict) and isinstance(m.get("reasoning_content"), str):
                check_text(f"messages[{i}].reasoning_content", m["reasoning_content"])
                chars += len(m["reasoning_content"])
        if bounded:
            self.check_length_bound("messages", chars)

    async def tokenize_messages_async(self, messages: list[dict[str, Any]], add_special_tokens: bool = False,
                                      truncate: int | None = None, tools: list[dict] | None = None,
                                      template_kwargs: dict | None = None) -> list[int]:  # fmt: skip
        """A chat prompt's tokens: the template's (given ``tools`` and ``template_kwargs``), plus
        the tokenizer's own special tokens (e.g. BOS) with ``add_special_tokens`` (vLLM's field;
        off by default), the last ``truncate`` of them with truncate_prompt_tokens."""
        self._check_message_texts(messages, bounded=truncate is None)
        ids = await self.run_off_loop(self.tokenize_messages, messages, tools, template_kwargs)
        if add_special_tokens:
            ids = self.engine.tokenizer.with_special_tokens(ids)
        return self.truncate(ids, truncate)

    # ------------------------------------------------------------------ /tokenize, /detokenize

    async def tokenize_text_async(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s tokens as a completion prompt gets them (``add_special_tokens``: BOS etc.)."""
        check_text("prompt", text)
        self.check_length_bound("prompt", len(text))
        tok = self.engine.tokenizer
        return await self.run_off_loop(lambda: list(tok.encode(text, add_special_tokens=add_special_tokens)))

    async def tokenize_chat_async(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                                  add_special_tokens: bool, tools: list[dict] | None = None,
                                  template_kwargs: dict | None = None) -> list[int]:  # fmt: skip
        """The tokens of ``messages`` rendered as the chat endpoint renders them."""
        self._check_message_texts(messages)
        tok = self.engine.tokenizer

        def work() -> list[int]:
            extra = {"tools": tools, "template_kwargs": template_kwargs} if tools or template_kwargs else {}
            ids = list(tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra))
            return tok.with_special_tokens(ids) if add_special_tokens else ids

        return await self.run_off_loop(work)

    async def token_texts_async(self, ids: list[int]) -> list[str]:
        return await self.run_off_loop(self.engine.tokenizer.token_texts, ids)

    async def detokenize_async(self, ids: Any) -> str:
        """The text of token ids, special tokens included (vLLM's /detokenize); the ids are
        checked (integers in [0, vocabulary size)) off the event loop too."""
        tok = self.engine.tokenizer
        if not isinstance(ids, list):
            raise InvalidRequestError("tokens", "must be a list of integer token ids")

        def work() -> str:
            vocab = int(tok.vocab_size)
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise InvalidRequestError("tokens", f"must be integer token ids in [0, {vocab})")
            return tok.decode(ids, skip_special_tokens=False)

        return await self.run_off_loop(work)

    # ------------------------------------------------------------------ input

    def check_model(self, requested: Any) -> None:
        if requested is None or requested == "":
            return
        if not isinstance(requested, str):
            raise InvalidRequestError("model", f"must be a string, got {type(requested).__name__}")
        check_name("model", requested)
        if requested not in self.served_model_names:
            raise UnknownModelError(requested, self.model_name)  # quotes it with repr: escaped

    def tokenize_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if prompt == "":
            raise InvalidRequestError("prompt", "must not be empty")
        tok = self.engine.tokenizer
        ids = list(tok.encode(prompt) if add_special_tokens else tok.encode(prompt, add_special_tokens=False))
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty (it tokenized to no tokens)")
        return ids

    def check_token_ids(self, ids: Any, field: str = "prompt_token_ids", truncate: int | None = None) -> list[int]:
        if not isinstance(ids, list):
            raise InvalidRequestError(field, "must be a list of integer token ids")
        if not ids:
            raise InvalidRequestError(field, "must not be empty")
        ids = self.truncate(ids, truncate)
        limit = self.engine.info.max_model_len
        if len(ids) >= limit:  # before looking at millions of ids (named as the engine names it)
            raise InvalidRequestError(
                "prompt", f"is {len(ids)} tokens; the model's max_model_len is {limit} (room for output needed)"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError(field, "must be a list of integer token ids")
        vocab = getattr(self.engine.info, "vocab_size", None)
        if any(t < 0 or (vocab is not None and t >= vocab) for t in ids):
            raise InvalidRequestError(field, f"token ids must be in [0, {vocab})" if vocab else "token ids must be >= 0")
        return ids

    def tokenize_messages(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                          template_kwargs: dict | None = None) -> list[int]:  # fmt: skip
        # The tokenizer validates roles and contents (InvalidRequestError naming messages[i].role, ...).
        tok = self.engine.tokenizer
        if tools or template_kwargs:
            ids = list(tok.apply_chat_template(messages, tools=tools, template_kwargs=template_kwargs))
        else:
            ids = list(tok.apply_chat_template(messages))
        if not ids:
            raise InvalidRequestError("messages", "the chat template produced an empty prompt")
        return ids

    def output_room(self, prompt_tokens: int) -> int:
        """The most tokens a request with a ``prompt_tokens``-token prompt may generate: the
        engine's answer (what max_model_len leaves after the prompt, within what the KV cache
        holds for one request beside the drafts it verifies: ``LLMEngine.output_room``),
        within ``server.max_tokens_cap``."""
        engine_room = getattr(self.engine, "output_room", None)
        room = engine_room(prompt_tokens) if engine_room is not None else self.engine.info.max_model_len - prompt_tokens
        if self.cfg.max_tokens_cap is not None:
            room = min(room, self.cfg.max_tokens_cap)
        return room

    def default_max_tokens(self, prompt_tokens: int, completions: bool = False, prompt_field: str = "prompt") -> int:
        """max_tokens for a request that sent none: ``server.default_max_tokens`` when set,
        else 16 on ``/v1/completions`` (OpenAI's and vLLM's default there) and the whole room
        elsewhere (chat, gRPC: vLLM's max_model_len - prompt tokens); always within the room.
        A prompt that leaves no room is refused naming ``prompt_field`` (the client sent no
        max_tokens to blame)."""
        room = self.output_room(prompt_tokens)
        if room < 1:
            raise InvalidRequestError(
                prompt_field, f"is {prompt_tokens} tokens, which leaves no room for output within the model's "
                f"max_model_len ({self.engine.info.max_model_len}) and this server's KV cache; shorten it",
            )
        wanted = self.cfg.default_max_tokens
        if wanted is None:
            wanted = COMPLETIONS_DEFAULT_MAX_TOKENS if completions else room
            if not completions and "max_tokens" in self.sampling_defaults:  # the model's max_new_tokens
                wanted = self.sampling_defaults["max_tokens"]
        return max(1, min(wanted, room))

    def make_params(self, f: SamplingFields, tenant: str | None = None, prompt_tokens: int = 1,
                    completions: bool = False, prompt_field: str = "prompt") -> SamplingParams:  # fmt: skip
        """Validated parameters; ``tenant`` is the caller's (``ApiKeyChecker.authenticate``).
        ``prompt_tokens`` (the longest prompt's, for several) sizes the default max_tokens."""
        d = self.sampling_defaults  # the model's generation_config.json (model.generation_config)
        max_tokens = f.max_tokens
        if max_tokens is None:
            max_tokens = self.default_max_tokens(prompt_tokens, completions, prompt_field)
        params = SamplingParams(
            temperature=d.get("temperature", 1.0) if f.temperature is None else f.temperature,
            top_p=d.get("top_p", 1.0) if f.top_p is None else f.top_p,
            top_k=d.get("top_k", 0) if f.top_k is None else f.top_k,
            min_p=d.get("min_p", 0.0) if f.min_p is None else f.min_p,
            max_tokens=max_tokens,
            seed=f.seed,
            stop=[] if f.stop is None else f.stop,
            stop_token_ids=[] if f.stop_token_ids is None else f.stop_token_ids,
            ignore_eos=False if f.ignore_eos is None else f.ignore_eos,
            presence_penalty=0.0 if f.presence_penalty is None else f.presence_penalty,
            frequency_penalty=0.0 if f.frequency_penalty is None else f.frequency_penalty,
            repetition_penalty=d.get("repetition_penalty", 1.0) if f.repetition_penalty is None else f.repetition_penalty,
            logit_bias=f.logit_bias,
            min_tokens=0 if f.min_tokens is None else f.min_tokens,
            logprobs=f.logprobs,
            prompt_logprobs=f.prompt_logprobs,
            structured_outputs=f.structured_outputs,
            cache_salt=cache_partition(tenant, f.cache_salt),
            speculation=f.speculation,
            include_stop_str_in_output=_given(f.include_stop_str_in_output, False),
            skip_special_tokens=_given(f.skip_special_tokens, True),
            spaces_between_special_tokens=_given(f.spaces_between_special_tokens, True),
            bad_words=f.bad_words,
            allowed_token_ids=f.allowed_token_ids,
            truncate_prompt_tokens=f.truncate_prompt_tokens,
        )
        cap = getattr(self.cfg, "max_logprobs", None)  # server.max_logprobs (vLLM's --max-logprobs)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if cap is not None and isinstance(asked, int) and not isinstance(asked, bool) and asked > cap:
                raise InvalidRequestError(name, f"asks for {asked} log-probabilities per token; this server allows at "
                                                f"most {cap} (server.max_logprobs)")
        return params.validate(self.cfg.max_tokens_cap, max_speculative_tokens=self.engine.info.num_speculative_tokens)

    async def tokenize_bad_words_async(self, params: SamplingParams) -> None:
        """``params.bad_words`` tokenized as vLLM does (``bad_words_token_ids``), off the loop."""
        if params.bad_words and params.bad_words_token_ids is None:
            from specserve.engine.tokenizer import bad_words_token_ids

            tok = self.engine.tokenizer
            params.bad_words_token_ids = await self.run_off_loop(bad_words_token_ids, tok, params.bad_words)

    def speculation_cap(self, params: SamplingParams) -> int:
        """The most drafts per step the request may verify, as its ``spec_decode`` reports it:
        its own ``speculation.num_speculative_tokens``, else the server's K (0 without a method)."""
        cap = params.num_speculative_tokens
        return int(self.engine.info.num_speculative_tokens) if cap is None else cap

    @staticmethod
    def check_request_id(request_id: Any) -> str | None:
        """A client's request id (None or "": the server makes one up).  It reaches logs and
        replies: a short printable string only."""
        if request_id is None or request_id == "":
            return None
        if not isinstance(request_id, str):
            raise InvalidRequestError("request_id", f"must be a string, got {type(request_id).__name__}")
        check_name("request_id", request_id)
        if not request_id.isprintable():
            raise InvalidRequestError("request_id", f"must not contain control characters: {printable(request_id)}")
        return request_id

    def prepare(self, request_id: str | None, prompt_token_ids: list[int], params: SamplingParams,
                tenant: str | None = None, claim: bool = True) -> PreparedRequest:  # fmt: skip
        rid = self.check_request_id(request_id) if claim else request_id
        return PreparedRequest(rid or f"req-{uuid.uuid4().hex}", prompt_token_ids, params, tenant, claim)

    def _claim(self, tenant: str | None, request_id: str) -> tuple[str | None, str]:
        key = (tenant, request_id)
        if key in self._inflight:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        self._inflight.add(key)
        self._idle.clear()
        return key

    def _unclaim(self, key: tuple[str | None, str]) -> None:
        self._inflight.discard(key)
        if not self._inflight:
            self._idle.set()

    @contextlib.contextmanager
    def claimed(self, tenant: str | None, request_id: str) -> Iterator[None]:
        """Hold ``request_id`` in ``tenant``'s namespace (a response of several choices: its
        choices run as requests with ``claim=False``)."""
        key = self._claim(tenant, request_id)
        try:
            yield
        finally:
            self._unclaim(key)

    # ------------------------------------------------------------------ admission and stream

    def admit(self) -> None:
        """Refuse new work while draining or after an engine failure."""
        if self.health.draining:
            raise EngineDrainingError("the server is shutting down; retry on another replica")
        if self.health.engine_failed or not self.engine.healthy:
            self.health.mark_engine_failed()
            raise EngineDeadError("the engine has failed; this replica cannot serve requests")
        # The engine enforces server.max_queue too; checking here keeps the bound even if it did not.
        if self.engine.num_waiting >= self.cfg.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.cfg.max_queue} requests); retry later")

    async def stream(self, req: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for ``req``. Closing this generator early aborts the request.

        Raises the errors of ``classify``'s table; an output with ``error`` set
        becomes ``EngineRequestError`` (INTERNAL / 500).
        """
        self.admit()
        key = self._claim(req.tenant, req.request_id) if req.claim else None
        rid = req.engine_id
        task = asyncio.current_task()
        if task is not None:
            self._consumers[rid] = task
        try:
            params = await self.compile_grammar(req.params)
            gen = self.engine.generate(rid, req.prompt_token_ids, params)
            async with aclosing(gen):
                async for out in gen:
                    if out.error:
                        self.health.mark_engine_failed()
                        raise EngineRequestError(f"the engine failed this request: {out.error}")
                    yield out
        except EngineDeadError:
            self.health.mark_engine_failed()
            raise
        except asyncio.CancelledError:
            if rid in self._failed and task is not None:
                task.uncancel()  # our own cancellation: turn it into an INTERNAL error
                raise EngineDeadError("the engine stopped responding; the request was abandoned") from None
            raise
        finally:
            self._consumers.pop(rid, None)
            self._failed.discard(rid)
            if key is not None:
                self._unclaim(key)

    async def compile_grammar(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its structured output compiled (``compiled_grammar``), in the
        grammar threads and through the engine's cache (the request's partition of it: its
        tenant and cache_salt), so the engine thread only copies it.
        A bad grammar, one over ``grammar_max_chars`` or one still compiling after
        ``grammar_compile_timeout_s`` is an InvalidRequestError naming the field."""
        so = params.structured_outputs
        backend = getattr(self.engine, "grammar_backend", None)
        if so is None or backend is None or params.compiled_grammar is not None:
            return params
        from specserve.structured import grammar_field

        text = await self.run_off_loop(backend.text, so, self.cfg.grammar_max_chars)
        compiled = await backend.compile_async(text, grammar_field(so), self._grammar_pool,
                                               self.cfg.grammar_compile_timeout_s, params.cache_salt)  # fmt: skip
        return dataclasses.replace(params, compiled_grammar=compiled)

    def fail_stuck_requests(self) -> int:
        """After an engine failure: end requests still waiting on the dead engine with INTERNAL.

        The engine should itself deliver a final output with ``error`` set; this
        is the backstop so that no client hangs on an engine that never answers.
        """
        for rid, task in list(self._consumers.items()):
            if rid not in self._failed:
                self._failed.add(rid)
                task.cancel()
        return len(self._failed)

    def record_error(self, exc: BaseException) -> str:
        kind = classify(exc).name
        self.metrics.on_request_error(kind)
        return kind

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False
