"""The OpenAI endpoints' request features and response shapes.

Parsing (:func:`parse_features`) turns the body's fields (n / best_of, echo,
log-probabilities, penalties, logit_bias, min_tokens, structured outputs, speculation) into
``SamplingFields`` extras plus the fan-out.  :func:`serve_choices` is the one
response path of both endpoints: it runs one engine request per choice (``n``
copies of each prompt, or ``best_of`` candidates of which the ``n`` with the
highest cumulative log-probability are returned; a plain request is one choice),
concurrently, and answers with OpenAI's shapes, streamed (chunks of all choices
interleaved, each with its ``index``) or not.  Choice ``index`` = prompt index * n
+ copy, as OpenAI numbers them.  The copies of one prompt share its KV blocks
through the prefix cache (the scheduler lets a copy wait one step for the blocks
another copy is computing).

Seeds: with ``seed`` s and several copies, copy i samples with seed s + i (vLLM's
rule), so the copies differ and the whole answer is reproducible.

Usage counts the prompt once per prompt and the completion tokens each choice
returns: when a stop string cuts the text, the tokens generated past it (they
arrive in the same step) are not counted, nor shown in ``logprobs``.

Log-probabilities are the target's, after the request's penalties/bias/grammar,
before temperature and top-k/top-p (``specserve.sampling.logits_controls``);
-inf (a token a grammar forbids) is sent as -9999.0.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from specserve.errors import InvalidRequestError
from specserve.request import (
    MAX_LOGPROBS,
    SEED_MAX,
    RequestOutput,
    SamplingParams,
    SpeculationParams,
    StructuredOutputsParams,
)
from specserve.sampling.logits_controls import LOGPROB_FLOOR
from specserve.server.errors import INTERNAL, classify, openai_error_body

log = logging.getLogger("specserve.server.http")

MAX_N = 16  # choices (n, best_of) per prompt
MAX_PROMPTS = 64  # prompts in one completions request
COMPLETIONS_MAX_LOGPROBS = 5  # OpenAI's limit for /v1/completions logprobs


@dataclass
class Features:
    fields: dict[str, Any] = field(default_factory=dict)  # extra SamplingFields
    n: int = 1
    best_of: int = 1
    echo: bool = False
    logprobs: int | None = None  # top-k per token, None = no logprobs in the answer


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidRequestError(name, f"must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise InvalidRequestError(name, f"must be in [{lo}, {hi}], got {v}")
    return v


def _structured(body: dict) -> StructuredOutputsParams | None:
    specs: list[tuple[str, StructuredOutputsParams]] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise InvalidRequestError("response_format", 'type must be "text", "json_object" or "json_schema"')
        if rf["type"] == "json_object":
            specs.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise InvalidRequestError("response_format", "json_schema.schema must be a JSON schema object")
            specs.append(("response_format", StructuredOutputsParams(json=schema)))
    so = body.get("structured_outputs")  # vLLM's extension: {json | regex | choice | grammar}
    if so is not None:
        if not isinstance(so, dict) or not so:
            raise InvalidRequestError("structured_outputs", "must be an object with one of json, regex, choice, grammar")
        unknown = set(so) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise InvalidRequestError("structured_outputs", f"unknown keys {sorted(unknown)}")
        specs.append(("structured_outputs", StructuredOutputsParams(**so)))
    for key, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):  # fmt: skip
        if body.get(key) is not None:  # vLLM's older names
            specs.append((key, StructuredOutputsParams(**{kind: body[key]})))
    if not specs:
        return None
    if len(specs) > 1:
        raise InvalidRequestError(specs[1][0], f"only one structured output may be given; {specs[0][0]} is set too")
    name, spec = specs[0]
    try:
        kind = spec.kind()
    except InvalidRequestError as e:
        raise InvalidRequestError(name, str(e).split(": ", 1)[-1]) from None
    if kind == "json" and isinstance(spec.json, str):
        try:
            spec.json = json.loads(spec.json)
        except ValueError as e:
            raise InvalidRequestError(name, f"the JSON schema is not valid JSON: {e}") from None
    return spec


def parse_features(body: dict, chat: bool) -> Features:
    f = Features()
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens"):
        if body.get(name) is not None:
            f.fields[name] = body[name]
    so = _structured(body)
    if so is not None:
        f.fields["structured_outputs"] = so
    f.n = _int(body, "n", 1, MAX_N) or 1
    if chat:
        if body.get("echo"):
            raise InvalidRequestError("echo", "is not supported for chat completions")
        if body.get("best_of") not in (None, 1):  # OpenAI's chat API has none; vLLM's V1 engine neither
            raise InvalidRequestError("best_of", "is not supported for chat completions; use /v1/completions")
        f.best_of = f.n  # one candidate per choice
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise InvalidRequestError("logprobs", f"must be a boolean, got {type(lp).__name__}")
        top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and top > 0 and not lp:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        f.logprobs = (top or 0) if lp else None
    else:
        f.best_of = _int(body, "best_of", 1, MAX_N) or f.n
        if f.best_of < f.n:
            raise InvalidRequestError("best_of", f"must be >= n ({f.n}), got {f.best_of}")
        if f.best_of > f.n and body.get("stream"):
            raise InvalidRequestError("best_of", "cannot be used with stream: true (the best are known at the end)")
        f.logprobs = _int(body, "logprobs", 0, COMPLETIONS_MAX_LOGPROBS)
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise InvalidRequestError("echo", f"must be a boolean, got {type(echo).__name__}")
        f.echo = bool(echo)
    if f.logprobs is not None:
        f.fields["logprobs"] = f.logprobs
    if body.get("speculation") is not None:  # the request's own cap on drafts (SamplingParams checks k)
        f.fields["speculation"] = SpeculationParams.from_dict(body["speculation"])
    return f


async def completion_prompts(fe: Any, body: dict, add_special_tokens: bool = True,
                             truncate: int | None = None) -> tuple[list[list[int]], list[str | None]]:  # fmt: skip
    """The prompts of a completions request (a string, token ids, or a list of either) and
    their texts (None where given as ids); vLLM's ``add_special_tokens`` and
    ``truncate_prompt_tokens`` applied (a truncated prompt's text is its tokens' decode)."""
    if "prompt" not in body or body["prompt"] is None:
        raise InvalidRequestError("prompt", "is required")
    prompt = body["prompt"]

    async def text(p: str) -> list[int]:
        return await fe.tokenize_prompt_async(p, add_special_tokens, truncate)

    def shown(p: str, ids: list[int]) -> str | None:
        return p if truncate is None else None  # echo shows the tokens used

    if isinstance(prompt, str):
        ids = await text(prompt)
        return [ids], [shown(prompt, ids)]
    if isinstance(prompt, list):
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [fe.check_token_ids(prompt, field="prompt", truncate=truncate)], [None]
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequestError("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        ids, texts = [], []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                ids.append(await text(p))
                texts.append(shown(p, ids[-1]))
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                ids.append(fe.check_token_ids(p, field=f"prompt[{i}]", truncate=truncate))
                texts.append(None)
            else:
                raise InvalidRequestError("prompt", "must be a string, a list of token ids, or a list of either")
        return ids, texts
    raise InvalidRequestError("prompt", "must be a string, a list of token ids, or a list of either")


# --------------------------------------------------------------------------- log-probability shapes


class TokenText:
    """Token id -> the text and bytes OpenAI shows for it."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, t: int) -> tuple[str, list[int]]:
        got = self.cache.get(t)
        if got is None:
            text = self.tok.decode([t], skip_special_tokens=False)
            got = (text, list(text.encode("utf-8", errors="replace")))
            self.cache[t] = got
        return got


def _lp(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR


def completion_logprobs(tt: TokenText, lps: list, offset0: int = 0) -> dict[str, Any]:
    """OpenAI's completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = offset0
    for e in lps:
        if e is None:  # the first prompt token (echo)
            continue
        text = tt(e.token_id)[0]
        tokens.append(text)
        token_lps.append(_lp(e.logprob))
        tops.append({tt(i)[0]: _lp(v) for i, v in e.top} if e.top else None)
        offsets.append(off)
        off += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_entries(tt: TokenText, ids: list[int], lps: list) -> tuple[list[str], list, list, list[int]]:
    """Echo: the prompt's tokens with their log-probabilities (the first has none)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = 0
    for i, t in enumerate(ids):
        e = lps[i] if i < len(lps) else None
        text = tt(t)[0]
        tokens.append(text)
        token_lps.append(None if e is None else _lp(e.logprob))
        tops.append(None if e is None else {tt(j)[0]: _lp(v) for j, v in e.top})
        offsets.append(off)
        off += len(text)
    return tokens, token_lps, tops, offsets


def chat_logprobs(tt: TokenText, lps: list) -> dict[str, Any]:
    content = []
    for e in lps:
        text, b = tt(e.token_id)
        content.append({
            "token": text, "logprob": _lp(e.logprob), "bytes": b,
            "top_logprobs": [{"token": tt(i)[0], "logprob": _lp(v), "bytes": tt(i)[1]} for i, v in e.top],
        })  # fmt: skip
    return {"content": content, "refusal": None}


# --------------------------------------------------------------------------- choices and their requests


@dataclass
class _Job:
    """One engine request: a choice (or a best_of candidate) of one prompt."""

    index: int  # choice index (or candidate index with best_of)
    prompt: int
    req: Any  # PreparedRequest
    last: RequestOutput | None = None
    prompt_lps: list | None = None  # echo: the prompt's log-probabilities, when they arrive
    sent_echo: bool = False
    sent_prompt_lps: bool = False

    def record(self, out: RequestOutput) -> None:
        self.last = out
        if out.prompt_logprobs is not None:
            self.prompt_lps = out.prompt_logprobs


def _child_seed(seed: int, i: int) -> int:
    return seed + i if seed + i <= SEED_MAX else seed - i


def _jobs(fe: Any, request_id: str, tenant: str | None, prompts: list[list[int]], params: SamplingParams,
          f: Features) -> list[_Job]:  # fmt: skip
    """One engine request per choice (and best_of candidate).  A lone one runs under the
    response's request id; several run under it plus their prompt and copy numbers, with
    the response's id claimed by the caller (``Frontend.claimed``)."""
    per = f.best_of
    single = len(prompts) == 1 and per == 1
    jobs = []
    for p, ids in enumerate(prompts):
        for c in range(per):
            sp = copy.copy(params)
            if params.seed is not None and c:
                sp.seed = _child_seed(params.seed, c)
            if per > f.n and sp.logprobs is None:
                sp.logprobs = 0  # best_of ranks by cumulative log-probability
            if f.echo and f.logprobs is not None:
                sp.prompt_logprobs = max(f.logprobs, sp.prompt_logprobs or 0)
            rid = request_id if single else f"{request_id}-{p}-{c}"
            jobs.append(_Job(p * per + c, p, fe.prepare(rid, ids, sp, tenant, claim=single)))
    return jobs


async def _consume(fe: Any, job: _Job, queue: asyncio.Queue) -> None:
    """Feed one job's outputs into ``queue``; then None, or the exception that ended it."""
    try:
        async with aclosing(fe.stream(job.req)) as outputs:
            async for out in outputs:
                job.record(out)
                queue.put_nowait((job, out))
    except Exception as exc:  # handed to the reader, which raises it
        queue.put_nowait(exc)
    else:
        queue.put_nowait(None)


async def _outputs(fe: Any, jobs: list[_Job]) -> AsyncIterator[tuple[_Job, RequestOutput]]:
    """Every job's outputs as they arrive (recorded on the job); the first failure is raised.

    Closing this generator (a disconnected client, a failure) aborts every job."""
    if len(jobs) == 1:  # one choice: read its stream in this task, no queue
        job = jobs[0]
        async with aclosing(fe.stream(job.req)) as outputs:
            async for out in outputs:
                job.record(out)
                yield job, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_consume(fe, j, queue)) for j in jobs]
    try:
        running = len(jobs)
        while running:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# --------------------------------------------------------------------------- response shapes


def _finish(out: RequestOutput) -> str | None:
    return out.finish_reason.value if out.finished and out.finish_reason is not None else None


def _cumulative(out: RequestOutput) -> float:
    return sum(e.logprob for e in (out.logprobs or []))


def _spec_decode(outs: list[RequestOutput], cap: int) -> dict[str, Any]:
    """spec_decode of one request, or summed over the choices of a response; ``cap``: the
    most drafts per step its requests could verify (``Frontend.speculation_cap``)."""
    d = sum(o.spec.num_drafts for o in outs)
    a = sum(o.spec.num_accepted_tokens for o in outs)
    return {"num_speculative_tokens": cap, "num_drafts": d,
            "num_draft_tokens": sum(o.spec.num_draft_tokens for o in outs), "num_accepted_tokens": a,
            "mean_acceptance_length": 1.0 + a / d if d else 1.0}  # fmt: skip


class Shaper:
    """OpenAI's objects for one response: chat or completions, whole or streamed, any number
    of choices."""

    def __init__(self, chat: bool, fe: Any, f: Features, texts: list[str | None], prompts: list[list[int]],
                 spec_cap: int = 0, request_id: str | None = None, prompt_logprobs: int | None = None):  # fmt: skip
        self.chat, self.f, self.texts, self.prompts = chat, f, texts, prompts
        self.spec_cap = spec_cap  # spec_decode.num_speculative_tokens: every choice shares it
        self.request_id = request_id or uuid.uuid4().hex  # the client's, or one made up
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{self.request_id}"
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs: shown with k alternatives
        self.model = fe.model_name
        self.created = int(time.time())
        self.tok = fe.engine.tokenizer
        self.tt = TokenText(self.tok)

    # ---------------------------------------------------------------- envelopes

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _chunk_envelope(self) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion")

    def full(self, jobs: list[_Job]) -> dict[str, Any]:
        """The whole response; with best_of, each prompt's n most likely candidates."""
        for j in jobs:
            assert j.last is not None and j.last.finished, "the engine ended a stream without a final output"
        f = self.f
        if f.best_of > f.n:
            choices = []
            for p in range(len(self.prompts)):
                cands = [j for j in jobs if j.prompt == p]
                best = sorted(cands, key=lambda j: _cumulative(j.last), reverse=True)[: f.n]
                choices += [self._full_choice(p * f.n + r, j) for r, j in enumerate(best)]
        else:
            choices = [self._full_choice(j.index, j) for j in jobs]
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        body.update(choices=choices, usage=self.usage(jobs),
                    spec_decode=_spec_decode([j.last for j in jobs], self.spec_cap))
        if self.chat and self.prompt_logprobs is not None:  # vLLM: one list, at the top of a chat response
            body["prompt_logprobs"] = self._prompt_logprobs(jobs[0])
        return body

    def _prompt_logprobs(self, job: _Job) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token (None for the first) a map of token id
        -> {logprob, rank, decoded_token}: the prompt's token and the k most likely."""
        if self.prompt_logprobs is None:
            return None
        k = self.prompt_logprobs
        out: list[dict[str, Any] | None] = []
        for e in job.prompt_lps or []:
            if e is None:
                out.append(None)
                continue
            entry = {str(t): {"logprob": _lp(v), "rank": r, "decoded_token": self.tt(t)[0]}
                     for r, (t, v) in enumerate(e.top[:k], start=1)}  # fmt: skip
            if str(e.token_id) not in entry:
                entry[str(e.token_id)] = {"logprob": _lp(e.logprob), "rank": e.rank,
                                          "decoded_token": self.tt(e.token_id)[0]}  # fmt: skip
            out.append(entry)
        return out

    def chunk(self, job: _Job, out: RequestOutput | None, include_usage: bool) -> dict[str, Any]:
        """A stream chunk for one choice; ``out=None`` is the chat role preamble."""
        body = self._chunk_envelope()
        body["choices"] = [self._chunk_choice(job, out)]
        if include_usage:
            body["usage"] = None
        if out is not None and out.finished:
            body["spec_decode"] = _spec_decode([out], self.spec_cap)
        return body

    def usage_chunk(self, jobs: list[_Job]) -> dict[str, Any]:
        body = self._chunk_envelope()
        body.update(choices=[], usage=self.usage(jobs), spec_decode=_spec_decode([j.last for j in jobs], self.spec_cap))
        return body

    def usage(self, jobs: list[_Job]) -> dict[str, Any]:
        """Prompt tokens once per prompt; completion tokens as returned (after a stop string's
        cut: the output's ``token_ids``), over every choice (and every best_of candidate: all
        were generated)."""
        prompt = sum({j.prompt: j.last.num_prompt_tokens for j in jobs}.values())
        completion = sum(len(j.last.token_ids) for j in jobs)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "completion_tokens_details": {  # Predicted Outputs, as OpenAI reports them
                "accepted_prediction_tokens": sum(j.last.spec.num_accepted_prediction_tokens for j in jobs),
                "rejected_prediction_tokens": sum(j.last.spec.num_rejected_prediction_tokens for j in jobs),
            },
        }

    # ---------------------------------------------------------------- choices

    def _prompt_text(self, p: int) -> str:
        t = self.texts[p]
        return t if t is not None else self.tok.decode(self.prompts[p])

    def _logprobs(self, job: _Job, lps: list, echo: bool) -> dict | None:
        if self.f.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(self.tt, lps)
        if not echo:
            return completion_logprobs(self.tt, lps)
        tokens, token_lps, tops, offsets = prompt_entries(self.tt, self.prompts[job.prompt], job.prompt_lps or [])
        rest = completion_logprobs(self.tt, lps, (offsets[-1] + len(tokens[-1])) if tokens else 0)
        return {"tokens": tokens + rest["tokens"], "token_logprobs": token_lps + rest["token_logprobs"],
                "top_logprobs": tops + rest["top_logprobs"], "text_offset": offsets + rest["text_offset"]}  # fmt: skip

    def _full_choice(self, index: int, job: _Job) -> dict[str, Any]:
        out = job.last
        lps = self._logprobs(job, out.logprobs or [], self.f.echo)
        if self.chat:
            message = {"role": "assistant", "content": out.text}
            return {"index": index, "message": message, "logprobs": lps, "finish_reason": _finish(out)}
        text = (self._prompt_text(job.prompt) + out.text) if self.f.echo else out.text
        choice = {"index": index, "text": text, "logprobs": lps, "finish_reason": _finish(out)}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(job)
        return choice

    def _chunk_choice(self, job: _Job, out: RequestOutput | None) -> dict[str, Any]:
        if self.chat:
            if out is None:
                return {"index": job.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}  # fmt: skip
            delta = {"content": out.new_text} if out.new_text or not out.finished else {}
            lps = self._logprobs(job, out.new_logprobs or [], False)
            return {"index": job.index, "delta": delta, "logprobs": lps, "finish_reason": _finish(out)}
        echo = self.f.echo and not job.sent_echo
        job.sent_echo = True
        text = (self._prompt_text(job.prompt) + out.new_text) if echo else out.new_text
        lps = self._logprobs(job, out.new_logprobs or [], echo)
        return {"index": job.index, "text": text, "logprobs": lps, "finish_reason": _finish(out)}


# --------------------------------------------------------------------------- serving


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def serve_choices(request: web.Request, fe: Any, chat: bool, prompts: list[list[int]],
                        texts: list[str | None], params: SamplingParams, f: Features, stream: bool,
                        include_usage: bool, tenant: str | None = None, request_id: str | None = None,
                        prompt_logprobs: int | None = None) -> web.StreamResponse:  # fmt: skip
    """Run every choice of every prompt and answer with OpenAI's shapes, whole or streamed.
    ``request_id``: the client's (vLLM's field or X-Request-Id), unique per ``tenant`` while
    in flight; the response's id is built from it."""
    shaper = Shaper(chat, fe, f, texts, prompts, fe.speculation_cap(params), fe.check_request_id(request_id),
                    prompt_logprobs)  # fmt: skip
    jobs = _jobs(fe, shaper.request_id, tenant, prompts, params, f)
    with contextlib.ExitStack() as claims:
        if not jobs[0].req.claim:  # several choices: the response's id is held for all of them
            claims.enter_context(fe.claimed(tenant, shaper.request_id))
        return await _answer(request, fe, shaper, jobs, chat, stream, include_usage)


async def _answer(request: web.Request, fe: Any, shaper: Shaper, jobs: list[_Job], chat: bool, stream: bool,
                  include_usage: bool) -> web.StreamResponse:  # fmt: skip
    async with aclosing(_outputs(fe, jobs)) as items:
        if not stream:
            async for _ in items:
                pass
            return web.json_response(shaper.full(jobs))
        # Wait for the first output before sending headers: errors raised before
        # it (queue full, bad input, draining) still get their HTTP status.
        item = await anext(items)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        try:
            if chat:
                for j in jobs:
                    await response.write(sse(shaper.chunk(j, None, include_usage)))
            while item is not None:
                job, out = item
                if out.new_text or out.new_token_ids or out.finished:
                    await response.write(sse(shaper.chunk(job, out, include_usage)))
                item = await anext(items, None)
            if include_usage:
                await response.write(sse(shaper.usage_chunk(jobs)))
        except ConnectionError:
            raise  # the client is gone; closing ``items`` aborts the requests
        except Exception as exc:  # after the headers: report in-band, as OpenAI does
            fe.record_error(exc)
            if classify(exc) is INTERNAL:
                log.error("HTTP stream failed", exc_info=exc)
            await response.write(sse(openai_error_body(exc)[1]))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
