"""The audio door on a real server (loopback) around the real engine on a tiny random
Granite Speech model with +method=ctc: the official ``openai`` client's
``audio.transcriptions.create`` in every response format and streamed, gRPC
``Transcribe`` / ``TranscribeStream``, long recordings split into segments, every bad
input a 400 / INVALID_ARGUMENT naming its field, stage counters in /metrics, KV freed."""

from __future__ import annotations

import json

import grpc
import numpy as np
import openai
import pytest
from engine_utils import one_thread  # noqa: F401
from server_testutil import http_call, scrape, server_config, total, wait_for

from specserve.audio import AudioClip
from specserve.audio.decode import encode_wav
from specserve.audio.transcription import TranscriptionOptions, join_texts, max_tokens_for, segment_request, \
    segments_of
from specserve.config import Config, ModelConfig, validate_config
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import LLMEngine
from specserve.methods import method_options
from specserve.request import SamplingParams
from specserve.server import start_servers
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc
from tiny_models import make_tiny_speech_model

pytestmark = pytest.mark.timeout(180)

MAX_CLIP_S = 2.0


def recording(seconds: float, seed: int, rate: int = 16000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 1.3 * t)  # louder and quieter stretches: cut points exist
    return (env * (0.3 * np.sin(2 * np.pi * 300 * t) + 0.05 * rng.standard_normal(t.size))).astype(np.float32)


def _cfg(d) -> Config:
    cfg = Config(model=ModelConfig(name="tiny-speech", path=str(d), dtype="float32"),
                 method=method_options("ctc", num_speculative_tokens=8))
    cfg.engine.num_kv_blocks = 256
    cfg.engine.block_size = 4
    cfg.engine.speculation = "fixed"
    cfg.audio.max_clip_s = MAX_CLIP_S
    cfg.audio.max_duration_s = 8.0
    return validate_config(cfg)


class Served:
    def __init__(self, cfg):
        self.llm = LLMEngine(cfg)
        self.engine = AsyncEngine(self.llm, max_queue=64)
        self.handle = start_servers(server_config(max_tokens_cap=512, default_max_tokens=64), self.engine)
        self.http = f"http://127.0.0.1:{self.handle.http_port}"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.handle.grpc_port}")
        self.stub = pb_grpc.SpecServeStub(self.channel)
        self.client = openai.OpenAI(base_url=f"{self.http}/v1", api_key="unused", max_retries=0, timeout=60)

    def kv_free(self) -> bool:
        b = self.llm.blocks
        return b.num_free == b.num_blocks and not self.llm.requests and self.engine.num_in_flight == 0

    def close(self) -> None:
        self.channel.close()
        self.client.close()
        self.handle.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_speech_model(tmp_path_factory.mktemp("speech-api"), "granite", seed=3)


@pytest.fixture(scope="module")
def served(model_dir):
    s = Served(_cfg(model_dir))
    yield s
    s.close()


@pytest.fixture(scope="module")
def offline(model_dir):
    """The transcript of an identically configured offline engine, segment by segment."""
    eng = LLMEngine(_cfg(model_dir))

    def ref(samples: np.ndarray) -> tuple[str, list[str]]:
        texts = []
        for seg in segments_of(samples, MAX_CLIP_S):
            ids, clip = segment_request(eng.target.tokenizer, eng.target.speech, samples, seg, TranscriptionOptions())
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens_for(clip.duration_s), audio=clip)
            texts.append(eng.generate([ids], [params])[0].text)
        return join_texts(texts), texts

    return ref


SHORT = recording(1.5, 1)
LONG = recording(5.2, 2)  # three or four segments of at most 2 s


def _create(served, samples=SHORT, **kw):
    return served.client.audio.transcriptions.create(model="tiny-speech", file=("a.wav", encode_wav(samples)), **kw)


def test_json_text_and_streamed_transcripts_equal_the_offline_engine(served, offline):
    want, _ = offline(SHORT)
    assert want  # the tiny model writes something
    r = _create(served)
    assert r.text == want
    assert r.usage.type == "duration" and r.usage.seconds == 2
    assert sum((r.model_extra or {})["spec_decode"]["ctc_stages"].values()) == 1
    assert _create(served, response_format="text").strip() == want
    events = list(_create(served, stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    [done] = [e for e in events if e.type == "transcript.text.done"]
    assert "".join(deltas) == done.text == want and len(deltas) >= 1
    assert wait_for(served.kv_free)


def test_long_recordings_are_split_and_joined_in_every_format(served, offline):
    want, texts = offline(LONG)
    assert len(texts) >= 3  # cuts at the quietest point of each last second
    r = _create(served, LONG, response_format="verbose_json", timestamp_granularities=["segment"])
    assert r.text == want and [s.text for s in r.segments] == [t.strip() for t in texts]
    assert r.segments[0].start == 0.0 and abs(r.segments[-1].end - 5.2) < 1e-3
    assert all(a.end == b.start for a, b in zip(r.segments, r.segments[1:]))
    assert all(b.end - b.start <= MAX_CLIP_S + 1e-9 for b in r.segments)
    srt = _create(served, LONG, response_format="srt")
    vtt = _create(served, LONG, response_format="vtt")
    cues = [t.strip() for t in texts if t.strip()]
    assert srt.startswith("1\n00:00:00,000 --> ") and all(c in srt for c in cues)
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> ") and all(c in vtt for c in cues)
    events = list(_create(served, LONG, stream=True))
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == want
    assert wait_for(served.kv_free)


def test_grpc_transcribe_unary_and_streamed(served, offline):
    want, texts = offline(LONG)
    req = pb.TranscribeRequest(file=encode_wav(LONG), model="tiny-speech", request_id="g1")
    r = served.stub.Transcribe(req, timeout=60)
    assert r.done and r.text == want and abs(r.duration_s - 5.2) < 1e-3 and len(r.segments) == len(texts)
    assert sum(c.count for c in r.ctc_stages) == len(texts)
    msgs = list(served.stub.TranscribeStream(req, timeout=60))
    assert msgs[-1].done and msgs[-1].text == want
    assert "".join(m.text for m in msgs[:-1]) == want and not any(m.done for m in msgs[:-1])
    assert wait_for(served.kv_free)


def _post(served, path: str, fields: dict, file: tuple[str, bytes] | None) -> tuple[int, dict]:
    """A raw multipart POST (the openai client refuses some of these before sending)."""
    boundary = "specserveboundary"
    body = b""
    for k, v in fields.items():
        for one in v if isinstance(v, list) else [v]:
            body += f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{one}\r\n'.encode()
    if file is not None:
        body += (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{file[0]}"\r\n'
                 f"Content-Type: application/octet-stream\r\n\r\n").encode() + file[1] + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return http_call(f"{served.http}{path}", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})


WAV = encode_wav(SHORT)
BAD = [
    ({"model": "tiny-speech"}, ("a.wav", b"this is not audio at all"), "file"),
    ({"model": "tiny-speech"}, ("a.wav", b""), "file"),
    ({"model": "tiny-speech"}, None, "file"),
    ({"model": "tiny-speech"}, ("a.wav", encode_wav(recording(9.0, 3))), "file"),  # past audio.max_duration_s
    ({"model": "tiny-speech"}, ("a.wav", encode_wav(recording(1.0, 4, 4000), 4000)), "file"),  # 4 kHz
    ({"model": "tiny-speech"}, ("a.wav", encode_wav(np.zeros(100, np.float32))), "file"),  # under 20 ms
    ({"model": "tiny-speech", "response_format": "xml"}, ("a.wav", WAV), "response_format"),
    ({"model": "tiny-speech", "temperature": "1.5"}, ("a.wav", WAV), "temperature"),
    ({"model": "tiny-speech", "temperature": "warm"}, ("a.wav", WAV), "temperature"),
    ({"model": "tiny-speech", "language": "english"}, ("a.wav", WAV), "language"),
    ({"model": "tiny-speech", "timestamp_granularities[]": "word", "response_format": "verbose_json"},
     ("a.wav", WAV), "timestamp_granularities[]"),
    ({"model": "tiny-speech", "timestamp_granularities[]": "segment"}, ("a.wav", WAV), "timestamp_granularities[]"),
    ({"model": "tiny-speech", "stream": "true", "response_format": "srt"}, ("a.wav", WAV), "stream"),
    ({"model": "tiny-speech", "stream": "maybe"}, ("a.wav", WAV), "stream"),
    ({"model": "tiny-speech", "voice": "alloy"}, ("a.wav", WAV), "voice"),
    ({"model": "tiny-speech", "include[]": "logprobs"}, ("a.wav", WAV), "include[]"),
]


@pytest.mark.parametrize("fields,file,param", BAD)
def test_bad_inputs_are_400_naming_the_field(served, fields, file, param):
    status, body = _post(served, "/v1/audio/transcriptions", fields, file)
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    assert wait_for(served.kv_free)


def test_other_bad_requests(served):
    status, body = _post(served, "/v1/audio/transcriptions", {"model": "whisper-1"}, ("a.wav", WAV))
    assert status == 404 and body["error"]["param"] == "model"
    status, body = http_call(f"{served.http}/v1/audio/transcriptions", {"file": "x"})  # JSON, not multipart
    assert status == 400 and body["error"]["param"] == "file"
    status, body = _post(served, "/v1/audio/translations", {"model": "tiny-speech"}, ("a.wav", WAV))
    assert status == 400 and body["error"]["param"] == "model" and "does not translate" in body["error"]["message"]
    with pytest.raises(grpc.RpcError) as e:
        served.stub.Transcribe(pb.TranscribeRequest(file=b"RIFF", model="tiny-speech"), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("file:")
    with pytest.raises(grpc.RpcError) as e:
        served.stub.Transcribe(pb.TranscribeRequest(file=WAV, model="tiny-speech", temperature=3.0), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("temperature:")
    assert wait_for(served.kv_free)


def test_metrics_count_the_ctc_stages(served):
    before = total(scrape(served.http), "specserve_ctc_requests_total", lossless="true")
    _create(served)
    after = total(scrape(served.http), "specserve_ctc_requests_total", lossless="true")
    assert after == before + 1


def test_a_text_model_refuses_to_transcribe(tiny_llama):
    from engine_utils import tiny_config

    s = Served(tiny_config(tiny_llama, num_blocks=64))
    try:
        status, body = _post(s, "/v1/audio/transcriptions", {"model": "tiny"}, ("a.wav", WAV))
        assert status == 400 and body["error"]["param"] == "model" and "not a speech model" in body["error"]["message"]
        with pytest.raises(grpc.RpcError) as e:
            s.stub.Transcribe(pb.TranscribeRequest(file=WAV, model="tiny"), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("model:")
        assert s.kv_free()
    finally:
        s.close()


def test_loadgen_mixes_transcriptions_in(served, tmp_path):
    from specserve.loadgen import main as loadgen_main

    for i in range(2):
        (tmp_path / f"r{i}.wav").write_bytes(encode_wav(recording(0.8 + i, 10 + i)))
    out = tmp_path / "load.json"
    before = total(scrape(served.http), "specserve_ctc_requests_total")
    rc = loadgen_main(["--grpc-target", f"127.0.0.1:{served.handle.grpc_port}", "--http-url", served.http,
                       "--clients", "2", "--duration-s", "4", "--cancel-fraction", "0.1", "--bad-fraction", "0.1",
                       "--transcribe-fraction", "0.5", "--audio-dir", str(tmp_path), "--max-tokens", "8",
                       "--output", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, report["errors"]
    assert report["lost"]["count"] == 0 and not report["errors"]["unexpected"]
    assert total(scrape(served.http), "specserve_ctc_requests_total") > before  # transcriptions ran
    assert wait_for(served.kv_free)
