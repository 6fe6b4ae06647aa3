"""Output processing: engine token deltas -> text, stop strings, the output so far.

The engine step emits token deltas only.  An ``OutputProcessor`` per request
turns them into text (incremental detokenisation), matches stop strings and
keeps the output token ids (a list that grows: no per-step copy).  Where it
runs is the caller's choice: the served path runs it in the thread that reads
the request's stream (``AsyncEngine.generate``, on the server's event loop), so
detokenisation never holds up the engine thread; offline ``LLMEngine.generate``
runs it right after each step.  A stop string found on the served path is one
step behind the tokens that complete it: the caller then finishes the engine
request with reason ``stop`` (vLLM's front-end detokenizer works the same way).
"""

from __future__ import annotations

from typing import Any

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.request import FinishReason, RequestOutput, SamplingParams


class OutputProcessor:
    """Per request: engine deltas in, outputs with ``new_text``/``text``/``token_ids`` out."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, list(params.stop))
        self.token_ids: list[int] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None

    def process(self, out: RequestOutput) -> tuple[RequestOutput, bool]:
        """Fill ``out`` in place.  Returns (out, stop): ``stop`` is True when a stop
        string ended the request at this output while the engine had not finished it;
        ``out`` is then final with reason ``stop`` and the caller must finish the
        engine request (``finish_request(..., FinishReason.STOP)``)."""
        self.token_ids.extend(out.new_token_ids)
        if self.logprobs is not None and out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        out.logprobs = self.logprobs  # grows like token_ids
        delta, stopped = self.detok.append(out.new_token_ids, final=out.finished)
        stop = stopped and not out.finished
        if stop:
            delta += self.detok.append([], final=True)[0]
            out.finished = True
        if stopped and out.finish_reason is not FinishReason.ABORT:
            out.finish_reason = FinishReason.STOP
        out.new_text = delta
        out.text = self.detok.text
        out.token_ids = self.token_ids  # grows with the request: copy it to keep a snapshot
        return out, stop
