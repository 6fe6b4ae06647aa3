"""Async facade over ``LLMEngine``: the engine steps in one background thread;
callers on any asyncio loop get per-request async streams.

Adds and aborts are queued to the engine thread and applied between steps, so
the engine itself stays single-threaded.  A consumer that stops iterating
(client gone, task cancelled, deadline) aborts its request; the engine frees
its KV blocks at the start of the next step.

Request ids: the caller's id is unique among requests in flight HERE; inside
the engine each request runs under an internal id (caller id + a counter), so
the caller's id is free again the moment its stream ends, even while the
engine has not yet processed the abort.

Failures: a failure while handling ONE request (admission, sampling,
detokenization) ends that request's stream with its error and the engine
carries on; only a failing step (the forward) marks the engine unhealthy, and
then every in-flight request gets a final output with ``error`` set: nothing
hangs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specserve.config import Config
from specserve.engine.engine import LLMEngine
from specserve.engine.output import OutputProcessor
from specserve.engine.stats import StatsListener
from specserve.errors import (
    EngineDeadError,
    EngineDrainingError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    SpecServeError,
)
from specserve.request import FinishReason, RequestOutput, SamplingParams, SpecDecodeStats

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_prompt_tokens: int

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int):
        self.engine = engine
        engine.detokenize = False  # each stream detokenizes in its consumer's thread (generate)
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        self.max_queue = max_queue
        self.healthy = True
        self.failure: str | None = None
        self._draining = False
        self._stop = False
        self._cv = threading.Condition()
        self._adds: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[tuple[str, FinishReason]] = []
        self._streams: dict[str, _Stream] = {}  # internal id -> stream
        self._active: dict[str, str] = {}  # caller's id -> internal id, while its stream is open
        self._counter = 0
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ facade
    def add_stats_listener(self, listener: StatsListener) -> None:
        self.engine.listeners.append(listener)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
            self._thread.start()

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + len(self._adds)

    @property
    def kv_cache_usage(self) -> float:
        return self.engine.kv_cache_usage

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def output_room(self, prompt_tokens: int) -> int:
        """The most tokens a request with this many prompt tokens may ask for (``LLMEngine.output_room``)."""
        return self.engine.output_room(prompt_tokens)

    @property
    def grammar_backend(self):
        """The engine's grammar compiler and cache (``specserve.structured``): callers compile
        in their own threads and pass the result on ``SamplingParams.compiled_grammar``."""
        return self.engine.grammar_backend

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if self._draining:
            raise EngineDrainingError("the server is shutting down")
        if not self.healthy:
            raise EngineDeadError(f"the engine has failed: {self.failure}")
        with self._cv:
            if request_id in self._active:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
            self._counter += 1
            internal = f"{request_id}#{self._counter}"
            prompt_token_ids = params.truncate_prompt(list(prompt_token_ids), self.engine.max_model_len)
            self.engine.validate_request(internal, prompt_token_ids, params)
            if self.num_waiting >= self.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests); retry later")
            stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), len(prompt_token_ids))
            self._streams[internal] = stream
            self._active[request_id] = internal
            self._adds.append((internal, list(prompt_token_ids), params))
            self._cv.notify()
        proc = OutputProcessor(self.tokenizer, prompt_token_ids, params)
        finished = False
        end_reason = FinishReason.ABORT  # how the engine request ends if the stream closes early
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine has already dropped the request
                    raise item
                try:
                    out, stop = proc.process(item)
                except Exception as e:  # detokenizing or stop matching failed: this request only
                    log.exception("output processing of %s failed", request_id)
                    raise RequestFailedError(
                        f"the request failed while detokenizing its output: {type(e).__name__}: {e}"
                    ) from e
                if stop:  # a stop string: the engine must stop generating (reason stop)
                    end_reason = FinishReason.STOP
                finished = item.finished and not stop
                out.request_id = request_id  # the engine's internal id never leaves this module
                yield out
                if out.finished:
                    return
                # Queue.get() does not suspend while outputs are queued: a consumer with a
                # backlog would otherwise keep every other task (/health, streams) waiting.
                await asyncio.sleep(0)
        finally:
            with self._cv:
                if not finished:
                    self._aborts.append((internal, end_reason))
                    self._cv.notify()
                self._streams.pop(internal, None)
                self._active.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort the caller's request ``request_id`` (no-op if it is not in flight)."""
        with self._cv:
            internal = self._active.get(request_id)
            if internal is not None:
                self._aborts.append((internal, FinishReason.ABORT))
                self._cv.notify()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests, let in-flight ones finish for up to `timeout_s`,
        then abort the rest (they end with finish_reason abort)."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self.healthy:
            await asyncio.sleep(0.01)
        with self._cv:
            self._aborts.extend((rid, FinishReason.ABORT) for rid in self._streams)
            self._cv.notify()
        end = time.monotonic() + 5.0
        while self._streams and time.monotonic() < end:
            await asyncio.sleep(0.01)

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        eng = self.engine
        while True:
            with self._cv:
                while not (self._stop or self._adds or self._aborts or eng.has_unfinished()):
                    self._cv.wait()
                if self._stop:
                    break
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            try:
                for rid, ids, params in adds:
                    try:
                        eng.add_request(rid, ids, params)
                    except SpecServeError as e:
                        self._deliver_error(rid, e)
                    except Exception as e:  # add_request wraps its own failures; a backstop
                        log.exception("admitting %s failed", rid)
                        self._deliver_error(rid, RequestFailedError(f"admitting the request failed: {e}"))
                for rid, reason in aborts:
                    out = eng.abort_request(rid, reason)
                    if out is not None:
                        self._deliver(out)
                for out in eng.step():
                    self._deliver(out)
            except Exception as e:  # an engine bug or device error: fail loudly, never hang
                log.exception("engine step failed")
                self._fail(f"{type(e).__name__}: {e}")
                break
        # Shutdown: end whatever is still in flight.
        for rid in list(eng.requests):
            out = eng.abort_request(rid)
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put(out.failure if out.failure is not None else out)

    def _deliver_error(self, rid: str, e: BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            stream.put(e)

    def _fail(self, message: str) -> None:
        self.healthy = False
        self.failure = message
        # Release engine state first so nothing leaks even though the loop stops.
        for rid in list(self.engine.requests):
            try:
                self.engine.abort_request(rid)
            except Exception:  # the engine is already broken; best effort
                log.exception("abort after failure")
        for rid, stream in list(self._streams.items()):
            stream.put(
                RequestOutput(
                    request_id=rid, new_token_ids=[], new_text="", token_ids=[], text="", finished=True,
                    finish_reason=FinishReason.ABORT, num_prompt_tokens=stream.num_prompt_tokens,
                    spec=SpecDecodeStats(), error=message,
                )
            )


def build_async_engine(cfg: Config) -> AsyncEngine:
    return AsyncEngine(LLMEngine(cfg), cfg.server.max_queue)
