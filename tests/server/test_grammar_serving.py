"""Structured outputs on the real servers (tiny byte-level llama, n-gram K=4, loopback):
grammars compile off the engine thread, once per distinct grammar, within a budget, and
a grammar that fails mid-generation ends its request with an error, never "stop".

Slow compiles are made deterministic by a stand-in for ``llguidance.LLMatcher`` that
blocks on an event the test holds (for grammars carrying a marker) and records each
construction and its thread; mid-generation failures by a matcher wrapper that refuses
tokens (or allows none) after a given count.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import re
import sys
import threading
from pathlib import Path

import grpc
import jsonschema
import llguidance
import openai
import pytest
from server_testutil import server_config, wait_for

sys.path.insert(0, str(Path(__file__).parents[1]))

from engine_utils import tiny_config  # noqa: E402
from tiny_byte_model import make_byte_model  # noqa: E402

import specserve.structured as structured  # noqa: E402
from specserve.engine.async_engine import AsyncEngine  # noqa: E402
from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.request import SamplingParams, StructuredOutputsParams  # noqa: E402
from specserve.server import start_servers  # noqa: E402
from specserve.v1 import specserve_pb2 as pb  # noqa: E402
from specserve.v1 import specserve_pb2_grpc as pb_grpc  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
PROMPT = "abcabcabcabc"
NEIGHBOUR = "hello hello hello"
ENGINE_THREAD = "specserve-engine"


class Served:
    def __init__(self, model_dir):
        self.llm = LLMEngine(tiny_config(model_dir, "ngram", k=4, num_blocks=256, block_size=4))
        self.engine = AsyncEngine(self.llm, max_queue=64)
        # One compile thread: a second grammar waits while the first is held.
        self.cfg = server_config(max_tokens_cap=128, default_max_tokens=24, grammar_compile_threads=1,
                                 grammar_compile_timeout_s=60.0)  # fmt: skip
        self.handle = start_servers(self.cfg, self.engine)
        self.http = f"http://127.0.0.1:{self.handle.http_port}"
        self.client = openai.OpenAI(base_url=f"{self.http}/v1", api_key="unused", max_retries=0, timeout=60)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.handle.grpc_port}")
        self.stub = pb_grpc.SpecServeStub(self.channel)

    def idle(self) -> bool:
        b = self.llm.blocks
        return b.num_free == b.num_blocks and not self.llm.requests and self.engine.num_in_flight == 0

    def greedy(self, prompt: str = NEIGHBOUR, timeout: float = 60) -> str:
        r = self.client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24, timeout=timeout)
        return r.choices[0].text

    def close(self):
        self.channel.close()
        self.client.close()
        self.handle.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_byte_model(tmp_path_factory.mktemp("byte-grammar") / "m")


@pytest.fixture(scope="module")
def served(model_dir):
    s = Served(model_dir)
    yield s
    s.close()


@pytest.fixture(scope="module")
def neighbour_text(served):
    """The neighbour's greedy answer on an otherwise idle server."""
    return served.greedy()


class MatcherSpy:
    """Stands in for ``llguidance.LLMatcher``: records (grammar text, thread) per matcher
    built, and blocks the construction of grammars containing a held marker."""

    def __init__(self, real):
        self.real = real
        self.built: list[tuple[str, str]] = []
        self.gates: dict[str, threading.Event] = {}
        self.entered: dict[str, threading.Event] = {}

    def hold(self, marker: str) -> threading.Event:
        self.gates[marker] = threading.Event()
        self.entered[marker] = threading.Event()
        return self.entered[marker]

    def release(self) -> None:
        for gate in self.gates.values():
            gate.set()

    def count(self, marker: str) -> int:
        return sum(marker in text for text, _ in self.built)

    def threads(self, marker: str) -> set[str]:
        return {name for text, name in self.built if marker in text}

    def cls(self):
        spy = self

        class Spying:
            def __new__(cls, tokenizer, grammar, **kw):
                spy.built.append((grammar, threading.current_thread().name))
                for marker, gate in spy.gates.items():
                    if marker in grammar:
                        spy.entered[marker].set()
                        gate.wait(timeout=120)  # a safety net: the test releases it
                return spy.real(tokenizer, grammar, **kw)

        for name in ("grammar_from_json_schema", "grammar_from_regex", "grammar_from_lark", "validate_grammar"):
            setattr(Spying, name, staticmethod(getattr(spy.real, name)))
        return Spying


@pytest.fixture
def spy(monkeypatch):
    s = MatcherSpy(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", s.cls())
    yield s
    s.release()


def _regex_body(regex: str, **kw) -> dict:
    return dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=24,
                extra_body={"structured_outputs": {"regex": regex}}, **kw)  # fmt: skip


class _Call(threading.Thread):
    """A blocking client call in a thread: its result or exception, and when it ended."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None
        self.done = threading.Event()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e
        finally:
            self.done.set()


# --------------------------------------------------------------------------- compiled once, off the engine thread


def test_n16_copies_compile_once_and_never_on_the_engine_thread(served, spy):
    schema = {"type": "object", "properties": {"zqn16": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["zqn16"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "n16", "schema": schema}}
    r = served.client.completions.create(model=MODEL, prompt=PROMPT, n=16, temperature=1.0, seed=5, max_tokens=32,
                                         extra_body={"response_format": fmt})  # fmt: skip
    assert sorted(c.index for c in r.choices) == list(range(16))
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
    assert spy.count("zqn16") == 1, spy.threads("zqn16")
    assert ENGINE_THREAD not in spy.threads("zqn16")
    # An identical request later (another prompt) is served from the cache: no compile at all.
    r = served.client.completions.create(model=MODEL, prompt=NEIGHBOUR, temperature=0, max_tokens=32,
                                         extra_body={"response_format": fmt})  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    assert spy.count("zqn16") == 1
    assert wait_for(served.idle)


def test_a_held_compile_does_not_stall_a_greedy_neighbour(served, spy, neighbour_text):
    entered = spy.hold("zqheld")
    structured_call = _Call(lambda: served.client.completions.create(**_regex_body("zqheld[a-c]{3,6}")))
    structured_call.start()
    try:
        assert entered.wait(30), "the structured request's compile never started"
        # The compile is held: the greedy neighbour must still be served, in full.
        assert served.greedy(timeout=30) == neighbour_text
        assert not structured_call.done.is_set()  # still compiling
    finally:
        spy.release()
    assert structured_call.done.wait(60)
    assert structured_call.error is None, structured_call.error
    choice = structured_call.result.choices[0]
    assert re.fullmatch("zqheld[a-c]{3,6}", choice.text) and choice.finish_reason == "stop"
    assert ENGINE_THREAD not in spy.threads("zqheld")
    assert wait_for(served.idle)


# --------------------------------------------------------------------------- the compile budget


def test_grammar_over_the_size_budget_is_400_naming_the_field(served, monkeypatch, neighbour_text):
    monkeypatch.setattr(served.cfg, "grammar_max_chars", 2000)
    schema = {"type": "object", "properties": {f"zqbig{i}": {"type": "string"} for i in range(200)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=8, response_format=fmt)  # fmt: skip
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format"
    assert "grammar_max_chars" in e.value.body["message"]
    with pytest.raises(grpc.RpcError) as g:
        served.stub.Generate(pb.GenerateRequest(prompt=PROMPT, model=MODEL, sampling_params=pb.SamplingParams(
            max_tokens=8, json_schema=json.dumps(schema))), timeout=30)  # fmt: skip
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grammar_max_chars" in g.value.details()
    assert served.greedy() == neighbour_text
    assert wait_for(served.idle)


def test_grammar_over_the_time_budget_is_400_and_the_server_keeps_serving(served, spy, monkeypatch,
                                                                          neighbour_text):  # fmt: skip
    monkeypatch.setattr(served.cfg, "grammar_compile_timeout_s", 0.5)
    spy.hold("zqslow")  # never released before the answer: the budget always runs out first
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(**_regex_body("zqslow[a-c]{2,4}"))
    assert e.value.status_code == 400 and e.value.body["param"] == "regex"
    assert "grammar_compile_timeout_s" in e.value.body["message"]
    spy.release()
    monkeypatch.setattr(served.cfg, "grammar_compile_timeout_s", 60.0)
    assert served.greedy() == neighbour_text
    r = served.client.completions.create(**_regex_body("zqfast[a-c]{2,4}"))
    assert re.fullmatch("zqfast[a-c]{2,4}", r.choices[0].text)
    assert wait_for(served.idle)


def test_grammar_over_the_parser_limits_is_400_not_an_empty_stop(served, monkeypatch, neighbour_text):
    # A lexer budget this grammar exceeds at its first mask (computed while compiling): each of
    # the 25 first letters leads to its own lexer state.
    monkeypatch.setattr(structured, "PARSER_LIMITS", {"max_lexer_states": 20}, raising=False)
    starts = "|".join(a + b for a, b in zip("abcdefghijklmnopqrstuvwxy", "bcdefghijklmnopqrstuvwxyz"))
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(**_regex_body(f"({starts})zqlimit[0-9]{{3}}"))
    assert e.value.status_code == 400 and e.value.body["param"] == "regex"
    assert "limit" in e.value.body["message"]
    assert served.greedy() == neighbour_text
    assert wait_for(served.idle)


# --------------------------------------------------------------------------- aborts while compiling


def _compiles_in_flight(served) -> list[str]:
    cache = getattr(served.llm._grammar_backend, "cache", None)
    if cache is None:
        return []
    with cache._lock:
        return [text for _, text in cache._running]  # keys: (partition, grammar text)


def test_abort_while_the_compile_is_pending_drops_it(served, spy, monkeypatch):
    admitted: list[str] = []
    add = served.llm.add_request

    def recording_add(rid, ids, params):
        admitted.append(rid)
        return add(rid, ids, params)

    monkeypatch.setattr(served.llm, "add_request", recording_add)
    entered = spy.hold("zqrunning")

    def call(regex: str):
        sp = pb.SamplingParams(max_tokens=8, temperature=0, regex=regex)
        return served.stub.Generate.future(pb.GenerateRequest(prompt=PROMPT, model=MODEL, sampling_params=sp),
                                           timeout=60)  # fmt: skip

    running = call("zqrunning[a-c]{2,4}")
    assert entered.wait(30), "the first compile never started"
    queued = call("zqqueued[a-c]{2,4}")  # waits for the only compile thread
    try:
        assert wait_for(lambda: served.handle.servers.frontend.num_inflight == 2)
        assert wait_for(lambda: any("zqqueued" in t for t in _compiles_in_flight(served)))  # joined, not started
        queued.cancel()
        running.cancel()
        assert wait_for(lambda: served.handle.servers.frontend.num_inflight == 0)
    finally:
        spy.release()
    for f in (running, queued):
        with pytest.raises(grpc.FutureCancelledError):
            f.result()
    # Let the running compile finish, then check: nothing reached the engine, the queued
    # compile never ran, and the next request is served.
    r = served.client.completions.create(**_regex_body("zqafter[a-c]{2,4}"))
    assert re.fullmatch("zqafter[a-c]{2,4}", r.choices[0].text)
    assert spy.count("zqqueued") == 0
    assert spy.count("zqrunning") == 1
    assert len(admitted) == 1  # only the last request reached the engine
    assert wait_for(served.idle)


# --------------------------------------------------------------------------- grammar failures mid-generation


class FailingMatcher:
    """A real matcher that, once ``after`` tokens are consumed, refuses every token
    ("refuse": an error state, as llguidance enters one) or allows none ("dead")."""

    def __init__(self, real, after: int, mode: str):
        self._m, self.after, self.mode = real, after, mode
        self.n = 0
        self.broken = False

    def __getattr__(self, name):
        return getattr(self._m, name)

    def consume_token(self, t: int) -> bool:
        if self.mode == "refuse" and self.n >= self.after:
            self.broken = True
            return False
        ok = self._m.consume_token(t)
        self.n += int(ok)
        return ok

    def rollback(self, k: int) -> bool:
        self.n -= k
        return self._m.rollback(k)

    def is_error(self) -> bool:
        return self.broken or self._m.is_error()

    def is_stopped(self) -> bool:
        return self.broken or self._m.is_stopped()

    def get_error(self) -> str:
        return "injected: token refused" if self.broken else self._m.get_error()

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        self._m.unsafe_compute_mask_ptr(ptr, nbytes)
        if self.mode == "dead" and self.n >= self.after:
            ctypes.memset(ptr, 0, nbytes)


def fail_grammars(monkeypatch, mode: str, after: int = 3) -> None:
    """Every grammar state built from now on fails after ``after`` tokens."""
    init = structured.GrammarState.__init__

    def failing_init(self, matcher, *args, **kw):
        init(self, FailingMatcher(matcher, after, mode), *args, **kw)

    monkeypatch.setattr(structured.GrammarState, "__init__", failing_init)


REGEX = "[a-c]{6,30}"


def _with_neighbour(served, fn):
    """Run ``fn`` and a greedy neighbour at the same time; returns (fn's outcome, neighbour's text)."""
    neighbour = _Call(served.greedy)
    neighbour.start()
    try:
        outcome = fn()
    finally:
        assert neighbour.done.wait(60)
    assert neighbour.error is None, neighbour.error
    return outcome, neighbour.result


@pytest.mark.parametrize("mode", ["refuse", "dead"])
def test_mid_generation_failure_is_an_http_error_not_a_stop(served, monkeypatch, neighbour_text, mode):
    fail_grammars(monkeypatch, mode)

    def call():
        with pytest.raises(openai.InternalServerError) as e:
            served.client.completions.create(**_regex_body(REGEX))
        return e.value

    err, text = _with_neighbour(served, call)
    assert err.status_code == 500 and "grammar" in err.body["message"] and "regex" in err.body["message"]
    assert text == neighbour_text
    assert wait_for(served.idle)


def test_mid_generation_failure_streamed_is_an_in_band_error(served, monkeypatch, neighbour_text):
    fail_grammars(monkeypatch, "dead")

    def call():
        body = {**_regex_body(REGEX), "stream": True, "structured_outputs": {"regex": REGEX}}
        body.pop("extra_body")
        conn = http.client.HTTPConnection("127.0.0.1", served.handle.http_port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
            raw = [e for e in resp.read().decode().split("\n\n") if e]
        finally:
            conn.close()
        assert raw[-1] == "data: [DONE]"
        return [json.loads(e.removeprefix("data: ")) for e in raw[:-1]]

    events, text = _with_neighbour(served, call)
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and "grammar" in errors[0]["message"]
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert finishes == []  # never "stop"
    assert text == neighbour_text
    assert wait_for(served.idle)


@pytest.mark.parametrize("stream", [False, True])
def test_mid_generation_failure_is_a_grpc_status(served, monkeypatch, neighbour_text, stream):
    fail_grammars(monkeypatch, "refuse")
    req = pb.GenerateRequest(prompt=PROMPT, model=MODEL, sampling_params=pb.SamplingParams(
        max_tokens=24, temperature=0, regex=REGEX))  # fmt: skip

    def call():
        with pytest.raises(grpc.RpcError) as e:
            if stream:
                list(served.stub.GenerateStream(req, timeout=60))
            else:
                served.stub.Generate(req, timeout=60)
        return e.value

    err, text = _with_neighbour(served, call)
    assert err.code() == grpc.StatusCode.INTERNAL and "grammar" in err.details()
    assert text == neighbour_text
    assert wait_for(served.idle)


def test_mid_generation_failure_offline_is_not_a_stop(model_dir, monkeypatch):
    from specserve.llm import LLM

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(model=str(model_dir), speculative_config=spec, dtype="float32", num_kv_blocks=128, block_size=4,
              speculation="fixed")  # fmt: skip
    plain = SamplingParams(temperature=0, max_tokens=16)
    ok = llm.generate([NEIGHBOUR], plain, use_tqdm=False)[0].outputs[0]
    fail_grammars(monkeypatch, "dead")
    so = StructuredOutputsParams(regex=REGEX)
    bad, neighbour = (o.outputs[0] for o in llm.generate(
        [PROMPT, NEIGHBOUR], [SamplingParams(temperature=0, max_tokens=24, structured_outputs=so), plain],
        use_tqdm=False))  # fmt: skip
    assert bad.finish_reason == "abort"  # not "stop"
    assert bad.error is not None and "grammar" in bad.error and "regex" in bad.error
    assert neighbour.token_ids == ok.token_ids and neighbour.error is None
    eng = llm.engine
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.requests
