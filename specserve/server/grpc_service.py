"""The gRPC front end: ``specserve.v1.SpecServe`` plus health and reflection.

Streaming uses ``context.write`` from a coroutine (not an async generator), so
a cancelled call or a passed deadline always lands as an exception inside the
handler, which closes the engine stream and thereby aborts the request.

Requests are parsed by the handlers, not by gRPC: bytes that are not a valid
message are INVALID_ARGUMENT naming ``request`` (gRPC's own parsing would
answer UNKNOWN).  When a stop string cuts the text, ``token_ids`` and
``usage.completion_tokens`` end with the tokens that spell it: those generated
past it in the same step are dropped, and a stream never sends them (its
token ids and log-probabilities come with their text: ``engine.output``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specserve.errors import ConfigError, InvalidRequestError
from specserve.request import FinishReason, RequestOutput, SpeculationParams, StructuredOutputsParams
from specserve.sampling.logits_controls import LOGPROB_FLOOR
from specserve.server.audio import grpc_transcribe, grpc_transcribe_stream
from specserve.server.auth import OPEN_GRPC_SERVICES, ApiKeyChecker
from specserve.server.errors import (
    INTERNAL,
    DeadlineExceededError,
    UnauthenticatedError,
    classify,
    public_message,
)
from specserve.server.frontend import Frontend, PreparedRequest, SamplingFields, printable
from specserve.formats.chat import apply_plan
from specserve.server.chat_tools import ChatAnswers, render_chat
from specserve.server.grpc_chat import GrpcAnswer, grpc_messages, grpc_plan
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc

log = logging.getLogger("specserve.server.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SpecServe"].full_name  # "specserve.v1.SpecServe"

_FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def _structured(sp: pb.SamplingParams) -> StructuredOutputsParams | None:
    given = {k: v for k, v in (("json", sp.json_schema), ("regex", sp.regex), ("grammar", sp.grammar)) if v}
    if sp.choice:
        given["choice"] = list(sp.choice)
    if sp.json_object:
        given["json_object"] = True
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError("json_schema", f"at most one structured output may be set, got {sorted(given)}")
    if "json" in given:
        try:
            given["json"] = json.loads(given["json"])
        except ValueError as e:
            raise InvalidRequestError("json_schema", f"is not valid JSON: {e}") from None
    return StructuredOutputsParams(**given)


def _logprob_msgs(tokenizer: Any, lps: list | None) -> list[pb.TokenLogprob]:
    def text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)

    out = []
    for e in lps or []:
        if e is None:
            continue
        out.append(pb.TokenLogprob(
            token_id=e.token_id, token=text(e.token_id), logprob=max(e.logprob, LOGPROB_FLOOR),
            top_logprobs=[pb.TopLogprob(token_id=i, token=text(i), logprob=max(v, LOGPROB_FLOOR)) for i, v in e.top],
        ))  # fmt: skip
    return out


def sampling_fields(sp: pb.SamplingParams) -> SamplingFields:
    """Proto -> SamplingFields; unset ``optional`` fields stay None and take the defaults."""
    return SamplingFields(
        presence_penalty=sp.presence_penalty if sp.HasField("presence_penalty") else None,
        frequency_penalty=sp.frequency_penalty if sp.HasField("frequency_penalty") else None,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else None,
        logit_bias={b.token_id: b.bias for b in sp.logit_bias} or None,
        min_tokens=sp.min_tokens,
        logprobs=sp.logprobs if sp.HasField("logprobs") else None,
        prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
        structured_outputs=_structured(sp),
        temperature=sp.temperature if sp.HasField("temperature") else None,
        top_p=sp.top_p if sp.HasField("top_p") else None,
        top_k=sp.top_k,
        min_p=sp.min_p,
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else None,
        seed=sp.seed if sp.HasField("seed") else None,
        stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        speculation=_speculation(sp),
        include_stop_str_in_output=sp.include_stop_str_in_output,
        skip_special_tokens=sp.skip_special_tokens if sp.HasField("skip_special_tokens") else None,
        spaces_between_special_tokens=(sp.spaces_between_special_tokens
                                       if sp.HasField("spaces_between_special_tokens") else None),  # fmt: skip
        bad_words=list(sp.bad_words) or None,
        allowed_token_ids=list(sp.allowed_token_ids) or None,
        truncate_prompt_tokens=sp.truncate_prompt_tokens if sp.HasField("truncate_prompt_tokens") else None,
    )


def _speculation(sp: pb.SamplingParams) -> SpeculationParams | None:
    """The request's own cap on drafts per step (unset message or field: the server's K)."""
    if not sp.HasField("speculation") or not sp.speculation.HasField("num_speculative_tokens"):
        return None
    return SpeculationParams(num_speculative_tokens=sp.speculation.num_speculative_tokens)


class _Malformed:
    """What the lenient deserializer returns for bytes that are not a valid message."""

    def __init__(self, type_name: str, error: Exception):
        self.type_name, self.error = type_name, error


def _lenient(message_cls: Any) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return message_cls.FromString(raw)
        except DecodeError as exc:
            return _Malformed(message_cls.DESCRIPTOR.full_name, exc)

    return parse


def _parsed(request: Any) -> Any:
    if isinstance(request, _Malformed):
        raise InvalidRequestError("request", f"is not a valid {request.type_name} message ({request.error})")
    return request


def _add_servicer(servicer: "SpecServeServicer", server: grpc.aio.Server) -> None:
    """Register SpecServe as the generated ``add_SpecServeServicer_to_server`` does, but with
    the lenient deserializer, so the handlers answer malformed bytes themselves."""
    service = pb.DESCRIPTOR.services_by_name["SpecServe"]
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler}
    handlers = {}
    for m in service.methods:
        handlers[m.name] = make[(m.client_streaming, m.server_streaming)](
            getattr(servicer, m.name),
            request_deserializer=_lenient(getattr(pb, m.input_type.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(service.full_name, handlers)


def _response(
    request_id: str, text: str, token_ids: list[int], out: RequestOutput, completion_tokens: int, spec_cap: int = 0
) -> pb.GenerateResponse:
    """One response message; ``spec_cap``: the request's cap on drafts per step
    (``Frontend.speculation_cap``), reported with its spec_decode counters."""
    msg = pb.GenerateResponse(
        request_id=request_id,
        text=text,
        token_ids=token_ids,
        usage=pb.Usage(
            prompt_tokens=out.num_prompt_tokens, completion_tokens=completion_tokens,
            accepted_prediction_tokens=out.spec.num_accepted_prediction_tokens,
            rejected_prediction_tokens=out.spec.num_rejected_prediction_tokens,
        ),
    )
    if out.finished:
        msg.finish_reason = _FINISH.get(out.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
        stats = out.spec
        msg.spec_decode.CopyFrom(
            pb.SpecDecodeStats(
                num_drafts=stats.num_drafts,
                num_draft_tokens=stats.num_draft_tokens,
                num_accepted_tokens=stats.num_accepted_tokens,
                mean_acceptance_length=stats.mean_acceptance_length,
                num_speculative_tokens=spec_cap,
            )
        )
    return msg


def _finish_as(msg: pb.GenerateResponse, reason: str | None) -> None:
    """An answer that ended with tool calls finishes with FINISH_REASON_TOOL_CALLS."""
    if reason == "tool_calls":
        msg.finish_reason = pb.FINISH_REASON_TOOL_CALLS


@asynccontextmanager
async def _deadline(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Abort the work inside at the call's deadline (DEADLINE_EXCEEDED)."""
    remaining = context.time_remaining()
    if remaining is None:
        yield
        return
    try:
        async with asyncio.timeout(max(0.0, remaining)):
            yield
    except TimeoutError:
        raise DeadlineExceededError("the call's deadline passed; the request was aborted") from None


class SpecServeServicer(pb_grpc.SpecServeServicer):
    Transcribe = grpc_transcribe  # the audio door (server/audio.py)
    TranscribeStream = grpc_transcribe_stream

    def __init__(self, frontend: Frontend, checker: ApiKeyChecker | None = None):
        self.fe = frontend
        self._checker = checker

    def _tenant(self, context: grpc.aio.ServicerContext | None) -> str | None:
        """The caller's tenant (its key was checked by the interceptor already)."""
        if self._checker is None or context is None:
            return None
        return self._checker.authenticate(_authorization(context.invocation_metadata()))

    async def _prepare(self, request: pb.GenerateRequest | _Malformed,
                       context: grpc.aio.ServicerContext | None = None) -> PreparedRequest:  # fmt: skip
        fe = self.fe
        request = _parsed(request)
        fe.check_model(request.model)
        fields = sampling_fields(request.sampling_params)
        fields.cache_salt = request.cache_salt if request.HasField("cache_salt") else None
        trunc = fields.truncate_prompt_tokens
        if trunc is not None and trunc < 1 and trunc != -1:
            raise InvalidRequestError("truncate_prompt_tokens", f"must be >= 1, or -1 for max_model_len, got {trunc}")
        add = request.add_special_tokens if request.HasField("add_special_tokens") else None
        which = request.WhichOneof("input")
        if which is None:
            raise InvalidRequestError("prompt", "one of prompt, prompt_token_ids or messages is required")
        plan = grpc_plan(fe, request, which == "messages")  # tools, reasoning (grpc_chat)
        field = "prompt"
        if which == "prompt":
            ids = await fe.tokenize_prompt_async(request.prompt, add is not False, trunc)
        elif which == "prompt_token_ids":
            ids = fe.check_token_ids(list(request.prompt_token_ids.ids), truncate=trunc)
        else:
            ids = await render_chat(fe, grpc_messages(request.messages.messages), plan, add_special_tokens=add is True,
                                    truncate=trunc)  # fmt: skip
            field = "messages"
        tenant = self._tenant(context)
        params = fe.make_params(fields, tenant, len(ids), prompt_field=field)  # a default max_tokens fits the prompt
        params = apply_plan(plan, params, ids, fe.engine.tokenizer, field="json_schema")
        params.prediction_token_ids = await fe.tokenize_prediction_async(request.prediction)
        await fe.tokenize_bad_words_async(params)
        req = fe.prepare(request.request_id, ids, params, tenant)
        if which == "messages" and ChatAnswers(plan, fe.engine.tokenizer, ids).active:
            req.answer = GrpcAnswer(plan, plan.prompt_state(fe.engine.tokenizer, ids) if plan.reasoning_on else None)
        return req

    async def _fail(self, context: grpc.aio.ServicerContext, exc: Exception) -> None:
        kind = classify(exc)
        self.fe.record_error(exc)
        if kind is INTERNAL:
            log.error("gRPC request failed", exc_info=exc)
        else:
            log.info("gRPC request refused: %s: %s", kind.name, printable(str(exc), 1000))
        await context.abort(kind.grpc_code, public_message(exc))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        try:
            req = await self._prepare(request, context)
            last: RequestOutput | None = None
            prompt_lps = None
            async with _deadline(context):
                async with aclosing(self.fe.stream(req)) as outputs:
                    async for out in outputs:
                        last = out
                        prompt_lps = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_lps
            assert last is not None and last.finished, "the engine ended a stream without a final output"
            n = len(last.token_ids)
            msg = _response(req.request_id, last.text, list(last.token_ids), last, n,
                            self.fe.speculation_cap(req.params))
            if req.answer is not None:  # content, reasoning and tool calls parsed (grpc_chat)
                _finish_as(msg, req.answer.whole(msg, last.text, last.finish_reason.value))
            tok = self.fe.engine.tokenizer
            msg.logprobs.extend(_logprob_msgs(tok, last.logprobs))
            msg.prompt_logprobs.extend(_logprob_msgs(tok, prompt_lps))
            return msg
        except Exception as exc:  # mapped to a status by the errors table
            await self._fail(context, exc)
            raise  # unreachable: abort raises

    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        try:
            req = await self._prepare(request, context)
            async with _deadline(context):
                async with aclosing(self.fe.stream(req)) as outputs:
                    async for out in outputs:  # tokens come with their text (engine.output)
                        if out.new_token_ids or out.new_text or out.finished:
                            msg = _response(req.request_id, out.new_text, list(out.new_token_ids), out,
                                            len(out.token_ids), self.fe.speculation_cap(req.params))
                            if req.answer is not None:
                                reason = out.finish_reason.value if out.finished and out.finish_reason else None
                                _finish_as(msg, req.answer.delta(msg, out.new_text, reason))
                            tok = self.fe.engine.tokenizer
                            msg.logprobs.extend(_logprob_msgs(tok, out.new_logprobs))
                            msg.prompt_logprobs.extend(_logprob_msgs(tok, out.prompt_logprobs))
                            await context.write(msg)
        except Exception as exc:
            await self._fail(context, exc)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        try:
            _parsed(request)
        except InvalidRequestError as exc:
            await self._fail(context, exc)
        info = self.fe.engine.info
        return pb.ModelInfo(
            model_name=info.model_name,
            method=info.method or "none",
            num_speculative_tokens=info.num_speculative_tokens,
            max_model_len=info.max_model_len,
            dtype=str(info.dtype),
            device=str(info.device),
            lossless=bool(info.lossless),
            tensor_parallel_size=int(getattr(info, "tensor_parallel_size", 1)),
            draft_tensor_parallel_size=int(getattr(info, "draft_tensor_parallel_size", 1)),
            attention_backend=str(getattr(info, "attention_backend", "")),
            rejection_backend=str(getattr(info, "rejection_backend", "")),
            tool_call_format=getattr(info, "tool_call_format", None) or "",
            reasoning_format=getattr(info, "reasoning_format", None) or "",
        )


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Demand ``authorization: Bearer <key>`` on every service but health."""

    def __init__(self, checker: ApiKeyChecker, frontend: Frontend):
        self._checker = checker
        self._fe = frontend

    async def intercept_service(self, continuation, handler_call_details):
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        if service in OPEN_GRPC_SERVICES:
            return await continuation(handler_call_details)
        try:
            self._checker.authenticate(_authorization(handler_call_details.invocation_metadata))
        except UnauthenticatedError as exc:
            self._fe.record_error(exc)
            handler = await continuation(handler_call_details)
            return None if handler is None else _denying_handler(handler, str(exc))
        return await continuation(handler_call_details)


def _authorization(metadata: Any) -> list[str | bytes]:
    """Every ``authorization`` value of a call's metadata (two are refused, as on HTTP)."""
    return [v for k, v in (metadata or ()) if k.lower() == "authorization"]


def _denying_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def deny(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny, **kw)


class GrpcHealth:
    """``grpc.health.v1.Health`` with a status for "" (the server) and for SpecServe."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.servicer.set(name, status)


def _address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


async def start_grpc_server(
    frontend: Frontend,
    grpc_health: GrpcHealth,
    checker: ApiKeyChecker,
    host: str,
    port: int,
    tls: tuple[bytes, bytes] | None,
    idle_timeout_s: float = 30.0,
) -> tuple[grpc.aio.Server, int]:
    """Build, bind and start the server; return it with the bound port."""
    interceptors = [_AuthInterceptor(checker, frontend)] if checker.enabled else []
    idle_ms = max(1, int(idle_timeout_s * 1000))
    options = [
        ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it silently
        ("grpc.max_connection_idle_ms", idle_ms),  # close connections that have no calls
        ("grpc.server_handshake_timeout_ms", idle_ms),  # ... and ones that never finish the handshake
        ("grpc.keepalive_time_ms", idle_ms),  # ping clients of long calls: finds half-open connections
        ("grpc.keepalive_timeout_ms", min(idle_ms, 20_000)),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    _add_servicer(SpecServeServicer(frontend, checker), server)
    health_pb2_grpc.add_HealthServicer_to_server(grpc_health.servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = _address(host, port)
    try:
        if tls is not None:
            cert, key = tls
            bound = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError("server.grpc_port", f"cannot listen on {address}: {exc}") from None
    if not bound:
        raise ConfigError("server.grpc_port", f"cannot listen on {address} (in use or not permitted)")
    await server.start()
    return server, bound
