"""Queue limits, API keys, engine failure, drain and SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import grpc
import openai
import pytest
from fake_engine import FakeEngine
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_testutil import http_call, wait_for

from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def grpc_health(served, service: str = "specserve.v1.SpecServe") -> int:
    return health_pb2_grpc.HealthStub(served.channel).Check(health_pb2.HealthCheckRequest(service=service)).status


def _req(request_id: str = "", max_tokens: int = 4) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=max_tokens)
    return pb.GenerateRequest(request_id=request_id, prompt="abc", sampling_params=params)


def _stream_in_background(served, request_id: str, max_tokens: int) -> tuple[threading.Thread, list]:
    messages: list = []

    def run() -> None:
        try:
            messages.extend(served.stub.GenerateStream(_req(request_id, max_tokens)))
        except grpc.RpcError as exc:
            messages.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, messages


@pytest.mark.parametrize("limited_by", ["engine", "server"])
def test_queue_full_is_resource_exhausted_and_429(make_served, limited_by):
    if limited_by == "engine":
        engine = FakeEngine(max_running=1, max_queue=1)
        engine.hold.clear()  # running requests make no progress
        s = make_served(engine)
    else:
        engine = FakeEngine(max_running=1, max_queue=100)
        engine.hold.clear()
        s = make_served(engine, max_queue=1)
    t1, out1 = _stream_in_background(s, "running", 4)
    assert wait_for(lambda: engine.num_running == 1)
    t2, out2 = _stream_in_background(s, "waiting", 4)
    assert wait_for(lambda: engine.num_waiting == 1)

    with pytest.raises(grpc.RpcError) as err:
        s.stub.Generate(_req())
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status, body = http_call(s.http + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 429 and body["error"]["code"] == "queue_full"

    engine.hold.set()
    t1.join(5)
    t2.join(5)
    assert out1[-1].finish_reason == pb.FINISH_REASON_LENGTH and out2[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert s.stub.Generate(_req()).finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize("via_env", [False, True], ids=["config", "env"])
def test_api_key(make_served, monkeypatch, via_env):
    if via_env:
        monkeypatch.setenv("TEST_SPECSERVE_KEY", "sekret")
        s = make_served(api_key=None, api_key_env="TEST_SPECSERVE_KEY")
    else:
        s = make_served(api_key="sekret")
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "sekret"),)):
        with pytest.raises(grpc.RpcError) as err:
            s.stub.Generate(_req(), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        list(s.stub.GenerateStream(_req()))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ok = s.stub.Generate(_req(), metadata=(("authorization", "Bearer sekret"),))
    assert ok.finish_reason == pb.FINISH_REASON_LENGTH
    assert grpc_health(s) == SERVING  # health needs no key (probes cannot send one)

    with pytest.raises(openai.AuthenticationError):
        s.openai(api_key="wrong").completions.create(model="fake-model", prompt="hi", max_tokens=2)
    status, body = http_call(s.http + "/v1/models")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert s.openai(api_key="sekret").completions.create(model="fake-model", prompt="hi", max_tokens=2).choices
    assert http_call(s.http + "/health")[0] == 200
    assert http_call(s.http + "/metrics")[0] == 200


def test_engine_failure_turns_health_not_serving_and_fails_requests(make_served):
    engine = FakeEngine(step_delay_s=0.02)
    engine.hold.clear()
    s = make_served(engine)
    thread, out = _stream_in_background(s, "inflight", 20)
    assert wait_for(lambda: engine.num_running == 1)
    engine.fail("CUDA went away")
    thread.join(5)
    assert not thread.is_alive(), "the in-flight stream hangs after an engine failure"
    assert isinstance(out[-1], grpc.RpcError) and out[-1].code() == grpc.StatusCode.INTERNAL
    assert "CUDA went away" in out[-1].details()

    assert wait_for(lambda: grpc_health(s) == NOT_SERVING and grpc_health(s, "") == NOT_SERVING)
    assert http_call(s.http + "/health")[0] == 503
    with pytest.raises(grpc.RpcError) as err:
        s.stub.Generate(_req())
    assert err.value.code() == grpc.StatusCode.INTERNAL
    status, body = http_call(s.http + "/v1/completions", {"prompt": "hi"})
    assert status == 500 and body["error"]["code"] == "engine_dead"


def test_a_silently_dead_engine_does_not_hang_clients(make_served):
    engine = FakeEngine(step_delay_s=0.02)
    s = make_served(engine)
    s.handle.servers.engine_dead_grace_s = 0.3
    thread, out = _stream_in_background(s, "hung", 40)
    assert wait_for(lambda: len(out) >= 1)
    engine.fail("wedged", silent=True)
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(out[-1], grpc.RpcError) and out[-1].code() == grpc.StatusCode.INTERNAL
    assert "hung" in engine.aborted  # the abandoned generator was closed


def test_engine_failure_mid_sse_ends_the_stream_with_an_error_event(make_served):
    engine = FakeEngine(step_delay_s=0.02)
    s = make_served(engine)
    conn = http.client.HTTPConnection("127.0.0.1", s.handle.http_port, timeout=5)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 60, "stream": True}),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    engine.fail("boom")
    events = [e for e in resp.read().decode().split("\n\n") if e.strip()]
    conn.close()
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: ") :])["error"]["code"] == "engine_dead"


def test_drain_finishes_in_flight_and_refuses_new_work(make_served):
    engine = FakeEngine(step_delay_s=0.03)
    s = make_served(engine)
    thread, out = _stream_in_background(s, "slow", 40)
    assert wait_for(lambda: len(out) >= 1)
    drained = s.handle.begin_drain(timeout_s=10)

    assert wait_for(lambda: grpc_health(s) == NOT_SERVING)
    assert http_call(s.http + "/health") == (503, {"status": "draining"})
    with pytest.raises(grpc.RpcError) as err:
        s.stub.Generate(_req())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    status, body = http_call(s.http + "/v1/completions", {"prompt": "hi"})
    assert status == 503 and body["error"]["code"] == "server_draining"

    thread.join(10)
    drained.result(10)
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert "".join(m.text for m in out) and sum(len(m.token_ids) for m in out) == 40


def test_drain_timeout_aborts_what_is_left(make_served):
    engine = FakeEngine()
    engine.hold.clear()  # never finishes on its own
    s = make_served(engine)
    thread, out = _stream_in_background(s, "stuck", 40)
    assert wait_for(lambda: engine.num_running == 1)
    s.handle.drain(timeout_s=0.2)
    thread.join(5)
    assert out[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert "stuck" in engine.aborted and engine.shut_down


SERVE_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    sys.path.insert(0, {tests!r})
    from fake_engine import FakeEngine
    from specserve.config import ServerConfig
    from specserve.server import run_server
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    engine = FakeEngine(step_delay_s=0.03)
    cfg = ServerConfig(host="127.0.0.1", grpc_port=0, http_port=0, drain_timeout_s=10)
    code = run_server(cfg, engine)
    print("EXIT", code, "shutdown", engine.shut_down, "finished", sorted(engine.finished.items()), flush=True)
    sys.exit(code)
    """
)


def test_sigterm_drains_and_run_server_returns_0(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(SERVE_SCRIPT.format(tests=str(Path(__file__).parent)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    try:
        ports = None
        for line in proc.stderr:
            m = re.search(r"gRPC on [\d.]+:(\d+).*HTTP on http://[\d.]+:(\d+)", line)
            if m:
                ports = int(m.group(1)), int(m.group(2))
                break
        assert ports, "the server never reported its ports"
        channel = grpc.insecure_channel(f"127.0.0.1:{ports[0]}")
        call = specserve_pb2_grpc.SpecServeStub(channel).GenerateStream(_req("inflight", 30))
        first = next(call)
        proc.send_signal(signal.SIGTERM)
        rest = list(call)
        assert (rest or [first])[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(m.token_ids) for m in [first, *rest]) == 30
        out, err = proc.communicate(timeout=20)
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "EXIT 0 shutdown True" in out and "('inflight', 'length')" in out
