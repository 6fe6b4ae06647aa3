"""The audio door: OpenAI's ``POST /v1/audio/transcriptions`` (and a clear refusal of
``/v1/audio/translations``) on HTTP, and the ``Transcribe`` / ``TranscribeStream`` RPCs on
gRPC.  Both translate their wire fields into ``audio.transcription.TranscriptionOptions``
and a decoded recording, and read the same per-segment output streams of the frontend
(``server.frontend.Frontend.stream``), one engine request per segment in order.

HTTP: multipart/form-data with ``file`` (wav, flac, ogg, mp3; at most
``audio.max_upload_bytes``), ``model``, ``language``, ``prompt``, ``response_format``
(json | text | verbose_json | srt | vtt), ``temperature``, ``timestamp_granularities[]``,
``stream`` (server-sent events ``transcript.text.delta`` with ``delta``, then
``transcript.text.done`` with ``text`` and ``usage``), ``seed``, ``cache_salt``.  Answers
carry ``usage`` in seconds of audio and, as specserve's extension, ``spec_decode`` with the
CTC stage counts.  Decoding, resampling and splitting run in the frontend's worker
threads, never on the event loop.  Every bad input is a 400 (INVALID_ARGUMENT) naming the
field: not audio, empty, too long, a sample rate under 8 kHz, an unknown field, a text
model asked to transcribe.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

from aiohttp import web

from specserve.audio.decode import Audio, decode_audio
from specserve.audio.transcription import (
    DeltaJoiner, Segment, TranscriptionOptions, join_texts, max_tokens_for, segment_request, segments_of, stage_counts, to_srt,
    to_vtt, usage, verbose_json,
)
from specserve.errors import InvalidRequestError
from specserve.request import RequestOutput
from specserve.server.errors import INTERNAL, DeadlineExceededError, classify, openai_error_body
from specserve.server.frontend import SamplingFields

log = logging.getLogger(__name__)

MAX_FIELD_BYTES = 64 * 1024
FORM_FIELDS = ("file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]",
               "timestamp_granularities", "stream", "seed", "cache_salt", "chunking_strategy", "include[]")


class SpeechDoor:
    """What the doors need of the served model; refuses a text model in one line."""

    def __init__(self, fe: Any):
        engine = getattr(getattr(fe, "engine", None), "engine", None)  # the AsyncEngine's LLMEngine
        target = getattr(engine, "target", None)
        self.fe = fe
        self.speech = getattr(target, "speech", None)
        if self.speech is None:
            name = getattr(getattr(engine, "info", None), "model_name", "this model")
            raise InvalidRequestError("model", f"{name!r} is not a speech model: it cannot transcribe")
        self.tokenizer = target.tokenizer
        self.audio_cfg = engine.cfg.audio
        self.languages = getattr(self.speech, "languages", None)

    def decode(self, data: bytes) -> Audio:
        a = decode_audio(data, "file", self.audio_cfg.max_duration_s)
        if a.source_rate < 8000:
            raise InvalidRequestError("file", f"is sampled at {a.source_rate} Hz; at least 8000 Hz is needed")
        return a

    async def run(self, audio: Audio, opts: TranscriptionOptions, tenant: str | None, cache_salt: str | None,
                  request_id: str | None = None) -> AsyncIterator[tuple[Segment, RequestOutput]]:
        """Every output of every segment, in order (segment by segment)."""
        fe = self.fe
        segs = await fe.run_off_loop(segments_of, audio.samples, self.audio_cfg.max_clip_s)
        for seg in segs:
            ids, clip = await fe.run_off_loop(segment_request, self.tokenizer, self.speech, audio.samples, seg, opts)
            fields = SamplingFields(temperature=float(opts.temperature), max_tokens=None, seed=opts.seed,
                                    cache_salt=cache_salt)
            params = fe.make_params(fields, tenant, len(ids))
            params.max_tokens = min(params.max_tokens, max_tokens_for(clip.duration_s))
            params.audio = clip
            rid = f"{request_id}-{seg.index}" if request_id else None
            req = fe.prepare(rid, ids, params)
            async with aclosing(fe.stream(req)) as outs:
                async for out in outs:
                    if out.finished:
                        seg.text, seg.token_ids, seg.outputs = out.text, list(out.token_ids), out
                    yield seg, out

    @staticmethod
    def spec_decode(segs: list[Segment]) -> dict[str, Any]:
        outs = [s.outputs for s in segs if s.outputs is not None]
        return {
            "num_drafts": sum(o.spec.num_drafts for o in outs),
            "num_draft_tokens": sum(o.spec.num_draft_tokens for o in outs),
            "num_accepted_tokens": sum(o.spec.num_accepted_tokens for o in outs),
            "ctc_stages": stage_counts([o.spec.ctc_stage for o in outs]),
        }


# ----------------------------------------------------------------------------- HTTP
async def _read_form(request: web.Request, max_upload: int) -> tuple[bytes, dict[str, Any]]:
    if not request.content_type.startswith("multipart/"):
        raise InvalidRequestError("file", "the request must be multipart/form-data with a file part")
    try:
        reader = await request.multipart()
    except Exception as e:
        raise InvalidRequestError("file", f"the multipart body cannot be read: {e}") from None
    data: bytes | None = None
    fields: dict[str, Any] = {"timestamp_granularities[]": []}
    while True:
        try:
            part = await reader.next()
        except Exception as e:
            raise InvalidRequestError("file", f"the multipart body cannot be read: {e}") from None
        if part is None:
            break
        name = part.name or ""
        if name not in FORM_FIELDS:
            raise InvalidRequestError(name or "file", "is not a field of /v1/audio/transcriptions")
        limit = max_upload if name == "file" else MAX_FIELD_BYTES
        buf = bytearray()
        while True:
            chunk = await part.read_chunk(1 << 16)
            if not chunk:
                break
            buf.extend(chunk)
            if len(buf) > limit:
                raise InvalidRequestError(name, f"is larger than {limit} bytes"
                                                + (" (audio.max_upload_bytes)" if name == "file" else ""))
        if name == "file":
            data = bytes(buf)
            continue
        try:
            text = buf.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequestError(name, "must be UTF-8 text") from None
        if name in ("timestamp_granularities[]", "timestamp_granularities"):
            fields["timestamp_granularities[]"].append(text)
        elif name == "include[]":
            raise InvalidRequestError("include[]", f"{text!r} is not available (logprobs are not returned here)")
        else:
            fields[name] = text
    if data is None:
        raise InvalidRequestError("file", "is required: an audio file (wav, flac, ogg or mp3)")
    return data, fields


def _options(fields: dict[str, Any], languages: tuple[str, ...] | None) -> TranscriptionOptions:
    def number(name: str, cast: Any) -> Any:
        if name not in fields:
            return None
        try:
            return cast(fields[name])
        except ValueError:
            raise InvalidRequestError(name, f"must be a number; got {fields[name][:40]!r}") from None

    stream = fields.get("stream", "false").strip().lower()
    if stream not in ("true", "false"):
        raise InvalidRequestError("stream", f"must be true or false; got {stream[:20]!r}")
    cs = fields.get("chunking_strategy")
    if cs is not None and cs.strip('"') != "auto":
        raise InvalidRequestError("chunking_strategy", "only auto is supported (split at low-energy points)")
    temperature = number("temperature", float)
    return TranscriptionOptions(
        language=fields.get("language") or None, prompt=fields.get("prompt") or None,
        response_format=fields.get("response_format", "json"),
        temperature=0.0 if temperature is None else temperature,
        timestamp_granularities=fields["timestamp_granularities[]"], stream=stream == "true",
        seed=number("seed", int),
    ).check(languages)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def add_audio_routes(app: web.Application, frontend_key: Any, tenant_key: Any) -> None:
    """Register the audio routes on the HTTP app (``server.http_app``)."""

    async def transcriptions(request: web.Request) -> web.StreamResponse:
        fe = request.app[frontend_key]
        door = SpeechDoor(fe)  # a text model: 400 naming model, before the upload is read
        data, fields = await _read_form(request, door.audio_cfg.max_upload_bytes)
        fe.check_model(fields.get("model"))
        opts = _options(fields, door.languages)
        audio = await fe.run_off_loop(door.decode, data)
        tenant, salt = request.get(tenant_key), fields.get("cache_salt")
        items = door.run(audio, opts, tenant, salt)
        if opts.stream:
            return await _stream(request, fe, door, audio, items)
        segs: list[Segment] = []
        async with aclosing(items) as it:
            async for seg, out in it:
                if out.finished:
                    segs.append(seg)
        text = join_texts([s.text for s in segs])
        if opts.response_format == "text":
            return web.Response(text=text + "\n", content_type="text/plain")
        if opts.response_format == "srt":
            return web.Response(text=to_srt(segs), content_type="text/plain")
        if opts.response_format == "vtt":
            return web.Response(text=to_vtt(segs), content_type="text/vtt")
        extra = {"spec_decode": door.spec_decode(segs)}
        if opts.response_format == "verbose_json":
            return web.json_response(verbose_json(segs, audio.duration_s, opts.language, opts.temperature, extra))
        return web.json_response({"text": text, "usage": usage(audio.duration_s), **extra})

    async def translations(request: web.Request) -> web.StreamResponse:
        fe = request.app[frontend_key]
        SpeechDoor(fe)  # a text model: 400 naming model
        name = fe.engine.engine.info.model_name
        raise InvalidRequestError("model", f"{name!r} transcribes but does not translate; use /v1/audio/transcriptions")

    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    app.router.add_post("/v1/audio/translations", translations)


async def _stream(request: web.Request, fe: Any, door: SpeechDoor, audio: Audio,
                  items: AsyncIterator[tuple[Segment, RequestOutput]]) -> web.StreamResponse:
    segs: list[Segment] = []
    async with aclosing(items) as it:
        first = await anext(it, None)  # errors before the first output keep their HTTP status
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        try:
            item, joiner = first, DeltaJoiner()
            while item is not None:
                seg, out = item
                if not segs or segs[-1] is not seg:
                    segs.append(seg)
                delta = joiner.feed(seg, out.new_text) if out.new_text else ""
                if delta:
                    await response.write(_sse({"type": "transcript.text.delta", "delta": delta}))
                item = await anext(it, None)
            done = {"type": "transcript.text.done", "text": join_texts([s.text for s in segs]),
                    "usage": usage(audio.duration_s), "spec_decode": door.spec_decode(segs)}
            await response.write(_sse(done))
        except ConnectionError:
            raise
        except Exception as exc:  # after the headers: in-band, as the chat door does
            fe.record_error(exc)
            if classify(exc) is INTERNAL:
                log.error("transcription stream failed", exc_info=exc)
            await response.write(_sse(openai_error_body(exc)[1]))
        await response.write_eof()
        return response


# ----------------------------------------------------------------------------- gRPC
def _grpc_options(request: Any, languages: tuple[str, ...] | None) -> TranscriptionOptions:
    return TranscriptionOptions(
        language=request.language if request.HasField("language") else None,
        prompt=request.prompt if request.HasField("prompt") else None,
        response_format="json", temperature=request.temperature if request.HasField("temperature") else 0.0,
        seed=request.seed if request.HasField("seed") else None,
    ).check(languages)


@asynccontextmanager
async def _deadline(context: Any) -> AsyncIterator[None]:
    """Abort the work inside at the call's deadline (DEADLINE_EXCEEDED), as Generate does."""
    remaining = context.time_remaining()
    if remaining is None:
        yield
        return
    try:
        async with asyncio.timeout(max(0.0, remaining)):
            yield
    except TimeoutError:
        raise DeadlineExceededError("the call's deadline passed; the request was aborted") from None


async def _grpc_items(servicer: Any, request: Any, context: Any):
    if not hasattr(request, "HasField"):  # the servicer's lenient parser could not read the bytes
        raise InvalidRequestError("request", f"is not a valid specserve.v1.TranscribeRequest message "
                                             f"({getattr(request, 'error', '')})")
    fe = servicer.fe
    door = SpeechDoor(fe)
    fe.check_model(request.model)
    if len(request.file) > door.audio_cfg.max_upload_bytes:
        raise InvalidRequestError("file", f"is larger than {door.audio_cfg.max_upload_bytes} bytes "
                                          "(audio.max_upload_bytes)")
    opts = _grpc_options(request, door.languages)
    audio = await fe.run_off_loop(door.decode, bytes(request.file))
    salt = request.cache_salt if request.HasField("cache_salt") else None
    return door, audio, door.run(audio, opts, servicer._tenant(context), salt, request.request_id or None)


def _grpc_response(pb: Any, rid: str, text: str, segs: list[Segment], audio: Audio | None, door: SpeechDoor,
                   done: bool) -> Any:
    msg = pb.TranscribeResponse(request_id=rid, text=text, done=done)
    if done and audio is not None:
        msg.duration_s = audio.duration_s
        msg.segments.extend(pb.TranscriptSegment(id=s.index, start_s=s.start_s, end_s=s.end_s, text=s.text.strip())
                            for s in segs)
        sd = door.spec_decode(segs)
        msg.spec_decode.num_drafts = sd["num_drafts"]
        msg.spec_decode.num_draft_tokens = sd["num_draft_tokens"]
        msg.spec_decode.num_accepted_tokens = sd["num_accepted_tokens"]
        msg.ctc_stages.extend(pb.CtcStageCount(stage=k, count=n) for k, n in sorted(sd["ctc_stages"].items()))
    return msg


async def grpc_transcribe(servicer: Any, request: Any, context: Any) -> Any:
    """``Transcribe``: the whole transcript in one message."""
    from specserve.v1 import specserve_pb2 as pb

    try:
        door, audio, items = await _grpc_items(servicer, request, context)
        segs: list[Segment] = []
        async with _deadline(context):
            async with aclosing(items) as it:
                async for seg, out in it:
                    if out.finished:
                        segs.append(seg)
        return _grpc_response(pb, request.request_id, join_texts([s.text for s in segs]), segs, audio, door, True)
    except Exception as exc:
        await servicer._fail(context, exc)
        raise


async def grpc_transcribe_stream(servicer: Any, request: Any, context: Any) -> None:
    """``TranscribeStream``: text deltas, then a message with done, the whole text and usage."""
    from specserve.v1 import specserve_pb2 as pb

    try:
        door, audio, items = await _grpc_items(servicer, request, context)
        segs: list[Segment] = []
        joiner = DeltaJoiner()
        async with _deadline(context):
            async with aclosing(items) as it:
                async for seg, out in it:
                    if not segs or segs[-1] is not seg:
                        segs.append(seg)
                    delta = joiner.feed(seg, out.new_text) if out.new_text else ""
                    if delta:
                        await context.write(_grpc_response(pb, request.request_id, delta, segs, None, door, False))
        await context.write(_grpc_response(pb, request.request_id, join_texts([s.text for s in segs]), segs, audio,
                                           door, True))
    except Exception as exc:
        await servicer._fail(context, exc)

