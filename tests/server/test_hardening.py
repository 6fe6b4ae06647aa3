"""The adversarial probe's findings, each reproduced against the REAL engine (tiny llama,
n-gram speculation) behind real servers on loopback:

1. numbers outside their range (seed, top_k, temperature) are 400 / INVALID_ARGUMENT
   naming the field, and never reach the engine thread: neighbours in flight finish;
2. a huge prompt is refused before tokenizing, and tokenizing never blocks the event
   loop both servers share (health answers at once);
3. (text under speculation: tests/test_detokenizer_property.py and
   test_emoji_speculation.py)
4. tiny temperatures are greedy, not NaN; Infinity is refused;
5. client mistakes (lone surrogate, deeply nested JSON, non-UTF-8 auth bytes) are 4xx,
   not 500, and do not count as internal errors;
6. idle and half-open connections are closed;
7. a cancelled request's id can be reused at once;
plus: a failure injected into each per-request stage fails that request alone.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import grpc
import pytest
from server_testutil import http_call, scrape, total, wait_for
from test_real_engine import MODEL, RealServed, StepGate, engine_config, grpc_request, wait_kv_free

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.engine import LLMEngine
from specserve.engine.scheduler import Scheduler
from specserve.engine.tokenizer import Tokenizer
from specserve.v1 import specserve_pb2 as pb

pytestmark = pytest.mark.timeout(120)

LONG = 150  # tokens for a neighbour that must still be running while bad requests arrive


@pytest.fixture(scope="module")
def served(tiny_llama):
    s = RealServed(engine_config(tiny_llama))  # default idle and body timeouts: uploads take what they take
    yield s
    s.close()


@pytest.fixture
def gate(served, monkeypatch):
    g = StepGate(monkeypatch, served.llm)
    yield g
    g.release()  # never leave the module's engine stuck


class Neighbour:
    """A long greedy stream in a thread: it must finish untouched by what happens around it.
    With a ``gate`` it is held mid-generation (after its prefill step) until ``check``."""

    def __init__(self, s: RealServed, prompt: str = "w40 w41 w42 w40 w41", gate: StepGate | None = None):
        self.result: dict | None = None
        self.gate = gate
        body = {"model": MODEL, "prompt": prompt, "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
        if gate is not None:
            gate.hold_after(1)
        self.thread = threading.Thread(target=lambda: setattr(self, "result", http_call(f"{s.http}/v1/completions", body)))
        self.thread.start()
        if gate is not None:
            gate.wait_holding()
            assert s.llm.num_running == 1  # running, and it stays so while the gate holds
        else:  # it runs next to what the test does (or has finished: check() compares its output)
            assert wait_for(lambda: s.engine.num_in_flight >= 1 or self.result is not None, 30)

    def check(self, s: RealServed, offline) -> None:
        if self.gate is not None:
            assert s.llm.num_running == 1 and self.result is None  # untouched until now
            self.gate.release()
        self.thread.join(60)
        status, body = self.result
        assert status == 200, body
        ref = offline(s.engine.tokenizer.encode("w40 w41 w42 w40 w41"), LONG, ignore_eos=True)
        assert body["choices"][0]["text"] == ref.text and body["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def offline(tiny_llama):
    from test_real_engine import SamplingParams

    eng = LLMEngine(engine_config(tiny_llama))
    cache: dict = {}

    def ref(ids, max_tokens=24, ignore_eos=False):
        key = (tuple(ids), max_tokens, ignore_eos)
        if key not in cache:
            cache[key] = eng.generate([list(ids)], [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)])[0]
        return cache[key]

    return ref


def post_raw(s: RealServed, raw: bytes, path: str = "/v1/completions", headers: dict | None = None):
    return http_call(f"{s.http}{path}", raw, headers)


def healthy(s: RealServed) -> bool:
    return http_call(f"{s.http}/health")[0] == 200


def internal_errors(s: RealServed, api_key: str | None = None) -> float:
    return total(scrape(s.http, api_key), "specserve_request_errors_total", reason="internal")


# --------------------------------------------------------------------------- 1 and 4: ranges


BAD_BODIES = [
    ("seed", b'{"prompt":"w1 w2","max_tokens":4,"seed":18446744073709551616}'),
    ("seed", b'{"prompt":"w1 w2","max_tokens":4,"seed":-9223372036854775809}'),
    ("top_k", b'{"prompt":"w1 w2","max_tokens":4,"temperature":1,"top_k":9223372036854775808}'),
    ("top_k", b'{"prompt":"w1 w2","max_tokens":4,"temperature":1,"top_k":513}'),
    ("temperature", b'{"prompt":"w1 w2","max_tokens":4,"temperature":Infinity}'),
    ("temperature", b'{"prompt":"w1 w2","max_tokens":4,"temperature":2.5}'),
    ("temperature", b'{"prompt":"w1 w2","max_tokens":4,"temperature":NaN}'),
    ("top_p", b'{"prompt":"w1 w2","max_tokens":4,"top_p":-Infinity}'),
    ("max_tokens", b'{"prompt":"w1 w2","max_tokens":99999999999999999999}'),
    ("stop", json.dumps({"prompt": "w1", "stop": [f"s{i}" for i in range(33)]}).encode()),
    ("stop", json.dumps({"prompt": "w1", "stop": ["x" * 513]}).encode()),
    ("stop_token_ids", b'{"prompt":"w1 w2","max_tokens":4,"stop_token_ids":[100000]}'),
]


def test_out_of_range_numbers_are_400_and_the_engine_keeps_serving(served, offline, gate):
    s = served
    n = Neighbour(s, gate=gate)  # held: the refusals below must not reach the engine thread
    for field, raw in BAD_BODIES:
        status, body = post_raw(s, raw)
        assert status == 400 and body["error"]["param"] == field, (raw, body)
    # gRPC: the same rules (seed is an int64 there, so only top_k can overflow the vocabulary)
    req = grpc_request("w1 w2", max_tokens=4)
    req.sampling_params.temperature = 1.0
    req.sampling_params.top_k = 2**31 - 1
    with pytest.raises(grpc.RpcError) as err:
        s.stub.Generate(req, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("top_k:")
    req = grpc_request("w1 w2", max_tokens=4)
    req.sampling_params.temperature = float("inf")
    with pytest.raises(grpc.RpcError) as err:
        s.stub.Generate(req, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("temperature:")
    assert healthy(s)
    n.check(s, offline)
    # the extremes of the documented seed range are accepted
    for seed in (-(2**63), 2**64 - 1):
        status, body = post_raw(s, json.dumps({"prompt": "w1 w2", "max_tokens": 4, "seed": seed}).encode())
        assert status == 200, body
    wait_kv_free(s)


def test_tiny_temperatures_are_greedy_not_nan(served, offline):
    s = served
    ids = s.engine.tokenizer.encode("w9 w8 w7 w9 w8")
    want = offline(ids, 12, ignore_eos=True).text
    for temperature in (1e-45, 5e-324, 1e-6):
        body = {"prompt": "w9 w8 w7 w9 w8", "max_tokens": 12, "temperature": temperature, "ignore_eos": True}
        status, out = http_call(f"{s.http}/v1/completions", body)
        assert status == 200 and out["choices"][0]["text"] == want, (temperature, out)


# --------------------------------------------------------------------------- 2: huge prompts


def test_huge_prompt_is_refused_at_once_and_health_stays_responsive(served, monkeypatch):
    """Refused from its length alone: the tokenizer never sees the huge text (what made it
    slow), and /health answers every probe meanwhile."""
    s = served
    tokenized: list[int] = []  # lengths of the texts the tokenizer was given
    for name in ("encode", "apply_chat_template"):
        real = getattr(Tokenizer, name)

        def spy(self, text, *a, _real=real, **kw):
            tokenized.append(len(text) if isinstance(text, str) else sum(len(m["content"]) for m in text))
            return _real(self, text, *a, **kw)

        monkeypatch.setattr(Tokenizer, name, spy)
    statuses: list[bool] = []
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            statuses.append(healthy(s))
            stop.wait(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        status, body = post_raw(s, json.dumps({"prompt": "w1 " * 5_000_000, "max_tokens": 4}).encode())  # 15 MB
        assert status == 400 and body["error"]["param"] == "prompt" and "max_model_len" in body["error"]["message"]
        with pytest.raises(grpc.RpcError) as err:  # gRPC: 3.9 MB (its message cap is 4 MB)
            s.stub.Generate(grpc_request("w1 " * 1_300_000, max_tokens=4), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("prompt:")
        chat = {"messages": [{"role": "user", "content": "w2 " * 3_000_000}], "max_tokens": 4}
        status, body = post_raw(s, json.dumps(chat).encode(), "/v1/chat/completions")
        assert status == 400 and body["error"]["param"] == "messages"
    finally:
        stop.set()
        prober.join()
    assert max(tokenized, default=0) < 100_000, tokenized
    assert statuses and all(statuses), statuses
    assert healthy(s)


def test_slow_tokenization_runs_off_the_event_loop(served, monkeypatch):
    """A prompt that takes long to tokenize must not stall the loop: /health and gRPC
    GetModelInfo answer while it is being tokenized.  Here tokenizing it blocks until the
    test has had those answers; on the event loop, they could never come."""
    s = served
    real = Tokenizer.encode
    tokenizing, answered = threading.Event(), threading.Event()

    def slow(self, text, *a, **kw):
        if text.startswith("w77 slow"):
            tokenizing.set()
            answered.wait(60)
        return real(self, text, *a, **kw)

    monkeypatch.setattr(Tokenizer, "encode", slow)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=http_call(f"{s.http}/v1/completions", {"prompt": "w77 slow", "max_tokens": 2})))
    t.start()
    try:
        assert tokenizing.wait(30)  # the request is now being tokenized, and stays so
        assert healthy(s)
        s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert t.is_alive() and "r" not in result  # both answered while it was still tokenizing
    finally:
        answered.set()
    t.join(30)
    assert result["r"][0] == 200


# --------------------------------------------------------------------------- 5: client mistakes are 4xx


def test_client_mistakes_are_400_not_internal(served):
    s = served
    before = internal_errors(s)
    status, body = post_raw(s, b'{"prompt": "w1 \\ud800 w2", "max_tokens": 2}')
    assert status == 400 and body["error"]["param"] == "prompt", body
    chat = b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
    status, body = post_raw(s, chat, "/v1/chat/completions")
    assert status == 400 and body["error"]["param"] == "messages[0].content", body
    status, body = post_raw(s, b'{"prompt": "w1", "stop": ["\\ud83d"]}')
    assert status == 400 and body["error"]["param"] == "stop", body
    deep = b"[" * 100_000 + b"]" * 100_000
    for raw in (deep, b'{"prompt": ' + deep + b"}"):
        status, body = post_raw(s, raw)
        assert status == 400 and body["error"]["param"] == "body", body
    assert internal_errors(s) == before
    assert healthy(s)


def test_non_utf8_authorization_is_401(make_served_real):
    s = make_served_real(api_key="sekret")
    before = internal_errors(s, "sekret")
    with socket.create_connection(("127.0.0.1", s.handle.http_port), timeout=30) as sock:
        body = b'{"prompt": "w1", "max_tokens": 1}'
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer s\xffkret\xc3\r\nContent-Length: " + str(len(body)).encode() + b"\r\n"
            b"Connection: close\r\n\r\n" + body
        )
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert internal_errors(s, "sekret") == before
    status, _ = http_call(f"{s.http}/v1/completions", {"prompt": "w1", "max_tokens": 1}, {"Authorization": "Bearer sekret"})
    assert status == 200


@pytest.fixture
def make_served_real(tiny_llama):
    made = []

    def make(**overrides):
        s = RealServed(engine_config(tiny_llama), **overrides)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


# --------------------------------------------------------------------------- 6: idle and half-open connections


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the peer closes the connection within `seconds` (whatever it sends first)."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True
    return False


def test_idle_and_half_open_connections_are_closed(make_served_real):
    s = make_served_real(idle_timeout_s=1.0, body_timeout_s=1.0)  # its own server: short timers for this test only
    # The server's 1 s timers close them; the 30 s waits are only a safety net against a hang.
    with socket.create_connection(("127.0.0.1", s.handle.http_port)) as idle:
        assert closed_within(idle, 30.0)
    with socket.create_connection(("127.0.0.1", s.handle.http_port)) as partial:
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        assert closed_within(partial, 30.0)
    with socket.create_connection(("127.0.0.1", s.handle.http_port)) as slow_body:
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        slow_body.settimeout(30.0)
        assert slow_body.recv(65536).startswith(b"HTTP/1.1 400")
    with socket.create_connection(("127.0.0.1", s.handle.grpc_port)) as grpc_idle:
        assert closed_within(grpc_idle, 30.0)
    assert healthy(s)


# --------------------------------------------------------------------------- 7: request ids


def test_a_cancelled_request_id_is_free_at_once(served):
    s = served
    for _ in range(5):
        req = grpc_request("w3 w4 w5", max_tokens=LONG, ignore_eos=True)
        req.request_id = "reused-id"
        call = s.stub.GenerateStream(req, timeout=30)
        next(call)
        call.cancel()
        again = grpc_request("w3 w4 w5", max_tokens=2)
        again.request_id = "reused-id"
        resp = s.stub.Generate(again, timeout=30)
        assert resp.request_id == "reused-id" and len(resp.token_ids) == 2
    wait_kv_free(s)


# --------------------------------------------------------------------------- one request's failure is its own

# The victim is the only request with this stop list, seed and max_tokens.
VICTIM = "w99 w98 w97"
MARK = ["w1 w1 w1"]

STAGES = {
    "admission": (Scheduler, "add", lambda orig: lambda self, seq: _raise() if seq.params.stop == MARK else orig(self, seq)),
    "seeding": (LLMEngine, "_request_seed", lambda orig: lambda self, p: _raise() if p.seed == 4242 else orig(self, p)),
    "sampling tensors": (LLMEngine, "_sampling_row", lambda orig: staticmethod(lambda p: _raise() if p.max_tokens == 13 else orig(p))),
    "detokenization": (IncrementalDetokenizer, "_decode_new", lambda orig: lambda self, final: _raise() if self.stop == MARK else orig(self, final)),
    "stop matching": (IncrementalDetokenizer, "_cut_at_stop", lambda orig: lambda self, start: _raise() if self.stop == MARK else orig(self, start)),
}


def _raise():
    raise RuntimeError("injected failure")


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_failure_in_one_requests_stage_fails_only_that_request(served, offline, monkeypatch, stage):
    s = served
    owner, name, wrap = STAGES[stage]
    orig = owner.__dict__[name]
    monkeypatch.setattr(owner, name, wrap(orig.__func__ if isinstance(orig, staticmethod) else orig))
    n = Neighbour(s)
    victim = {"prompt": VICTIM, "max_tokens": 13, "seed": 4242, "stop": MARK, "temperature": 0}
    status, body = http_call(f"{s.http}/v1/completions", victim)
    assert status == 500 and body["error"]["code"] == "request_failed", body
    assert "injected failure" in body["error"]["message"]
    req = grpc_request(VICTIM, max_tokens=13)
    req.sampling_params.seed = 4242
    req.sampling_params.stop.extend(MARK)
    with pytest.raises(grpc.RpcError) as err:
        s.stub.Generate(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    n.check(s, offline)
    assert healthy(s) and s.engine.healthy
    wait_kv_free(s)
    assert total(scrape(s.http), "specserve_request_errors_total", reason="request_failed") >= 2
