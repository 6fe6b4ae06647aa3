"""The offline Python API, shaped like vLLM's: ``LLM``, ``AsyncLLM`` and their outputs.

::

    from specserve import LLM, SamplingParams

    llm = LLM(model="embedded:smollm2-135m-instruct",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    for out in llm.generate(["The future of AI is"], SamplingParams(temperature=0.8, top_p=0.95)):
        print(out.prompt, out.outputs[0].text, out.spec_decode.mean_acceptance_length)

``LLM(...)`` composes the same Hydra config as the ``specserve`` command line
(its keywords become overrides: ``specserve.compat.engine_overrides``; the
result is in ``llm.config``, the overrides in ``llm.hydra_overrides``), so a
bad key fails with the command line's one-line ``ConfigError``.  Requests run
on ``LLMEngine`` (continuous batching) with the tokenizer and chat template
the servers use, so greedy output equals ``specserve-generate`` and the servers.
``SamplingParams`` here is the vLLM-spelled one (``specserve.compat.SamplingParams``, a
subclass that only translates keywords); a plain ``specserve.request.SamplingParams`` works too.

Log-probabilities: ``SamplingParams(logprobs=k)`` fills ``outputs[0].logprobs`` as vLLM
does, one ``{token_id: Logprob(logprob, rank, decoded_token)}`` per output token (the
sampled token and the k most likely), and ``cumulative_logprob``;
``prompt_logprobs=k`` fills ``GenerationOutput.prompt_logprobs`` (None for the first
prompt token).  The values are the target's (``specserve.sampling.logits_controls``).

Async: ``AsyncLLM`` streams (``async for out in llm.generate(prompt, params)``)
from an engine thread; ``await LLM.agenerate(prompts, params)`` (vLLM's ``LLM``
has no such method) runs ``generate`` off the event loop and returns the final
outputs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specserve import request
from specserve.compat import SamplingParams, compose, engine_overrides
from specserve.config import Config
from specserve.errors import InvalidRequestError
from specserve.request import RequestOutput, SpecDecodeStats, TokenLogprob

log = logging.getLogger(__name__)

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "GenerationOutput", "Logprob", "SamplingParams"]


@dataclass
class Logprob:
    """vLLM's ``Logprob``: a token's log-probability, its 1-based rank among the most
    likely tokens (None when the sampled token is not among the k requested) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]  # token id -> Logprob, for one position


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput`` fields; always ``index`` 0 here).

    ``finish_reason``: "stop" (EOS, a stop token or string), "length" (max_tokens /
    max_model_len) or "abort"; None while a streamed request is still running.
    ``new_text``/``new_token_ids``: what the latest streamed update added.  ``error``: why
    the request failed (finish_reason "abort"), e.g. its grammar could not go on.
    With ``SamplingParams(logprobs=k)``: ``logprobs`` (one dict per token of ``token_ids``)
    and ``cumulative_logprob`` (their sum); None otherwise."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    # chat with tools or a reasoning format (specserve.formats): the answer parsed out of ``text``
    # (which stays the raw text, as vLLM's): its content, reasoning and tool calls (OpenAI's shape)
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationOutput:
    """A request's result (vLLM's ``RequestOutput`` shape) plus its speculative-decoding figures.

    ``prompt`` is the text given (the rendered chat template for ``chat``; None
    for a prompt given as token ids, as in vLLM).  ``prompt_logprobs`` (with
    ``SamplingParams(prompt_logprobs=k)``): one dict per prompt token, None for the first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    spec_decode: SpecDecodeStats
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def num_drafts(self) -> int:
        return self.spec_decode.num_drafts

    @property
    def num_draft_tokens(self) -> int:
        return self.spec_decode.num_draft_tokens

    @property
    def num_accepted_tokens(self) -> int:
        return self.spec_decode.num_accepted_tokens

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per speculative step: 1 + accepted / drafts (1.0 without drafts)."""
        return self.spec_decode.mean_acceptance_length

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None when nothing was proposed."""
        s = self.spec_decode
        return s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else None


class _Logprobs:
    """Engine ``TokenLogprob`` entries -> vLLM's dicts, with each token's text decoded once."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}

    def _text(self, t: int) -> str:
        text = self.texts.get(t)
        if text is None:
            text = self.texts[t] = self.tokenizer.decode([t], skip_special_tokens=False)
        return text

    def position(self, e: TokenLogprob | None) -> PositionLogprobs | None:
        if e is None:  # the first prompt token has none
            return None
        out = {t: Logprob(lp, r, self._text(t)) for r, (t, lp) in enumerate(e.top, start=1)}
        if e.token_id not in out:  # the sampled (or prompt) token, outside the top k: its rank where known
            out[e.token_id] = Logprob(e.logprob, e.rank, self._text(e.token_id))
        return out


class _Converted:
    """One request's outputs -> ``GenerationOutput``; log-probabilities are converted as
    they arrive (a stream's cumulative list is not rebuilt at every update)."""

    def __init__(self, lp: _Logprobs, prompt: str | None, prompt_ids: list[int], params: SamplingParams):
        self.lp, self.prompt, self.prompt_ids = lp, prompt, list(prompt_ids)
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative = 0.0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.wants = params.logprobs is not None or params.prompt_logprobs is not None

    def absorb(self, out: RequestOutput) -> None:
        """Take the log-probabilities of an output (every output of the request, in order)."""
        if self.logprobs is not None:
            for e in out.new_logprobs or []:
                self.logprobs.append(self.lp.position(e))
                self.cumulative += e.logprob
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [self.lp.position(e) for e in out.prompt_logprobs]

    def __call__(self, out: RequestOutput) -> GenerationOutput:
        if out.error is not None:
            raise RuntimeError(f"request {out.request_id} failed in the engine: {out.error}")
        self.absorb(out)
        reason = out.finish_reason.value if out.finished and out.finish_reason is not None else None
        error = str(out.failure) if out.failure is not None else None
        if error is not None:
            log.warning("request %s failed: %s", out.request_id, error)
        completion = CompletionOutput(0, out.text, list(out.token_ids), reason,
                                      new_text=out.new_text, new_token_ids=list(out.new_token_ids), error=error)
        if self.logprobs is not None:
            completion.logprobs = list(self.logprobs)
            completion.cumulative_logprob = self.cumulative
        stats = SpecDecodeStats(out.spec.num_drafts, out.spec.num_draft_tokens, out.spec.num_accepted_tokens)
        return GenerationOutput(out.request_id, self.prompt, list(self.prompt_ids), [completion], out.finished, stats,
                                self.prompt_logprobs)


# --------------------------------------------------------------------------- inputs


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x
    )


def _prompt_list(prompts: Any) -> list[Any]:
    """One prompt or a list of them -> a list.  A prompt is a string, a list of token
    ids, or a dict with "prompt" or "prompt_token_ids" (vLLM's TextPrompt/TokensPrompt)."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise InvalidRequestError(
        "prompts", f"must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}"
    )


def _params_list(params: Any, n: int, defaults: dict[str, Any] | None = None) -> list[SamplingParams]:
    """``defaults``: what ``None`` means besides SamplingParams' own defaults (the model's
    generation_config.json, as vLLM's ``get_default_sampling_params``)."""
    if params is None:
        return [SamplingParams(**(defaults or {})) for _ in range(n)]
    if isinstance(params, request.SamplingParams):  # vLLM-spelled (compat's) or plain
        return [params] * n
    if isinstance(params, (list, tuple)) and all(isinstance(p, request.SamplingParams) for p in params):
        if len(params) != n:
            raise InvalidRequestError(
                "sampling_params", f"got {len(params)} for {n} prompts; give one, or one per prompt"
            )
        return list(params)
    raise InvalidRequestError("sampling_params", "must be a SamplingParams or a list of them (from specserve)")


class _Prompts:
    """Turns the accepted prompt forms into token ids with the engine's tokenizer."""

    def __init__(self, tokenizer: Any, max_model_len: int, output_room: Callable[[int], int] | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.output_room = output_room or (lambda n: max_model_len - n)

    def encode(self, prompt: Any, i: int, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError(f"prompts[{i}]", 'a dict prompt needs "prompt" or "prompt_token_ids"')
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(f"prompts[{i}]", "must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if _is_token_ids(prompt):
            return None, list(prompt)
        raise InvalidRequestError(f"prompts[{i}]", f"must be a string or a list of token ids, got {prompt!r:.60}")

    def chat(self, conversation: Any, i: int, plan: Any = None, add_special_tokens: bool = False) -> tuple[str, list[int]]:
        """A conversation rendered (OpenAI's messages: tool calls and results included), with
        the plan's tools and chat_template_kwargs (``add_special_tokens``: the tokenizer's own,
        e.g. BOS, around it)."""
        from specserve.formats.chat import template_messages

        messages = template_messages([dict(m) for m in conversation])
        if plan is not None and (plan.tools or plan.template_kwargs):
            ids = self.tokenizer.apply_chat_template(messages, tools=plan.template_tools,
                                                     template_kwargs=plan.template_kwargs)  # fmt: skip
        else:
            ids = self.tokenizer.apply_chat_template(messages)
        if add_special_tokens:
            ids = self.tokenizer.with_special_tokens(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False), ids

    def params_for(self, params: SamplingParams, n_prompt: int) -> SamplingParams:
        """vLLM's ``max_tokens=None``: up to what the model's length and the KV cache leave."""
        if params.max_tokens is None:
            return replace(params, max_tokens=max(1, self.output_room(n_prompt)))
        return params

    def truncated(self, encoded: tuple[str | None, list[int]], params: SamplingParams) -> tuple[str | None, list[int]]:
        """The prompt after ``truncate_prompt_tokens`` (its text then None: vLLM shows the ids)."""
        text, ids = encoded
        cut = params.truncate_prompt(ids, self.max_model_len)
        return (text, ids) if len(cut) == len(ids) else (None, cut)


def _conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """One conversation (a list of {role, content}) or a list of conversations."""
    if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
        return [list(messages)]
    if isinstance(messages, (list, tuple)) and messages and all(isinstance(c, (list, tuple)) for c in messages):
        return [list(c) for c in messages]
    raise InvalidRequestError("messages", "must be a conversation [{role, content}, ...] or a list of conversations")


def _build(model: Any, speculative_config: Any, tensor_parallel_size: Any, dtype: Any, max_model_len: Any,
           seed: Any, served_model_name: Any, hydra_overrides: Sequence[str], config_dir: Any,
           options: dict[str, Any]) -> tuple[Config, list[str]]:  # fmt: skip
    overrides, notes = engine_overrides(
        model=model, speculative_config=speculative_config, tensor_parallel_size=tensor_parallel_size,
        dtype=dtype, max_model_len=max_model_len, seed=seed, served_model_name=served_model_name,
        where="LLM", **options,
    )
    for note in notes:
        log.warning("%s", note)
    if isinstance(hydra_overrides, str):
        hydra_overrides = [hydra_overrides]
    overrides += list(hydra_overrides)
    cfg = compose(overrides, config_dir)
    from specserve.compose import _cap_onednn_isa

    _cap_onednn_isa(cfg)  # effective only if torch is not loaded yet
    return cfg, overrides


# --------------------------------------------------------------------------- LLM


class LLM:
    """An offline engine: ``generate``, ``chat`` (and ``agenerate``) over many prompts.

    ``model``: a ``model`` preset (``smollm2-135m``), ``embedded:<name>``, a .gguf file or a
    local HF directory (None: the default preset).  ``speculative_config``: vLLM's dict
    (``{"method": "draft_model", "model": <draft>, "num_speculative_tokens": N}``,
    ``{"method": "ngram", ...}``) or None for plain decoding.  ``tensor_parallel_size`` other
    than 1 is refused by validation in this single-device build.  Other keywords: any
    ``engine.*`` key (``max_num_seqs=8``, ``num_kv_blocks=512``, ``device="cpu"``, ...),
    ``served_model_name``, ``hydra_overrides=["group.key=value", ...]`` for anything else,
    ``config_dir`` for extra presets.  vLLM's ``gpu_memory_utilization``, ``enforce_eager``,
    ``trust_remote_code`` are accepted and have no effect (a warning says so).
    """

    def __init__(
        self,
        model: Any = None,
        speculative_config: dict[str, Any] | str | None = None,
        tensor_parallel_size: int = 1,
        dtype: Any = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        *,
        served_model_name: str | None = None,
        hydra_overrides: Sequence[str] = (),
        config_dir: Any = None,
        **engine_options: Any,
    ):
        self.config, self.hydra_overrides = _build(
            model, speculative_config, tensor_parallel_size, dtype, max_model_len, seed, served_model_name,
            hydra_overrides, config_dir, engine_options,
        )
        from specserve.engine.engine import LLMEngine

        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._prompts = _Prompts(self.tokenizer, self.engine.max_model_len, self.engine.output_room)
        self._lock = threading.Lock()  # the engine is single-threaded
        self._ids = itertools.count()

    @property
    def info(self):
        """Model name, method, K, max_model_len, dtype, device, lossless."""
        return self.engine.info

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer (as vLLM's ``LLM.get_tokenizer``)."""
        return self.tokenizer.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``sampling_params=None`` means: SamplingParams' defaults with the model's
        generation_config.json over them (``model.generation_config``), as in vLLM."""
        return SamplingParams(**self.info.sampling_defaults)

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        add_special_tokens: bool = True,
    ) -> list[GenerationOutput]:
        """Run prompts to completion; outputs in prompt order.

        ``prompts``: a string, a list of token ids, a dict with "prompt" or
        "prompt_token_ids", or a list of those (no chat template: use ``chat``).
        ``sampling_params``: one for all prompts, one per prompt, or None
        (``SamplingParams()``: temperature 1, 16 tokens, as in vLLM).
        ``add_special_tokens``: a text prompt gets the tokenizer's special tokens (e.g. BOS)."""
        items = _prompt_list(prompts)
        encoded = [self._prompts.encode(p, i, add_special_tokens) for i, p in enumerate(items)]
        params = _params_list(sampling_params, len(items), self.info.sampling_defaults)
        if any(sp.thinking_token_budget is not None and sp.reasoning is None for sp in params):
            from specserve.formats.chat import ChatPlan

            plan = ChatPlan(self._chat_formats())  # the budget's markers, read from each prompt's end
            params = [self._planned(plan, sp, ids) for sp, (_, ids) in zip(params, encoded)]
        return self._run(encoded, params, use_tqdm)

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        add_special_tokens: bool = False,
    ) -> list[GenerationOutput]:
        """One conversation ``[{"role": ..., "content": ...}, ...]`` or a list of them,
        rendered with the model's chat template (as the servers' chat endpoint does).

        As vLLM's: ``tools`` (OpenAI's function tools) and ``chat_template_kwargs`` go to the
        template.  ``tool_choice`` ("auto" with tools, "required", a named function, "none")
        and ``parallel_tool_calls`` as on the chat endpoint: "required" and named choices are
        enforced by a grammar after the reasoning.  With tools to read or a reasoning format,
        ``outputs[0]`` also has the answer parsed: ``content``, ``reasoning``, ``tool_calls``
        (``text`` stays the raw text); ``SamplingParams(thinking_token_budget=n)`` caps the
        reasoning.  ``add_special_tokens`` adds the tokenizer's own (e.g. BOS) around the prompt."""
        from specserve.formats.chat import ChatPlan

        convs = _conversations(messages)
        plan = ChatPlan.from_fields(self._chat_formats(), tools=tools, tool_choice=tool_choice,
                                    parallel_tool_calls=parallel_tool_calls,
                                    chat_template_kwargs=chat_template_kwargs)  # fmt: skip
        encoded = [self._prompts.chat(c, i, plan, add_special_tokens) for i, c in enumerate(convs)]
        params = [self._planned(plan, sp, ids) for sp, (_, ids)
                  in zip(_params_list(sampling_params, len(convs), self.info.sampling_defaults), encoded)]
        outs = self._run(encoded, params, use_tqdm)
        if plan.parses_tools or plan.reasoning_on:
            for out, (_, ids) in zip(outs, encoded):
                _parse_answer(plan, self.tokenizer, ids, out.outputs[0])
        return outs

    def _chat_formats(self):
        from specserve.formats.chat import ChatFormats

        srv = self.config.server
        return ChatFormats(self.engine.info.tool_call_format, self.engine.info.reasoning_format,
                           srv.enable_auto_tool_choice, srv.reasoning_content_alias,
                           dict(srv.default_chat_template_kwargs or {}), srv.thinking_budget_message)  # fmt: skip

    def _planned(self, plan: Any, params: SamplingParams, ids: list[int]) -> SamplingParams:
        """A request's params with the plan's forced-call grammar, reasoning markers and budget."""
        from specserve.formats.chat import apply_plan

        plan = replace(plan, thinking_token_budget=params.thinking_token_budget)
        return apply_plan(plan, replace(params), ids, self.tokenizer, field="structured_outputs")

    async def agenerate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> list[GenerationOutput]:
        """``generate`` in a worker thread, awaitable without blocking the event loop.
        For per-token streaming use ``AsyncLLM``."""
        return await asyncio.to_thread(self.generate, prompts, sampling_params, use_tqdm=use_tqdm)

    async def achat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> list[GenerationOutput]:
        return await asyncio.to_thread(self.chat, messages, sampling_params, use_tqdm=use_tqdm)

    def transcribe(self, audio: Any, *, language: str | None = None, prompt: str | None = None,
                   temperature: float = 0.0, seed: int | None = None) -> list[Any]:
        """Transcribe recordings with a speech model (``specserve.audio.offline``): ``audio`` is a
        path, the bytes of an audio file or ``(samples, sample_rate)``, or a list of them;
        returns one ``Transcription`` (text, segments, duration_s, ctc_stages) per recording."""
        from specserve.audio.offline import transcribe

        return transcribe(self, audio, language=language, prompt=prompt, temperature=temperature, seed=seed)

    def _run(
        self, encoded: list[tuple[str | None, list[int]]], params: list[SamplingParams], use_tqdm: Any
    ) -> list[GenerationOutput]:
        if not encoded:
            return []
        eng = self.engine
        lp = _Logprobs(self.tokenizer)
        encoded = [self._prompts.truncated(e, sp) for e, sp in zip(encoded, params)]
        with self._lock:
            base = f"llm-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
            prompts = [f"{base}-{i}" for i in range(len(encoded))]
            # Each choice (n, best_of) is its own engine request: (prompt, choice) -> params.
            jobs: list[tuple[str, int, SamplingParams]] = []
            for i, (pid, sp) in enumerate(zip(prompts, params)):
                sub = _choice_params(sp)
                jobs += [(f"{pid}-{c}" if len(sub) > 1 else pid, i, one) for c, one in enumerate(sub)]
            ids = [rid for rid, _, _ in jobs]
            owner = {rid: i for rid, i, _ in jobs}
            left = [sum(1 for _, j, _ in jobs if j == i) for i in range(len(prompts))]
            convs = {rid: _Converted(lp, encoded[i][0], encoded[i][1], sp) for rid, i, sp in jobs}
            final: dict[str, RequestOutput] = {}
            added: list[str] = []
            bar = _progress(use_tqdm, len(prompts))
            try:
                for rid, i, sp in jobs:
                    prompt_ids = encoded[i][1]
                    eng.add_request(rid, prompt_ids, self._prompts.params_for(sp, len(prompt_ids)))
                    added.append(rid)
                n_out, start = 0, time.monotonic()
                while len(final) < len(ids):
                    if not eng.has_unfinished():
                        raise RuntimeError("the engine stopped with requests unfinished")
                    for out in eng.step():
                        if out.finished:
                            final[out.request_id] = out
                            n_out += len(out.token_ids)
                            if bar is not None:
                                bar.set_postfix_str(f"output: {n_out / max(time.monotonic() - start, 1e-9):.1f} toks/s")
                                left[owner[out.request_id]] -= 1
                                if not left[owner[out.request_id]]:  # a prompt is done when all its choices are
                                    bar.update(1)
                        elif (conv := convs.get(out.request_id)) is not None and conv.wants:
                            conv.absorb(out)
            except BaseException:
                for rid in added:
                    if rid not in final:
                        eng.abort_request(rid)
                raise
            finally:
                if bar is not None:
                    bar.close()
        outs = []
        for i, pid in enumerate(prompts):
            mine = [(convs[rid](final[rid]), sp) for rid, j, sp in jobs if j == i]
            outs.append(_merge_choices(pid, [o for o, _ in mine], params[i]))
        return outs


def _choice_params(params: SamplingParams) -> list[SamplingParams]:
    """One engine request's params per candidate of ``params`` (vLLM's ``n``/``best_of``:
    ``best_of`` candidates, default ``n``).  Candidate i > 0 of a seeded request samples
    with seed + i (the HTTP API's rule); ranking best_of > n needs log-probabilities."""
    n, best_of = getattr(params, "n", 1), getattr(params, "best_of", None) or getattr(params, "n", 1)
    if best_of == 1:
        return [params]
    out = []
    for c in range(best_of):
        sp = replace(params)  # a copy (vLLM's n/best_of are read from ``params`` only)
        if params.seed is not None and c:
            sp.seed = params.seed + c if params.seed + c <= request.SEED_MAX else params.seed - c
        if best_of > n and sp.logprobs is None:
            sp.logprobs = 0
        out.append(sp)
    return out


def _merge_choices(request_id: str, outs: list[GenerationOutput], params: SamplingParams) -> GenerationOutput:
    """The candidates of one prompt -> one ``GenerationOutput`` with ``n`` completions
    (indexes 0..n-1; with best_of > n, the n of highest cumulative log-probability)."""
    if len(outs) == 1:
        return outs[0]
    n = getattr(params, "n", 1)
    choices = [o.outputs[0] for o in outs]
    if len(choices) > n:
        choices = sorted(choices, key=lambda c: c.cumulative_logprob or 0.0, reverse=True)[:n]
        if params.logprobs is None:  # asked only for the ranking
            for c in choices:
                c.logprobs, c.cumulative_logprob = None, None
    for i, c in enumerate(choices):
        c.index = i
    stats = SpecDecodeStats(sum(o.num_drafts for o in outs), sum(o.num_draft_tokens for o in outs),
                            sum(o.num_accepted_tokens for o in outs))
    first = outs[0]
    return GenerationOutput(request_id, first.prompt, first.prompt_token_ids, choices,
                            all(o.finished for o in outs), stats, first.prompt_logprobs)


def _parse_answer(plan: Any, tokenizer: Any, prompt_ids: list[int], out: CompletionOutput) -> None:
    """Fill a chat answer's ``content``, ``reasoning`` and ``tool_calls`` from its text."""
    from specserve.formats.chat import call_dict

    answer = plan.answer(plan.prompt_state(tokenizer, prompt_ids) if plan.reasoning_on else None)
    answer.feed(out.text)
    answer.finish()
    out.content = answer.content if answer.content or not answer.calls else None
    out.reasoning = answer.reasoning or None
    out.tool_calls = [call_dict(c) for c in answer.calls] or None


def _progress(use_tqdm: Any, total: int):
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, file=sys.stderr)


# --------------------------------------------------------------------------- AsyncLLM


class AsyncLLM:
    """A streaming engine for asyncio code; the engine steps in a background thread.

    ::

        llm = AsyncLLM(model=..., speculative_config={...})
        async for out in llm.generate("The future of AI is", SamplingParams(max_tokens=32)):
            print(out.outputs[0].new_text, end="", flush=True)
        outs = await llm.agenerate(["a", "b"], params)   # all at once, final outputs
        llm.shutdown()

    Same constructor as ``LLM``.  Requests are batched together in the engine;
    leaving an ``async for`` early aborts that request.  ``max_queue`` bounds the
    waiting queue (default: unbounded, for offline use).
    """

    def __init__(
        self,
        model: Any = None,
        speculative_config: dict[str, Any] | str | None = None,
        tensor_parallel_size: int = 1,
        dtype: Any = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        *,
        served_model_name: str | None = None,
        hydra_overrides: Sequence[str] = (),
        config_dir: Any = None,
        max_queue: int | None = None,
        **engine_options: Any,
    ):
        self.config, self.hydra_overrides = _build(
            model, speculative_config, tensor_parallel_size, dtype, max_model_len, seed, served_model_name,
            hydra_overrides, config_dir, engine_options,
        )
        from specserve.engine.async_engine import AsyncEngine
        from specserve.engine.engine import LLMEngine

        core = LLMEngine(self.config)
        self.engine = AsyncEngine(core, max_queue if max_queue is not None else sys.maxsize)
        self.tokenizer = core.tokenizer
        self._prompts = _Prompts(self.tokenizer, core.max_model_len, core.output_room)
        self._logprobs = _Logprobs(self.tokenizer)
        self.engine.start()

    @property
    def info(self):
        return self.engine.info

    def get_tokenizer(self) -> Any:
        return self.tokenizer.hf

    async def generate(
        self, prompt: Any, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[GenerationOutput]:
        """Stream one request: an output after every engine step that adds tokens,
        cumulative (``outputs[0].text``) with the step's delta (``outputs[0].new_text``);
        the last has ``finished`` True and the final ``spec_decode`` figures."""
        text, ids = self._prompts.encode(prompt, 0)
        async for out in self._stream(text, ids, sampling_params, request_id):
            yield out

    async def chat(
        self, messages: Any, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[GenerationOutput]:
        """Stream one chat conversation (the model's chat template applied)."""
        convs = _conversations(messages)
        if len(convs) != 1:
            raise InvalidRequestError("messages", "AsyncLLM.chat streams one conversation [{role, content}, ...]")
        text, ids = self._prompts.chat(convs[0], 0)
        async for out in self._stream(text, ids, sampling_params, request_id):
            yield out

    async def agenerate(
        self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationOutput]:
        """All prompts at once (batched by the engine); final outputs in prompt order."""
        items = _prompt_list(prompts)
        params = _params_list(sampling_params, len(items), self.info.sampling_defaults)
        encoded = [self._prompts.encode(p, i) for i, p in enumerate(items)]
        return list(await asyncio.gather(*(self._final(t, ids, sp) for (t, ids), sp in zip(encoded, params))))

    async def _final(self, text: str | None, ids: list[int], params: SamplingParams) -> GenerationOutput:
        last = None
        async for out in self._stream(text, ids, params, None):
            last = out
        assert last is not None
        return last

    async def _stream(
        self, text: str | None, ids: list[int], params: SamplingParams | None, request_id: str | None
    ) -> AsyncIterator[GenerationOutput]:
        if params is not None and getattr(params, "best_of", None) not in (None, 1):
            raise InvalidRequestError("n", "AsyncLLM streams one completion per request; use LLM.generate for "
                                           "n or best_of > 1")
        params = params if params is not None else SamplingParams(**self.info.sampling_defaults)
        text, ids = self._prompts.truncated((text, ids), params)
        params = self._prompts.params_for(params, len(ids))
        if params.structured_outputs is not None and params.compiled_grammar is None:
            # compiled here, in a worker thread, so the engine thread goes on stepping the others
            compiled = await asyncio.to_thread(self.engine.grammar_backend.compile, params.structured_outputs,
                                               self.config.server.grammar_max_chars, params.cache_salt)
            params = replace(params, compiled_grammar=compiled)
        if params.bad_words and params.bad_words_token_ids is None:  # tokenized here, not on the engine thread
            from specserve.engine.tokenizer import bad_words_token_ids

            words = await asyncio.to_thread(bad_words_token_ids, self.tokenizer, params.bad_words)
            params = replace(params, bad_words_token_ids=words)
        rid = request_id or f"async-{uuid.uuid4().hex}"
        convert = _Converted(self._logprobs, text, ids, params)
        async for out in self.engine.generate(rid, ids, params):
            yield convert(out)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()

