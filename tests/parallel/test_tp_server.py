"""`specserve parallelism=tp2` as real processes: rank 0 serves and starts its worker.

SIGTERM drains and every rank exits 0; killing the worker mid-stream turns health
NOT_SERVING and rank 0 exits non-zero by itself; killing rank 0 takes the worker
down with it.  Nothing may hang (the waits here are safety nets, not latency bounds)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc
from tiny_models import make_tiny_model

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# The `specserve` CLI with one test hook: while the file $SPECSERVE_TEST_GATE exists, rank 0's
# engine runs one step with a request (the stream gets its first tokens), then holds its next
# step (touching <gate>.held) until the file is removed.  So a stream is mid-generation for as
# long as the test wants, whatever the machine's speed.
GATED_CLI = textwrap.dedent(
    """
    import os, time
    from specserve.engine.engine import LLMEngine

    gate, real_step = os.environ["SPECSERVE_TEST_GATE"], LLMEngine.step

    def gated_step(self):
        if os.path.exists(gate) and self.requests:
            if getattr(self, "gate_ran", False):
                open(gate + ".held", "w").close()
                while os.path.exists(gate):
                    time.sleep(0.01)
            self.gate_ran = True
        return real_step(self)

    LLMEngine.step = gated_step
    from specserve.cli import main
    main()
    """
)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """A tiny llama with room for long streams (they must outlive a kill)."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-serve") / "llama", "llama", max_position_embeddings=4096)


class Served:
    def __init__(self, model: Path, *extra: str, gate: Path | None = None):
        cli = ["-c", GATED_CLI] if gate is not None else ["-m", "specserve.cli"]
        argv = [sys.executable, *cli, "parallelism=tp2", f"model.path={model}", "model.name=tiny",
                "model.dtype=float32", "server.host=127.0.0.1", "server.grpc_port=0", "server.http_port=0",
                "engine.num_kv_blocks=1200", "engine.block_size=4", "engine.num_threads=1", "server.drain_timeout_s=20",
                *extra]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"SPECSERVE_TEST_GATE": str(gate)} if gate else {})}
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.grpc_port = self.worker_pid = None
        threading.Thread(target=self._read, daemon=True).start()
        assert self.ready.wait(120), "".join(self.lines[-40:])
        assert self.grpc_port and self.worker_pid, "".join(self.lines[-40:])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.stub = specserve_pb2_grpc.SpecServeStub(self.channel)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"worker rank 1 \(pid (\d+)\)", line)
            if m and self.worker_pid is None:
                self.worker_pid = int(m.group(1))
            m = re.search(r"gRPC on [\d.]+:(\d+)", line)
            if m:
                self.grpc_port = int(m.group(1))
                self.ready.set()
        self.ready.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def logged(self, text: str) -> bool:
        """Whether rank 0 wrote ``text``: the reader thread may lag behind the process, so wait
        for it (60 s: a safety net)."""
        return _poll(lambda: text in self.log, 60)

    def health(self) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service="specserve.v1.SpecServe"), timeout=1).status

    def stream(self, max_tokens: int) -> tuple[threading.Thread, list, threading.Event]:
        req = pb.GenerateRequest(request_id="long", prompt_token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
                                 sampling_params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        got: list = []
        first = threading.Event()

        def run() -> None:
            try:
                for m in self.stub.GenerateStream(req):
                    got.append(m)
                    first.set()
            except grpc.RpcError as e:
                got.append(e)
            first.set()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t, got, first

    def close(self) -> None:
        self.channel.close()
        for pid in (self.proc.pid, self.worker_pid):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _poll(predicate: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _wait_gone(pid: int, timeout: float) -> bool:
    return _poll(lambda: not _alive(pid), timeout)


def test_sigterm_drains_and_every_rank_exits_0(long_model):
    s = Served(long_model)
    try:
        info = s.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert (info.tensor_parallel_size, info.draft_tensor_parallel_size) == (2, 1)
        t, got, first = s.stream(60)
        assert first.wait(30)
        s.proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert not isinstance(got[-1], Exception), got[-1]
        assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH and sum(len(m.token_ids) for m in got) == 60
        assert s.proc.wait(30) == 0, s.log[-3000:]
        assert _wait_gone(s.worker_pid, 60)
        assert s.logged("tensor-parallel worker rank 1 exited with code 0"), s.log[-3000:]
    finally:
        s.close()


def test_killing_the_worker_mid_stream_fails_fast_and_exits_non_zero(long_model, tmp_path):
    gate = tmp_path / "gate"
    gate.touch()
    s = Served(long_model, gate=gate)
    try:
        t, got, first = s.stream(3000)
        assert first.wait(30)
        assert _poll((tmp_path / "gate.held").exists, 60), s.log[-3000:]  # held mid-stream: it cannot finish
        killed = time.monotonic()
        os.kill(s.worker_pid, signal.SIGKILL)
        gate.unlink()  # rank 0's engine goes on, and meets the dead worker
        # Rank 0 turns NOT_SERVING, fails the stream, then exits non-zero by itself (the 120 s
        # bound is a safety net against a hang, not a latency requirement).
        seen_not_serving = None
        while s.proc.poll() is None and time.monotonic() - killed < 120:
            try:
                if s.health() == NOT_SERVING and seen_not_serving is None:
                    seen_not_serving = time.monotonic() - killed
            except grpc.RpcError:  # the servers are closing
                pass
            time.sleep(0.05)
        code = s.proc.wait(30)
        exited = time.monotonic() - killed
        t.join(30)
        assert not t.is_alive(), "the client's stream hangs"
        assert isinstance(got[-1], grpc.RpcError) and got[-1].code() == grpc.StatusCode.INTERNAL, got[-1]
        assert code != 0, (code, s.log[-3000:])
        # Health went NOT_SERVING before the exit (the log says so; a poll may miss the window).
        assert s.logged("health: NOT_SERVING") and s.logged("exiting with code 1"), s.log[-3000:]
        print(f"worker killed: NOT_SERVING seen after {seen_not_serving} s, rank 0 exited {code} after {exited:.2f} s")
    finally:
        s.close()


def test_killing_rank_0_takes_the_worker_down(long_model):
    s = Served(long_model)
    try:
        t, got, first = s.stream(3000)
        assert first.wait(30)
        killed = time.monotonic()
        os.kill(s.proc.pid, signal.SIGKILL)
        assert _wait_gone(s.worker_pid, 120), "the worker outlives rank 0"  # 120 s: a safety net
        print(f"rank 0 killed: worker gone after {time.monotonic() - killed:.2f} s")
        t.join(30)
        assert not t.is_alive()
    finally:
        s.close()
