"""A fake ``AsyncEngine`` for server tests: the real facade's API, no model.

Tokens are bytes shifted by one (id 0 is EOS).  The completion of a prompt is
a deterministic run of lowercase letters derived from the prompt
(``expected_completion``).  Generation proceeds in "steps": the first emits
one token (prefill); each later step proposes ``k`` drafts, accepts
``accept_pattern[step % len]`` of them and emits ``1 + accepted`` tokens, as a
speculative engine does.  Stats go to the listeners like the real engine's.

Knobs: ``step_delay_s`` (seconds per step), ``max_running`` (batch size;
the rest wait), ``max_queue`` (QueueFullError beyond), ``hold`` (a
threading.Event: while clear, running requests make no progress), ``stall``
(a request for which ``stall(prompt_ids, step)`` holds makes no progress until
it is aborted), ``fail()`` (engine death), ``drain()``.  Records: ``requests``,
``aborted``, ``finished``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from specserve.engine.output import OutputProcessor
from specserve.engine.stats import RequestFinishedStats, RequestStepStats, StepStats
from specserve.errors import EngineDeadError, EngineDrainingError, InvalidRequestError, QueueFullError
from specserve.request import FinishReason, RequestOutput, SamplingParams, SpecDecodeStats

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ModelInfo:
    model_name: str = "fake-model"
    method: str = "ngram"
    num_speculative_tokens: int = 3
    max_model_len: int = 256
    dtype: str = "float32"
    device: str = "cpu"
    lossless: bool = True


class FakeTokenizer:
    eos_token_id = 0
    vocab_size = 300

    def encode(self, text: str) -> list[int]:
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 1 for i in ids if 1 <= i <= 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Validates as specserve.engine.tokenizer.Tokenizer does, then a toy template."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages", "must be a non-empty list of {role, content}")
        parts = []
        for i, m in enumerate(messages):
            if m.get("role") not in ROLES:
                allowed = ", ".join(ROLES)
                raise InvalidRequestError(f"messages[{i}].role", f"must be one of {allowed}; got {m.get('role')!r}")
            if not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"messages[{i}].content", "must be a string")
            parts.append(f"<|{m['role']}|>{m['content']}\n")
        return self.encode("".join(parts) + "<|assistant|>")


def expected_completion(prompt_ids: list[int], n: int) -> list[int]:
    """The token ids the fake engine generates for ``prompt_ids`` (before stop handling)."""
    seed = sum(prompt_ids) % 26
    return [ord("a") + (seed + i) % 26 + 1 for i in range(n)]


def expected_text(prompt_ids: list[int], n: int) -> str:
    return FakeTokenizer().decode(expected_completion(prompt_ids, n))


@dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    generated: list[int] = field(default_factory=list)
    abort_requested: bool = False


class FakeEngine:
    def __init__(
        self,
        info: ModelInfo | None = None,
        *,
        step_delay_s: float = 0.002,
        max_running: int = 8,
        max_queue: int = 16,
        accept_pattern: tuple[int, ...] = (2, 0, 3, 1),
        kv_capacity_tokens: int = 4096,
    ):
        self.info = info or ModelInfo()
        self.tokenizer = FakeTokenizer()
        self.step_delay_s = step_delay_s
        self.max_running = max_running
        self.max_queue = max_queue
        self.accept_pattern = accept_pattern
        self.kv_capacity_tokens = kv_capacity_tokens
        self.hold = threading.Event()
        self.hold.set()  # clear() to freeze running requests
        self.stall: Callable[[list[int], int], bool] | None = None
        self.healthy = True
        self.started = False
        self.shut_down = False
        self.draining = False
        self._failure: str | None = None
        self.silent_failure = False
        self._listeners: list = []
        self._running: dict[str, _Req] = {}
        self._waiting: list[str] = []
        self.requests: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.finished: dict[str, str] = {}

    # ---------------------------------------------------------------- facade API

    def add_stats_listener(self, listener) -> None:
        self._listeners.append(listener)

    def start(self) -> None:
        self.started = True

    def shutdown(self) -> None:
        self.shut_down = True

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        used = sum(len(r.prompt_ids) + len(r.generated) for r in self._running.values())
        return min(1.0, used / self.kv_capacity_tokens)

    def abort(self, request_id: str) -> None:
        req = self._running.get(request_id) or self.requests.get(request_id)
        if req is not None:
            req.abort_requested = True

    def fail(self, message: str = "injected failure", *, silent: bool = False) -> None:
        """Engine death; ``silent``: in-flight requests never hear about it (a hung engine)."""
        self._failure = message
        self.silent_failure = silent
        self.healthy = False

    async def drain(self, timeout_s: float) -> None:
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while (self._running or self._waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        for req in list(self._running.values()):
            req.abort_requested = True
        for _ in range(400):  # the aborted ones finish within a step
            if not self._running and not self._waiting:
                break
            await asyncio.sleep(0.005)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        self._validate(prompt_token_ids, params)
        if self.draining:
            raise EngineDrainingError("the engine is draining")
        if not self.healthy:
            raise EngineDeadError(f"engine is dead: {self._failure}")
        if len(self._running) >= self.max_running and len(self._waiting) >= self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests)")
        req = _Req(request_id, list(prompt_token_ids), params)
        self.requests[request_id] = req
        finished = False
        reason = FinishReason.ABORT
        spec = SpecDecodeStats()
        try:
            self._waiting.append(request_id)
            while len(self._running) >= self.max_running or self._waiting[0] != request_id:
                await asyncio.sleep(0.002)
            self._waiting.remove(request_id)
            self._running[request_id] = req
            last_emit = time.monotonic()
            step = 0
            proc = OutputProcessor(self.tokenizer, prompt_token_ids, params)
            while True:
                await asyncio.sleep(self.step_delay_s)
                while self._frozen(req, step):
                    await asyncio.sleep(0.002)
                if not self.healthy:
                    finished = True
                    yield self._output(req, [], "", True, None, spec, error=self._failure)
                    return
                if req.abort_requested:
                    finished = True
                    yield self._output(req, [], "", True, FinishReason.ABORT, spec)
                    return
                remaining = params.max_tokens - len(req.generated)
                drafts = self.info.num_speculative_tokens if step > 0 else 0
                accepted = min(self.accept_pattern[step % len(self.accept_pattern)], drafts, remaining - 1)
                accepted = max(accepted, 0)
                new = expected_completion(req.prompt_ids, len(req.generated) + 1 + accepted)[len(req.generated) :]
                reason_now = None
                for i, tok in enumerate(new):
                    if tok in params.stop_token_ids:
                        new = new[:i]
                        reason_now = FinishReason.STOP
                        break
                req.generated.extend(new)
                if drafts:
                    spec.num_drafts += 1
                    spec.num_draft_tokens += drafts
                    spec.num_accepted_tokens += accepted
                if reason_now is None and len(req.generated) >= params.max_tokens:
                    reason_now = FinishReason.LENGTH
                now = time.monotonic()
                self._emit_step(req, len(new), drafts, accepted, step, now - last_emit)
                last_emit = now
                step += 1
                # Text, stop strings and what the client gets: the real output processor, as
                # AsyncEngine runs it.
                out, _ = proc.process(self._output(req, new, "", reason_now is not None, reason_now, spec))
                if out.finished:
                    finished = True
                    reason = out.finish_reason
                    yield out
                    return
                yield out
        finally:
            if request_id in self._waiting:
                self._waiting.remove(request_id)
            self._running.pop(request_id, None)
            if not finished or reason is FinishReason.ABORT:
                self.aborted.append(request_id)
                reason = FinishReason.ABORT
            self.finished[request_id] = reason.value
            for listener in self._listeners:
                listener.on_request_finished(
                    RequestFinishedStats(
                        request_id, reason.value, len(req.prompt_ids), len(req.generated),
                        time.monotonic() - req.arrival, spec.num_drafts, spec.num_draft_tokens,
                        spec.num_accepted_tokens,
                    )
                )  # fmt: skip

    # ---------------------------------------------------------------- helpers

    def _frozen(self, req: _Req, step: int) -> bool:
        """Whether ``req`` waits before its step ``step``: a hung engine, the hold, or its stall."""
        if self.silent_failure:
            return True
        if req.abort_requested or not self.healthy:
            return False
        return not self.hold.is_set() or (self.stall is not None and self.stall(req.prompt_ids, step))

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        params.validate(vocab_size=self.tokenizer.vocab_size)  # as LLMEngine.validate_request does
        if any(t >= self.tokenizer.vocab_size for t in prompt):
            raise InvalidRequestError("prompt_token_ids", f"ids must be < {self.tokenizer.vocab_size}")
        limit = self.info.max_model_len
        if len(prompt) >= limit:
            raise InvalidRequestError("prompt", f"{len(prompt)} tokens; the model's limit is {limit}")
        if len(prompt) + params.max_tokens > limit:
            raise InvalidRequestError("max_tokens", f"prompt + max_tokens exceeds max_model_len {limit}")

    def _emit_step(self, req: _Req, n_new: int, drafts: int, accepted: int, step: int, since_last: float) -> None:
        stats = StepStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage=self.kv_cache_usage,
            num_prompt_tokens=len(req.prompt_ids) if step == 0 else 0,
            num_generation_tokens=n_new,
            requests=[
                RequestStepStats(
                    req.request_id, n_new, drafts, accepted,
                    [i < accepted for i in range(drafts)],
                    time_to_first_token_s=(time.monotonic() - req.arrival) if step == 0 else None,
                    inter_token_latency_s=(since_last / max(n_new, 1)) if step > 0 else None,
                )
            ],
        )  # fmt: skip
        for listener in self._listeners:
            listener.on_step(stats)

    def _output(self, req, new, delta, finished, reason, spec, *, text=None, error=None) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=list(new),
            new_text=delta,
            token_ids=list(req.generated),
            text=self.tokenizer.decode(req.generated) if text is None else text,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=len(req.prompt_ids),
            spec=SpecDecodeStats(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens),
            error=error,
        )
