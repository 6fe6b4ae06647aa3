"""Fixtures for the server tests: real servers on loopback ephemeral ports around a FakeEngine."""

from __future__ import annotations

import grpc
import openai
import pytest
from fake_engine import FakeEngine
from server_testutil import server_config

from specserve.config import ServerConfig
from specserve.server import start_servers
from specserve.v1 import specserve_pb2_grpc as pb_grpc


class Served:
    """A running server plus clients for it."""

    def __init__(self, engine: FakeEngine, cfg: ServerConfig):
        self.engine = engine
        self.cfg = cfg
        self.handle = start_servers(cfg, engine)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.handle.grpc_port}")
        self.stub = pb_grpc.SpecServeStub(self.channel)
        self.http = f"http://127.0.0.1:{self.handle.http_port}"

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.http}/v1", api_key=api_key, max_retries=0, timeout=10)

    def close(self) -> None:
        self.channel.close()
        self.handle.stop()


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def served(engine):
    s = Served(engine, server_config())
    yield s
    s.close()


@pytest.fixture
def make_served():
    """Factory for servers with a custom engine or config; all closed at the end."""
    made: list[Served] = []

    def make(engine: FakeEngine | None = None, **cfg) -> Served:
        s = Served(engine or FakeEngine(), server_config(**cfg))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
