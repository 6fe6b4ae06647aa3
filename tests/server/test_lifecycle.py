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
from server_testutil import hold_after_steps, http_call, wait_for

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
    t1.join(30)
    t2.join(30)
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
    assert http_call(s.http + "/metrics")[0] == 401  # metrics need the key too
    assert http_call(s.http + "/metrics", headers={"Authorization": "Bearer sekret"})[0] == 200


def test_engine_failure_turns_health_not_serving_and_fails_requests(make_served):
    engine = FakeEngine(step_delay_s=0.02)
    engine.hold.clear()
    s = make_served(engine)
    thread, out = _stream_in_background(s, "inflight", 20)
    assert wait_for(lambda: engine.num_running == 1)
    engine.fail("CUDA went away")
    thread.join(30)  # a safety net: the failure ends the stream at once
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
    engine = FakeEngine()
    hold_after_steps(engine, 1)  # mid-stream until the failure, however slow the machine
    s = make_served(engine)
    s.handle.servers.engine_dead_grace_s = 0.3
    thread, out = _stream_in_background(s, "hung", 40)
    assert wait_for(lambda: len(out) >= 1)
    engine.fail("wedged", silent=True)
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(out[-1], grpc.RpcError) and out[-1].code() == grpc.StatusCode.INTERNAL
    assert "hung" in engine.aborted  # the abandoned generator was closed


def test_engine_failure_mid_sse_ends_the_stream_with_an_error_event(make_served):
    engine = FakeEngine()
    hold_after_steps(engine, 1)  # the stream cannot finish before the failure
    s = make_served(engine)
    conn = http.client.HTTPConnection("127.0.0.1", s.handle.http_port, timeout=30)
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
    engine = FakeEngine()
    hold_after_steps(engine, 1)  # in flight until the refusals below were checked
    s = make_served(engine)
    thread, out = _stream_in_background(s, "slow", 40)
    assert wait_for(lambda: len(out) >= 1)
    drained = s.handle.begin_drain(timeout_s=60)

    assert wait_for(lambda: grpc_health(s) == NOT_SERVING)
    assert http_call(s.http + "/health") == (503, {"status": "draining"})
    with pytest.raises(grpc.RpcError) as err:
        s.stub.Generate(_req())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    status, body = http_call(s.http + "/v1/completions", {"prompt": "hi"})
    assert status == 503 and body["error"]["code"] == "server_draining"
    assert engine.num_running == 1

    engine.hold.set()  # now it may finish
    thread.join(30)
    drained.result(30)
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert "".join(m.text for m in out) and sum(len(m.token_ids) for m in out) == 40


def test_drain_timeout_aborts_what_is_left(make_served):
    engine = FakeEngine()
    engine.hold.clear()  # never finishes on its own
    s = make_served(engine)
    thread, out = _stream_in_background(s, "stuck", 40)
    assert wait_for(lambda: engine.num_running == 1)
    s.handle.drain(timeout_s=0.2)
    thread.join(30)
    assert out[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert "stuck" in engine.aborted and engine.shut_down


def test_abort_inflight_cuts_a_drain_short_and_every_client_gets_its_end(make_served):
    engine = FakeEngine()
    engine.hold.clear()  # never finishes on its own
    s = make_served(engine, drain_timeout_s=600)
    thread, out = _stream_in_background(s, "held", 40)
    assert wait_for(lambda: engine.num_running == 1)
    drained = s.handle.begin_drain()
    assert wait_for(lambda: grpc_health(s) == NOT_SERVING)
    assert not drained.done() and engine.num_running == 1  # the drain waits (600 s) ...
    s.handle.abort_inflight()  # ... until told to abort
    drained.result(30)
    thread.join(30)
    assert out[-1].finish_reason == pb.FINISH_REASON_ABORT  # a final message, not a cut stream
    assert engine.finished == {"held": "abort"}


SERVE_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    sys.path.insert(0, {tests!r})
    from fake_engine import FakeEngine
    from specserve.config import ServerConfig
    from specserve.server import run_server
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    engine = FakeEngine(step_delay_s=0.03)
    cfg = ServerConfig(host="127.0.0.1", grpc_port=0, http_port=0, drain_timeout_s=600)
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
        out, err = proc.communicate(timeout=120)  # a safety net: it exits once the stream is done
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "EXIT 0 shutdown True" in out and "('inflight', 'length')" in out


# --------------------------------------------------------------------------- a second signal, real process

# Runs the `specserve` CLI with one test hook: while the file $SPECSERVE_TEST_GATE exists the
# engine takes no step until it holds as many requests as the file says, runs ONE step with
# all of them (each gets its first token), then holds its next step (touching <gate>.held)
# until the file is removed.  So requests are in flight, mid-generation, for as long as the
# test wants, whatever the machine's speed.
GATED_CLI = textwrap.dedent(
    """
    import os, sys, time
    from specserve.engine.engine import LLMEngine

    gate, real_step = os.environ["SPECSERVE_TEST_GATE"], LLMEngine.step

    def gated_step(self):
        if not os.path.exists(gate):
            return real_step(self)
        if not getattr(self, "gate_ran", False):
            if len(self.requests) < int(open(gate).read()):
                time.sleep(0.01)  # let the engine thread admit the rest first
                return []
            self.gate_ran = True
            return real_step(self)
        open(gate + ".held", "w").close()
        while os.path.exists(gate):
            time.sleep(0.01)
        return real_step(self)

    LLMEngine.step = gated_step
    from specserve.cli import main
    main()
    """
)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("lifecycle") / "llama", "llama", max_position_embeddings=1024)


class _Clients:
    """One request of each kind (HTTP streamed / not, gRPC streamed / not), each in a thread."""

    BODY = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 800, "temperature": 0, "ignore_eos": True}

    def __init__(self, http_port: int, grpc_port: int):
        self.http_port = http_port
        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.stub = specserve_pb2_grpc.SpecServeStub(self.channel)
        self.results: dict[str, object] = {}
        self.first = {"http_stream": threading.Event(), "grpc_stream": threading.Event()}
        self.threads = [threading.Thread(target=getattr(self, name), daemon=True)
                        for name in ("http_stream", "http_plain", "grpc_stream", "grpc_plain")]  # fmt: skip
        for t in self.threads:
            t.start()

    def _post(self, stream: bool) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps({**self.BODY, "stream": stream}),
                     {"Content-Type": "application/json"})  # fmt: skip
        return conn.getresponse()

    def http_stream(self) -> None:
        resp = self._post(stream=True)
        events = []
        for line in resp:
            if line.strip():
                events.append(line.decode().strip())
                self.first["http_stream"].set()
        self.results["http_stream"] = (resp.status, events)

    def http_plain(self) -> None:
        resp = self._post(stream=False)
        self.results["http_plain"] = (resp.status, json.loads(resp.read()))

    def _grpc_req(self) -> pb.GenerateRequest:
        params = pb.SamplingParams(max_tokens=800, temperature=0, ignore_eos=True)
        return pb.GenerateRequest(prompt="w1 w2 w3", sampling_params=params, model="tiny")

    def grpc_stream(self) -> None:
        got: list = []
        try:
            for m in self.stub.GenerateStream(self._grpc_req(), timeout=120):
                got.append(m)
                self.first["grpc_stream"].set()
        except grpc.RpcError as exc:
            got.append(exc)
        self.results["grpc_stream"] = got

    def grpc_plain(self) -> None:
        try:
            self.results["grpc_plain"] = self.stub.Generate(self._grpc_req(), timeout=120)
        except grpc.RpcError as exc:
            self.results["grpc_plain"] = exc

    def join(self) -> None:
        for t in self.threads:
            t.join(120)
        self.channel.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("second", ["SIGTERM", "SIGINT"])
def test_second_signal_aborts_in_flight_requests_with_well_formed_ends_and_exits(long_model, tmp_path, second):
    gate = tmp_path / "gate"
    gate.write_text("4")  # hold the engine until the four requests below are in it
    argv = [sys.executable, "-c", GATED_CLI, f"model.path={long_model}", "model.name=tiny", "model.dtype=float32",
            "server.host=127.0.0.1", "server.grpc_port=0", "server.http_port=0", "engine.num_kv_blocks=2048",
            "engine.block_size=4", "engine.num_threads=1", "server.max_tokens_cap=1000",
            "server.drain_timeout_s=600"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPECSERVE_TEST_GATE": str(gate), "SPECSERVE_API_KEY": ""}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    ports: list[int] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"gRPC on [\d.]+:(\d+).*HTTP on http://[\d.]+:(\d+)", line)
            if m:
                ports.extend(int(g) for g in m.groups())
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(120) and ports, "".join(lines[-30:])
        clients = _Clients(http_port=ports[1], grpc_port=ports[0])
        # The engine ran one step with all four requests, delivered it, and now holds.
        assert wait_for(lambda: (tmp_path / "gate.held").exists(), 60), "".join(lines[-30:])
        assert all(e.wait(60) for e in clients.first.values()), "the streams never got their first token"
        proc.send_signal(signal.SIGTERM)
        # Draining (health 503) cannot finish: the engine is held and drain_timeout_s is 600 s.
        assert wait_for(lambda: http_call(f"http://127.0.0.1:{ports[1]}/health")[0] == 503, 60)
        proc.send_signal(getattr(signal, second))
        assert wait_for(lambda: any("second signal" in line for line in lines), 60), "".join(lines[-30:])
        gate.unlink()  # the engine resumes: the aborts are applied after its held step
        clients.join()
        proc.wait(120)  # well before the 600 s drain timeout
        reader.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines)

    status, events = clients.results["http_stream"]
    assert status == 200 and events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort", chunks[-1]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks)  # the tokens generated before the abort

    status, body = clients.results["http_plain"]
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "abort" and body["choices"][0]["text"], body
    assert 0 < body["usage"]["completion_tokens"] < 800

    msgs = clients.results["grpc_stream"]
    assert not isinstance(msgs[-1], grpc.RpcError), msgs[-1]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert 0 < sum(len(m.token_ids) for m in msgs) < 800

    plain = clients.results["grpc_plain"]
    assert not isinstance(plain, grpc.RpcError), plain
    assert plain.finish_reason == pb.FINISH_REASON_ABORT and 0 < len(plain.token_ids) < 800
    assert proc.returncode == 0 and "servers stopped" in log, log[-3000:]


# --------------------------------------------------------------------------- exit after the drain

# The `specserve` command with a FakeEngine in place of the model.  An object that only the
# interpreter's teardown frees says when that teardown ran.
CLI_ON_FAKE_ENGINE = textwrap.dedent(
    """
    import atexit, sys
    sys.path.insert(0, {tests!r})
    from fake_engine import FakeEngine
    import specserve.engine.async_engine as async_engine
    async_engine.build_async_engine = lambda cfg: FakeEngine(step_delay_s=0.01)

    class Teardown:
        def __del__(self):
            print("interpreter teardown", flush=True)

    keep = Teardown()
    atexit.register(print, "exit hooks ran", flush=True)
    from specserve.cli import serve_main
    sys.exit(serve_main(sys.argv[1:]))
    """
)


def test_after_the_drain_the_process_exits_without_the_interpreter_teardown(tmp_path):
    """The drain is the last work: the exit hooks run and the output is flushed, but the
    teardown that garbage-collects every object of torch and the engine (seconds on a loaded
    machine) is skipped."""
    script = tmp_path / "cli.py"
    script.write_text(CLI_ON_FAKE_ENGINE.format(tests=str(Path(__file__).parent)))
    argv = [sys.executable, str(script), "server.host=127.0.0.1", "server.grpc_port=0", "server.http_port=0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "SPECSERVE_API_KEY": ""})  # fmt: skip
    try:
        ports = None
        for line in proc.stderr:
            m = re.search(r"gRPC on [\d.]+:(\d+).*HTTP on http://[\d.]+:(\d+)", line)
            if m:
                ports = int(m.group(1)), int(m.group(2))
                break
        assert ports, "the server never reported its ports"
        status, _ = http_call(f"http://127.0.0.1:{ports[1]}/v1/completions", {"prompt": "hi", "max_tokens": 3})
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)  # a safety net only
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "servers stopped" in err  # the drain ran to its end and was logged
    assert out.splitlines() == ["exit hooks ran"]  # ... the exit hooks ran, the teardown did not
