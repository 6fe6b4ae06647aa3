"""The other two ways in: a LeaderWorkerSet group (simulated here with two processes and the
LWS environment on this machine: leader = rank 0 hosting the rendezvous on
parallelism.master_port, the "worker pod" = rank 1 running the same command line) and
torchrun. Each serves, answers like one device, and SIGTERM on rank 0 (or on torchrun)
stops every rank."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc

ARGS = ["parallelism=tp2", "model.name=tiny", "model.dtype=float32", "server.host=127.0.0.1", "server.grpc_port=0",
        "server.http_port=0", "engine.num_kv_blocks=64", "engine.block_size=4", "engine.num_threads=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, argv: list[str], env: dict[str, str]):
        self.p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **env})  # fmt: skip
        self.lines: list[str] = []
        self.port: int | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stderr:
            self.lines.append(line)
            m = re.search(r"gRPC on [\d.]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                self.ready.set()
        self.ready.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def logged(self, text: str) -> bool:
        """Whether the process wrote ``text``: the reader thread may lag behind it, so wait for
        the line (60 s: a safety net)."""
        end = time.monotonic() + 60
        while text not in self.log and time.monotonic() < end:
            time.sleep(0.05)
        return text in self.log

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


def _generate(port: int) -> list[int]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = specserve_pb2_grpc.SpecServeStub(ch)
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.tensor_parallel_size == 2
        req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),
                                 sampling_params=pb.SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
        return list(stub.Generate(req).token_ids)


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[int]:
    """One device's greedy tokens for the same request."""
    from engine_utils import tiny_config

    from specserve.engine.engine import LLMEngine
    from specserve.request import SamplingParams

    eng = LLMEngine(tiny_config(tiny_llama))
    out = eng.generate([[5, 6, 7, 8]], [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)])
    return out[0].token_ids


def test_leaderworkerset_group_on_one_machine(tiny_llama, expected):
    port = _free_port()
    lws = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2"}
    argv = [sys.executable, "-m", "specserve.cli", *ARGS, f"model.path={tiny_llama}", f"parallelism.master_port={port}"]
    leader = Proc(argv, {**lws, "LWS_WORKER_INDEX": "0"})
    worker = Proc(argv, {**lws, "LWS_WORKER_INDEX": "1"})
    try:
        assert leader.ready.wait(120) and leader.port, leader.log[-3000:] + worker.log[-3000:]
        assert worker.logged("rank 1 of 2") and worker.logged("via leaderworkerset"), worker.log[-2000:]
        assert _generate(leader.port) == expected
        worker.p.send_signal(signal.SIGTERM)  # a worker pod's SIGTERM: it stays until rank 0 lets it go
        leader.p.send_signal(signal.SIGTERM)
        assert leader.p.wait(30) == 0, leader.log[-3000:]
        assert worker.p.wait(30) == 0, worker.log[-3000:]
        assert worker.logged("rank 1: shutdown"), worker.log[-2000:]
    finally:
        leader.kill()
        worker.kill()


def test_under_torchrun(tiny_llama, expected):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.is_file():
        pytest.skip("no torchrun next to this Python")
    argv = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(_free_port()), "-m", "specserve.cli", *ARGS,
            f"model.path={tiny_llama}"]  # fmt: skip
    run = Proc(argv, {})
    try:
        assert run.ready.wait(120) and run.port, run.log[-3000:]
        assert "via torchrun" in run.log
        assert _generate(run.port) == expected
        run.p.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks: rank 0 drains, rank 1 waits for it
        run.p.wait(60)
        assert run.logged("rank 1: shutdown"), run.log[-3000:]
    finally:
        run.kill()
