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

What a stream shows is what the whole output is.  With stop strings, a token
(and its log-probability) is released only once the text through it has been
emitted (``detokenizer.TokenChars`` says where each token's text ends), so the
tokens of text held back for a possible stop string are held back with it; when
a stop string cuts the text, the output keeps the tokens that spell the kept
text (those whose text starts before the cut, and those of no text up to it) and
drops the rest, which were never sent.  So the streamed token ids and
log-probabilities add up to the final ones, whatever number of tokens each step
delivered, and ``token_ids`` is what usage counts.
"""

from __future__ import annotations

from typing import Any

from specserve.engine.detokenizer import IncrementalDetokenizer, TokenChars
from specserve.request import FinishReason, RequestOutput, SamplingParams


class OutputProcessor:
    """Per request: engine deltas in, outputs with ``new_text``/``text``/``token_ids`` out."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, list(params.stop), include_stop=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        self.token_ids: list[int] = []  # released: what the client has been sent
        self.logprobs: list | None = [] if params.logprobs is not None else None
        # With stop strings: tokens generated but not released, and where each one's text ends.
        self.chars = TokenChars(self.detok, prompt_token_ids) if params.stop else None
        self._held: list[int] = []
        self._held_lps: list = []
        self._ends: list[int] = []
        self._start = 0  # where the text of the first held token starts

    def process(self, out: RequestOutput) -> tuple[RequestOutput, bool]:
        """Fill ``out`` in place.  Returns (out, stop): ``stop`` is True when a stop
        string ended the request at this output while the engine had not finished it;
        ``out`` is then final with reason ``stop`` and the caller must finish the engine
        request (``finish_request(..., FinishReason.STOP)``).  ``new_token_ids`` and
        ``new_logprobs`` become the tokens released by this output."""
        new_ids = list(out.new_token_ids)
        new_lps = list(out.new_logprobs or []) if self.logprobs is not None else []
        delta, stopped = self.detok.append(new_ids, final=out.finished)
        stop = stopped and not out.finished
        if stop:
            delta += self.detok.append([], final=True)[0]
            out.finished = True
        if stopped and out.finish_reason is not FinishReason.ABORT:
            out.finish_reason = FinishReason.STOP
        ids, lps = self._release(new_ids, new_lps, out.finished, stopped)
        self.token_ids.extend(ids)
        if self.logprobs is not None:
            self.logprobs.extend(lps)
            out.new_logprobs = lps
        out.new_token_ids = ids
        out.logprobs = self.logprobs  # grows like token_ids
        out.new_text = delta
        out.text = self.detok.text
        out.token_ids = self.token_ids  # grows with the request: copy it to keep a snapshot
        return out, stop

    def _release(self, ids: list[int], lps: list, finished: bool, stopped: bool) -> tuple[list[int], list]:
        """The tokens (and log-probabilities) to send now."""
        if self.chars is None:
            return ids, lps
        self._held += ids
        self._held_lps += lps
        self._ends += self.chars.ends(ids)
        if finished and not stopped:  # EOS, length, abort: the whole output stands
            n = len(self._held)
        else:  # cut by a stop string: the tokens that spell the kept text; else those emitted
            n = self._spelling(len(self.detok.text) if stopped else self.detok.emitted, cut=stopped)
        if n == 0:
            return [], []
        out_ids, out_lps = self._held[:n], self._held_lps[:n]
        # (what is left is dropped with the processor: a cut output gets nothing more)
        self._start = self._ends[n - 1]
        del self._held[:n], self._held_lps[:n], self._ends[:n]
        return out_ids, out_lps

    def _spelling(self, chars: int, cut: bool) -> int:
        """How many held tokens spell the text up to ``chars``: through the last token whose
        text starts before ``chars`` (tokens of no text there wait for text after them, so
        where a stop string cuts never depends on how the tokens arrived).  Before a cut,
        only tokens whose text ends by ``chars``; at a cut, also one that straddles it."""
        n, start = 0, self._start
        for i, end in enumerate(self._ends):
            if not cut and end > chars:
                break
            if start < chars:
                n = i + 1
            start = end
        return n
