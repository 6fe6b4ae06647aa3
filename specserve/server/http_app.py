"""The OpenAI-compatible HTTP front end (aiohttp).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events ending in ``data: [DONE]``; chat with tools and
reasoning: ``chat_tools``), ``POST /v1/responses`` (OpenAI's Responses API, stateless:
``responses``),
``GET /v1/models[/{model}]`` (one card per served name: ``model.name`` and
``server.served_model_aliases``; a request may name any of them),
``GET /health`` and ``GET``/``POST /ping`` (200 serving / 503 not; no key),
``GET /metrics`` (Prometheus text format; it needs a key whenever the API or
``server.metrics_key`` has one: ``specserve.server.auth``), and vLLM's
``GET /version``, ``POST /tokenize`` and ``POST /detokenize`` (tokenizing in the
front end's worker threads, never on the event loop).  A body's ``cache_salt``
(vLLM's field) narrows the caller's cache partition further; its ``speculation:
{"num_speculative_tokens": k}`` caps the request's drafts per step at k (0 = plain
decoding for it; k at most the server's K).

Both completion endpoints answer through ``openai_features.serve_choices`` (one
path for one choice or many, whole or streamed).  Besides OpenAI's fields, every
completion (and the final chunk of a stream) carries ``spec_decode:
{num_speculative_tokens, num_drafts, num_draft_tokens, num_accepted_tokens,
mean_acceptance_length}`` for the request (the first: its cap on drafts per step),
as newer vLLM does.

The runner is created with ``handler_cancellation=True``: when a client
disconnects, aiohttp cancels the handler, which closes the engine stream and
aborts the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from specserve.errors import InvalidRequestError
from specserve.metrics import exposition
from specserve.server.audio import add_audio_routes
from specserve.formats.chat import apply_plan, template_messages
from specserve.server.auth import METRICS_PATH, OPEN_HTTP_PATHS, ApiKeyChecker
from specserve.server.chat_tools import ChatAnswers, chat_plan, render_chat
from specserve.server.responses import create_response
from specserve.server.errors import INTERNAL, classify, openai_error_body
from specserve.server.frontend import Frontend, SamplingFields, printable
from specserve.server.openai_features import Features, completion_prompts, parse_features, serve_choices
from specserve.server.request_fields import IGNORED_FIELDS_HEADER, UnknownFields, header_value
from specserve.server.vllm_fields import VllmFields, parse_vllm_fields

log = logging.getLogger("specserve.server.http")

MAX_BODY_BYTES = 16 * 1024 * 1024
INLINE_JSON_BYTES = 64 * 1024

# OpenAI fields this server does not implement: accepted only at their no-op values.
# (n, best_of, echo, logprobs, penalties, logit_bias, response_format: openai_features.py)
_UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
}

FRONTEND_KEY = web.AppKey("frontend", Frontend)
CLOSE_AFTER_KEY = web.RequestKey("close_after", bool)  # close the connection after the answer
TENANT_KEY = web.RequestKey("tenant", str)  # the caller's tenant (auth.ApiKeyChecker.authenticate)
FIELDS_KEY = web.AppKey("unknown_fields", UnknownFields)  # request_fields: unknown fields, once-per-name log
IGNORED_KEY = web.RequestKey("ignored_fields", list)  # the request's unknown fields, for the response header


# --------------------------------------------------------------------------- parsing


def _json_error(exc: BaseException) -> web.Response:
    status, body = openai_error_body(exc)
    return web.json_response(body, status=status)


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise InvalidRequestError("body", "is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError("body", f"is not valid JSON: {exc}") from None


async def _read_json(request: web.Request) -> dict[str, Any]:
    fe = request.app[FRONTEND_KEY]
    try:
        async with asyncio.timeout(fe.cfg.body_timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise InvalidRequestError("body", f"was not received within {fe.cfg.body_timeout_s:g} s") from None
    except web.RequestPayloadError as exc:  # e.g. Content-Encoding: gzip on bytes that are not gzip
        # The rest of the body cannot be parsed: answer, then close the connection
        # (no draining read of a broken body after the answer).
        request[CLOSE_AFTER_KEY] = True
        request.content.feed_eof()
        cause = getattr(exc.__cause__, "message", None) or " ".join(str(exc).split())
        raise InvalidRequestError("body", f"could not be read: {cause} (check the Content-Encoding header)") from None
    # Parsing megabytes of JSON takes a while: small bodies inline, big ones off the loop.
    body = _parse_json(raw) if len(raw) < INLINE_JSON_BYTES else await fe.run_off_loop(_parse_json, raw)
    if not isinstance(body, dict):
        raise InvalidRequestError("body", f"must be a JSON object, got {type(body).__name__}")
    return body


def _optional_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequestError(name, f"must be a boolean, got {type(value).__name__}")
    return value


def _common_checks(body: dict[str, Any]) -> tuple[bool, bool]:
    """Checks shared by both endpoints; returns (stream, include_usage)."""
    for name, allowed in _UNSUPPORTED_FIELDS.items():
        if name in body and body[name] not in allowed:
            raise InvalidRequestError(name, "is not supported by this server")
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequestError("stream_options", "must be an object")
        if not stream:
            raise InvalidRequestError("stream_options", "is only allowed with stream: true")
        include_usage = _optional_bool(options, "include_usage")
    return stream, include_usage


def _sampling_fields(body: dict[str, Any]) -> tuple[SamplingFields, str]:
    max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    fields = SamplingFields(
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        top_k=body.get("top_k"),
        min_p=body.get("min_p"),
        max_tokens=body.get(max_key),
        seed=body.get("seed"),
        stop=stop,
        stop_token_ids=body.get("stop_token_ids"),
        ignore_eos=body.get("ignore_eos"),
        cache_salt=body.get("cache_salt"),
    )
    return fields, max_key


def _params(fe: Frontend, body: dict[str, Any], features: Features | None = None, tenant: str | None = None,
            prompts: Sequence[list[int]] = (), completions: bool = False, vllm: VllmFields | None = None):  # fmt: skip
    fields, max_key = _sampling_fields(body)
    if features is not None:
        fields = dataclasses.replace(fields, **features.fields)
    if vllm is not None:
        fields = dataclasses.replace(fields, **vllm.fields)
    try:  # a default max_tokens fits the longest prompt
        return fe.make_params(fields, tenant, max(map(len, prompts), default=1), completions,
                              "prompt" if completions else "messages")  # fmt: skip
    except InvalidRequestError as exc:
        if exc.field == "max_tokens" and max_key != "max_tokens":  # name the field the client sent
            raise InvalidRequestError(max_key, str(exc).split(": ", 1)[1]) from None
        raise


def _chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages as chat templates read them (tool calls, tool results, reasoning:
    ``formats.chat.template_messages``); the tokenizer checks the roles."""
    return template_messages(body.get("messages"))


async def _prediction(fe: Frontend, body: dict[str, Any]) -> list[int] | None:
    """Predicted Outputs: ``prediction: {"type": "content", "content": str | [text parts]}``
    -> the prediction's token ids (None when absent or empty)."""
    pred = body.get("prediction")
    if pred is None:
        return None
    if not isinstance(pred, dict) or pred.get("type") != "content":
        raise InvalidRequestError("prediction", 'must be {"type": "content", "content": <text or text parts>}')
    content = pred.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError("prediction.content", "only text parts are supported")
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise InvalidRequestError("prediction.content", "must be a string or a list of text parts")
    return await fe.tokenize_prediction_async(content)


# --------------------------------------------------------------------------- handlers


def _unknown_fields(request: web.Request, body: dict[str, Any], chat: bool) -> None:
    ignored = request.app[FIELDS_KEY].check(body, chat)  # 400 under server.strict_fields
    if ignored:
        request[IGNORED_KEY] = ignored


def _vllm_fields(request: web.Request, body: dict[str, Any], chat: bool, stream: bool) -> VllmFields:
    header = request.headers.get("X-Request-Id")
    return parse_vllm_fields(body, chat, stream, header)


async def completions(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND_KEY]
    body = await _read_json(request)
    for name in ("tools", "thinking_token_budget"):  # they need a chat answer's reasoning and tool-call parsing
        if body.get(name) not in (None, []):
            raise InvalidRequestError(name, "is a chat field: send it to /v1/chat/completions (or /v1/responses)")
    _unknown_fields(request, body, chat=False)
    fe.check_model(body.get("model"))
    stream, include_usage = _common_checks(body)
    features = parse_features(body, chat=False)
    vllm = _vllm_fields(request, body, False, stream)
    tenant = request.get(TENANT_KEY)
    prompts, texts = await completion_prompts(fe, body, vllm.add_special_tokens, vllm.truncate_prompt_tokens)
    params = _params(fe, body, features, tenant, prompts, completions=True, vllm=vllm)
    params.prediction_token_ids = await _prediction(fe, body)
    await fe.tokenize_bad_words_async(params)
    return await serve_choices(request, fe, False, prompts, texts, params, features, stream, include_usage,
                               tenant, vllm.request_id, vllm.prompt_logprobs)  # fmt: skip


async def chat_completions(request: web.Request) -> web.StreamResponse:
    fe = request.app[FRONTEND_KEY]
    body = await _read_json(request)
    _unknown_fields(request, body, chat=True)
    fe.check_model(body.get("model"))
    stream, include_usage = _common_checks(body)
    features = parse_features(body, chat=True)
    vllm = _vllm_fields(request, body, True, stream)
    tenant = request.get(TENANT_KEY)
    plan = chat_plan(fe, body)  # tools, tool_choice, reasoning, chat_template_kwargs (chat_tools)
    ids = await render_chat(fe, _chat_messages(body), plan, add_special_tokens=vllm.add_special_tokens,
                            truncate=vllm.truncate_prompt_tokens)  # fmt: skip
    params = apply_plan(plan, _params(fe, body, features, tenant, [ids], vllm=vllm), ids, fe.engine.tokenizer)
    params.prediction_token_ids = await _prediction(fe, body)
    await fe.tokenize_bad_words_async(params)
    answers = ChatAnswers(plan, fe.engine.tokenizer, ids)
    return await serve_choices(request, fe, True, [ids], [None], params, features, stream, include_usage,
                               tenant, vllm.request_id, vllm.prompt_logprobs,
                               answers if answers.active else None)  # fmt: skip


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API (``server.responses``)."""
    fe = request.app[FRONTEND_KEY]
    body = await _read_json(request)
    fe.check_model(body.get("model"))
    return await create_response(request, fe, body, request.get(TENANT_KEY))


def _model_card(fe: Frontend) -> dict[str, Any]:
    info = fe.engine.info
    return {
        "id": info.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "specserve",
        "max_model_len": info.max_model_len,
        "spec_decode": {
            "method": info.method or "none",
            "num_speculative_tokens": info.num_speculative_tokens,
            "lossless": bool(info.lossless),
        },
        "parallelism": {  # the layout (tensor parallelism)
            "tensor_parallel_size": int(getattr(info, "tensor_parallel_size", 1)),
            "draft_tensor_parallel_size": int(getattr(info, "draft_tensor_parallel_size", 1)),
        },
        "kernels": {  # what runs them after the start-up checks (kernels.backends)
            "attention": str(getattr(info, "attention_backend", "unknown")),
            "rejection": str(getattr(info, "rejection_backend", "unknown")),
        },
    }


async def list_models(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND_KEY]  # one card per served name, as vLLM lists its --served-model-name
    card = _model_card(fe)
    return web.json_response({"object": "list", "data": [{**card, "id": name} for name in fe.served_model_names]})


async def get_model(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND_KEY]
    name = request.match_info["model"]
    fe.check_model(name)
    return web.json_response({**_model_card(fe), "id": name})


async def health(request: web.Request) -> web.Response:
    state = request.app[FRONTEND_KEY].health
    serving = state.refresh()
    return web.json_response({"status": state.reason}, status=200 if serving else 503)


# --------------------------------------------------------------------------- vLLM's extra routes


async def version(request: web.Request) -> web.Response:
    from specserve import __version__

    return web.json_response({"version": __version__})


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: ``prompt`` (+ ``add_special_tokens``, default true) or ``messages``
    (+ ``add_generation_prompt`` true, ``add_special_tokens`` false), tokenized exactly as the
    completion and chat endpoints tokenize them -> ``{count, max_model_len, tokens}`` (and
    ``token_strs`` with ``return_token_strs: true``)."""
    fe = request.app[FRONTEND_KEY]
    body = await _read_json(request)
    fe.check_model(body.get("model"))
    for name in ("continue_final_message", "chat_template"):
        if body.get(name) not in (None, False, {}, []):
            raise InvalidRequestError(name, "is not supported by this server")
    chat = body.get("messages") is not None
    if chat == (body.get("prompt") is not None):
        raise InvalidRequestError("prompt", "give either prompt (a string) or messages")
    add_special = _optional_bool(body, "add_special_tokens") if "add_special_tokens" in body else not chat
    if chat:
        gen = _optional_bool(body, "add_generation_prompt") if "add_generation_prompt" in body else True
        plan = chat_plan(fe, {k: body.get(k) for k in ("tools", "chat_template_kwargs")} | {"tool_choice": "none"})
        tokens = await fe.tokenize_chat_async(_chat_messages(body), gen, add_special, plan.template_tools,
                                              plan.template_kwargs)  # fmt: skip
    else:
        if not isinstance(body["prompt"], str):
            raise InvalidRequestError("prompt", f"must be a string, got {type(body['prompt']).__name__}")
        tokens = await fe.tokenize_text_async(body["prompt"], add_special)
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": fe.engine.info.max_model_len, "tokens": tokens}
    if _optional_bool(body, "return_token_strs"):
        out["token_strs"] = await fe.token_texts_async(tokens)
    return web.json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's ``/detokenize``: ``{tokens: [ids]}`` -> ``{prompt: text}`` (special tokens kept)."""
    fe = request.app[FRONTEND_KEY]
    body = await _read_json(request)
    fe.check_model(body.get("model"))
    return web.json_response({"prompt": await fe.detokenize_async(body.get("tokens"))})


async def metrics(request: web.Request) -> web.Response:
    fe = request.app[FRONTEND_KEY]
    engine = fe.engine
    fe.metrics.set_queue_state(engine.num_running, engine.num_waiting, engine.kv_cache_usage)
    return web.Response(body=exposition(fe.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


# --------------------------------------------------------------------------- app


def _error_middleware(checker: ApiKeyChecker):
    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        fe = request.app[FRONTEND_KEY]
        try:
            if request.path == METRICS_PATH:
                if checker.metrics_protected:
                    checker.authenticate_metrics(_raw_headers(request, b"authorization"))
            elif request.path not in OPEN_HTTP_PATHS:
                tenant = checker.authenticate(_raw_headers(request, b"authorization"))
                if tenant is not None:
                    request[TENANT_KEY] = tenant
            return await handler(request)
        except web.HTTPException as exc:  # routing errors (404, 405, 413): OpenAI-style bodies too
            if exc.status < 400:
                raise
            body = {"error": {"message": exc.reason, "type": "invalid_request_error", "param": None, "code": None}}
            return web.json_response(body, status=exc.status)
        except ConnectionError:
            raise  # the client is gone; nothing to answer
        except Exception as exc:
            kind = fe.record_error(exc)
            path = printable(request.path)  # the client's text: escaped for the log
            if classify(exc) is INTERNAL:
                log.error("HTTP %s %s failed", request.method, path, exc_info=exc)
            else:
                log.info("HTTP %s %s refused: %s: %s", request.method, path, kind, printable(str(exc), 1000))
            return _json_error(exc)

    return middleware


def _raw_headers(request: web.Request, name: bytes) -> list[bytes]:
    """Every value of a header as the client sent its bytes (auth compares bytes: a non-UTF-8
    byte in the header is a wrong key, never a decoding error; two values are refused)."""
    return [value for key, value in request.raw_headers if key.lower() == name]


async def _close_when_needed(request: web.Request, response: web.StreamResponse) -> None:
    """While draining, answer with ``Connection: close``: a client must not reuse a
    keep-alive connection that the listener is about to close under it (its next
    request would be cut without any response).  Likewise after a body that could
    not be read to its end."""
    if request.app[FRONTEND_KEY].health.draining or request.get(CLOSE_AFTER_KEY):
        response.force_close()  # close after this response ...
        response.headers["Connection"] = "close"  # ... and say so (the header is computed before this hook)


async def _ignored_fields_header(request: web.Request, response: web.StreamResponse) -> None:
    """Name the request's unknown fields (request_fields) on its response, streamed or whole."""
    ignored = request.get(IGNORED_KEY)
    if ignored:
        response.headers[IGNORED_FIELDS_HEADER] = header_value(ignored)


def build_http_app(frontend: Frontend, checker: ApiKeyChecker) -> web.Application:
    app = web.Application(middlewares=[_error_middleware(checker)], client_max_size=MAX_BODY_BYTES)
    app[FRONTEND_KEY] = frontend
    app[FIELDS_KEY] = UnknownFields(bool(getattr(frontend.cfg, "strict_fields", False)))
    app.on_response_prepare.append(_close_when_needed)
    app.on_response_prepare.append(_ignored_fields_header)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)  # vLLM's (and SageMaker's) probe: GET and POST, like /health
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
    add_audio_routes(app, FRONTEND_KEY, TENANT_KEY)  # /v1/audio/transcriptions, /v1/audio/translations
    return app
