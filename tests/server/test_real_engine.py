"""The servers around the REAL engine: LLMEngine on a tiny random llama (float32,
n-gram speculation, K=3), wrapped in AsyncEngine and served on loopback
ephemeral ports.

* temperature-0 answers over the official ``openai`` client and the gRPC stubs
  equal the offline greedy output of an identically configured engine;
* ``/metrics`` spec-decode counters move by exactly the per-response figures;
* a cancelled stream, a passed gRPC deadline and refused bad input all leave
  the KV cache empty and the server serving;
* a drain with streams in flight lets them finish with a finish_reason while
  new requests get UNAVAILABLE / 503.
"""

from __future__ import annotations

import threading

import grpc
import openai
import pytest
from engine_utils import tiny_config
from server_testutil import http_call, scrape, server_config, total, wait_for

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import LLMEngine
from specserve.request import SamplingParams
from specserve.server import start_servers
from specserve.v1 import specserve_pb2 as pb
from specserve.v1 import specserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
MAX_TOKENS = 24
LONG = 400  # tokens for requests that must still be running when they are cancelled
# Word prompts with repeats, so the n-gram proposer drafts (and sometimes is right).
PROMPTS = ["w10 w11 w12 w10 w11 w12 w10", "w7 w8 w9 w7 w8", "w30 w31 w30 w31 w30 w31", "w5 w6 w7 w8"]
CHAT = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w20 w21 w20 w21"}]
SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def engine_config(model_dir, num_blocks: int = 128):
    return tiny_config(model_dir, "ngram", k=3, num_blocks=num_blocks, block_size=4)


class RealServed:
    def __init__(self, cfg, **server_overrides):
        self.llm = LLMEngine(cfg)
        self.engine = AsyncEngine(self.llm, max_queue=64)
        overrides = dict(max_tokens_cap=512, default_max_tokens=MAX_TOKENS, drain_timeout_s=30.0)
        overrides.update(server_overrides)
        self.handle = start_servers(server_config(**overrides), self.engine)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.handle.grpc_port}")
        self.stub = pb_grpc.SpecServeStub(self.channel)
        self.http = f"http://127.0.0.1:{self.handle.http_port}"
        self.client = openai.OpenAI(base_url=f"{self.http}/v1", api_key="unused", max_retries=0, timeout=30)

    def kv_free(self) -> bool:
        b = self.llm.blocks
        return b.num_free == b.num_blocks and not self.llm.requests and self.engine.num_in_flight == 0

    def close(self) -> None:
        self.channel.close()
        self.client.close()
        self.handle.stop()


@pytest.fixture(scope="module")
def cfg(tiny_llama):
    return engine_config(tiny_llama)


@pytest.fixture(scope="module")
def served(cfg):
    s = RealServed(cfg)
    yield s
    s.close()


@pytest.fixture(scope="module")
def offline(cfg):
    """Greedy output of a second, identically configured engine, one request at a time."""
    eng = LLMEngine(cfg)
    cache: dict[tuple, object] = {}

    def ref(ids: list[int], max_tokens: int = MAX_TOKENS, ignore_eos: bool = False):
        key = (tuple(ids), max_tokens, ignore_eos)
        if key not in cache:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
            cache[key] = eng.generate([list(ids)], [params])[0]
        return cache[key]

    ref.engine = eng
    return ref


def grpc_request(prompt: str | None = None, ids: list[int] | None = None, messages=None,
                 max_tokens: int = MAX_TOKENS, ignore_eos: bool = False) -> pb.GenerateRequest:  # fmt: skip
    sp = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    if ids is not None:
        return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling_params=sp, model=MODEL)
    if messages is not None:
        msgs = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])
        return pb.GenerateRequest(messages=msgs, sampling_params=sp, model=MODEL)
    return pb.GenerateRequest(prompt=prompt, sampling_params=sp, model=MODEL)


class StepGate:
    """Holds the engine thread before a step: ``hold_after(n)`` lets ``n`` more steps with
    requests run (their outputs reach the clients), then the next waits until ``release()``.
    Requests stay in flight, or a deadline passes, exactly when the test says so."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, llm: LLMEngine):
        self._llm = llm
        self._steps_left: int | None = None  # None: not holding
        self._open = threading.Event()
        self._open.set()
        self.holding = threading.Event()  # the engine thread waits at the gate
        real_step = llm.step

        def step():
            left = self._steps_left  # read once: release() may run at any moment
            if left is not None and llm.has_unfinished():
                if left == 0:
                    self.holding.set()
                    self._open.wait()  # cleared by hold_after, so a release() at any time opens it
                    self.holding.clear()
                else:
                    self._steps_left = left - 1
            return real_step()

        monkeypatch.setattr(llm, "step", step)

    def hold_after(self, steps: int) -> None:
        self._open.clear()
        self._steps_left = steps

    def release(self) -> None:
        self._steps_left = None
        self._open.set()

    def wait_holding(self) -> None:
        assert self.holding.wait(30), "the engine never reached the gate"


@pytest.fixture
def gate(served, monkeypatch):
    g = StepGate(monkeypatch, served.llm)
    yield g
    g.release()  # never leave the module's engine stuck


def wait_kv_free(s: RealServed, timeout_s: float = 30.0) -> None:
    assert wait_for(s.kv_free, timeout_s), (
        f"KV not freed: {s.llm.blocks.num_free}/{s.llm.blocks.num_blocks} blocks free, "
        f"{len(s.llm.requests)} engine requests, {s.engine.num_in_flight} streams"
    )
    assert total(scrape(s.http), "specserve_kv_cache_usage_perc") == 0
    assert total(scrape(s.http), "specserve_num_requests_running") == 0


# --------------------------------------------------------------------------- 1. equality with offline greedy


class SpecSum:
    """Adds up the spec_decode figures the responses report."""

    def __init__(self) -> None:
        self.seen = dict.fromkeys(SPEC_KEYS, 0)

    def add(self, spec) -> None:
        for key in SPEC_KEYS:
            self.seen[key] += spec[key] if isinstance(spec, dict) else getattr(spec, key)


def run_all_apis(s: RealServed, offline, spec: SpecSum) -> int:
    """Every API, streamed and not, at temperature 0; returns how many requests were made."""
    tok = s.engine.tokenizer
    n = 0
    for prompt in PROMPTS:
        ref = offline(tok.encode(prompt))
        assert ref.token_ids, "the reference produced no tokens"

        # OpenAI completions, plain
        r = s.client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason.value
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.prompt_tokens == len(tok.encode(prompt))
        spec.add(r.model_extra["spec_decode"])

        # OpenAI completions, streamed (with the usage chunk)
        text, finish, last_spec, usage = "", None, None, None
        for chunk in s.client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}):  # fmt: skip
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
            if (chunk.model_extra or {}).get("spec_decode") is not None:
                last_spec = chunk.model_extra["spec_decode"]  # cumulative: the last one counts
        assert (text, finish) == (ref.text, ref.finish_reason.value)
        assert usage is not None and usage.completion_tokens == len(ref.token_ids)
        spec.add(last_spec)

        # gRPC Generate (token ids are exposed: compare them)
        r = s.stub.Generate(grpc_request(prompt))
        assert list(r.token_ids) == ref.token_ids and r.text == ref.text
        assert FINISH[r.finish_reason] == ref.finish_reason.value
        spec.add(r.spec_decode)

        # gRPC GenerateStream
        ids, text, msgs = [], "", list(s.stub.GenerateStream(grpc_request(prompt)))
        for m in msgs:
            ids += m.token_ids
            text += m.text
        assert ids == ref.token_ids and text == ref.text
        assert FINISH[msgs[-1].finish_reason] == ref.finish_reason.value
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
        spec.add(msgs[-1].spec_decode)
        n += 4

    # Chat: the server applies the engine tokenizer's chat template.
    ref = offline(tok.apply_chat_template(CHAT))
    r = s.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason.value
    spec.add(r.model_extra["spec_decode"])
    text, finish, last_spec = "", None, None
    for chunk in s.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                                  stream=True):  # fmt: skip
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
        if (chunk.model_extra or {}).get("spec_decode") is not None:
            last_spec = chunk.model_extra["spec_decode"]
    assert (text, finish) == (ref.text, ref.finish_reason.value)
    spec.add(last_spec)
    r = s.stub.Generate(grpc_request(messages=CHAT))
    assert list(r.token_ids) == ref.token_ids
    spec.add(r.spec_decode)

    # Token-id prompts on both protocols.
    ids = tok.encode(PROMPTS[0])
    ref = offline(ids)
    r = s.client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == ref.text
    spec.add(r.model_extra["spec_decode"])
    r = s.stub.Generate(grpc_request(ids=ids))
    assert list(r.token_ids) == ref.token_ids
    spec.add(r.spec_decode)
    return n + 5


def test_greedy_answers_equal_offline_and_metrics_match_responses(served, offline):
    wait_kv_free(served)
    before = scrape(served.http)
    spec = SpecSum()
    n = run_all_apis(served, offline, spec)
    after = scrape(served.http)
    assert spec.seen["num_drafts"] > 0 and spec.seen["num_accepted_tokens"] > 0, spec.seen

    def delta(name: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    base = {"model_name": MODEL, "method": "ngram"}
    assert delta("specserve_spec_decode_num_drafts_total", **base) == spec.seen["num_drafts"]
    assert delta("specserve_spec_decode_num_draft_tokens_total", **base) == spec.seen["num_draft_tokens"]
    assert delta("specserve_spec_decode_num_accepted_tokens_total", **base) == spec.seen["num_accepted_tokens"]
    assert delta("specserve_spec_decode_num_accepted_tokens_per_pos_total") == spec.seen["num_accepted_tokens"]
    assert delta("specserve_spec_decode_acceptance_length_count") == spec.seen["num_drafts"]
    finished = sum(delta("specserve_request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert finished == n and delta("specserve_request_success_total", finished_reason="abort") == 0
    wait_kv_free(served)


def test_concurrent_greedy_requests_equal_offline(served, offline):
    """The same prompts in one batch (continuous batching) still give the single-request output (float32)."""
    tok = served.engine.tokenizer
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:
        r = served.stub.Generate(grpc_request(PROMPTS[i % len(PROMPTS)]))
        results[i] = list(r.token_ids)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 8
    for i, ids in results.items():
        assert ids == offline(tok.encode(PROMPTS[i % len(PROMPTS)])).token_ids
    wait_kv_free(served)


# --------------------------------------------------------------------------- 3. cancellation frees KV


def _aborts(s: RealServed) -> float:
    return total(scrape(s.http), "specserve_request_success_total", finished_reason="abort")


def _release_once_the_stream_is_gone(served, gate: StepGate) -> None:
    """The handler closed its engine stream (so the abort is queued) while the engine is
    held: the request cannot have run to completion.  Then let the engine go on."""
    assert wait_for(lambda: served.engine.num_in_flight == 0, 30), "the server never closed the stream"
    gate.release()


def test_http_stream_closed_by_the_client_frees_kv(served, offline, gate):
    wait_kv_free(served)
    aborts = _aborts(served)
    tok = served.engine.tokenizer
    ref = offline(tok.encode(PROMPTS[1]), LONG, ignore_eos=True)
    gate.hold_after(2)  # two steps' chunks reach the client, then the engine waits
    stream = served.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=LONG, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    it = iter(stream)
    text = next(it).choices[0].text + next(it).choices[0].text
    assert ref.text.startswith(text)
    gate.wait_holding()
    assert served.llm.blocks.num_free < served.llm.blocks.num_blocks  # it holds KV now
    stream.close()
    _release_once_the_stream_is_gone(served, gate)
    wait_kv_free(served)
    assert _aborts(served) == aborts + 1  # aborted, not run to completion


def test_grpc_stream_cancelled_by_the_client_frees_kv(served, offline, gate):
    wait_kv_free(served)
    aborts = _aborts(served)
    ids = served.engine.tokenizer.encode(PROMPTS[2])
    ref = offline(ids, LONG, ignore_eos=True)
    gate.hold_after(2)
    call = served.stub.GenerateStream(grpc_request(PROMPTS[2], max_tokens=LONG, ignore_eos=True))
    got = list(next(call).token_ids) + list(next(call).token_ids)
    assert ref.token_ids[: len(got)] == got
    gate.wait_holding()
    call.cancel()
    _release_once_the_stream_is_gone(served, gate)
    wait_kv_free(served)
    assert _aborts(served) == aborts + 1


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_grpc_deadline_is_deadline_exceeded_and_frees_kv(served, rpc, gate):
    wait_kv_free(served)
    aborts = _aborts(served)
    req = grpc_request(PROMPTS[0], max_tokens=LONG, ignore_eos=True)
    # The prefill step runs, then the engine is held: the request holds KV and cannot finish,
    # so the deadline passes whatever the machine's speed (2 s: time to reach the engine).
    gate.hold_after(1)
    with pytest.raises(grpc.RpcError) as err:
        if rpc == "Generate":
            served.stub.Generate(req, timeout=5.0)
        else:
            list(served.stub.GenerateStream(req, timeout=5.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    gate.wait_holding()
    assert served.llm.blocks.num_free < served.llm.blocks.num_blocks  # held KV when the deadline passed
    _release_once_the_stream_is_gone(served, gate)
    wait_kv_free(served)
    assert _aborts(served) == aborts + 1


# --------------------------------------------------------------------------- 4. bad input


def test_bad_input_is_refused_naming_the_field_and_the_server_keeps_serving(served, offline):
    wait_kv_free(served)
    max_len = served.llm.max_model_len
    too_long = " ".join(f"w{i % 400 + 5}" for i in range(max_len + 10))

    with pytest.raises(openai.BadRequestError) as err:
        served.client.completions.create(model=MODEL, prompt=too_long, max_tokens=4, temperature=0)
    assert err.value.status_code == 400 and err.value.body["param"] == "prompt"
    assert str(max_len) in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        served.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": too_long}], max_tokens=4, temperature=0
        )
    assert err.value.body["param"] == "prompt"
    for req in (grpc_request(too_long, max_tokens=4), grpc_request(ids=[7] * (max_len + 1), max_tokens=4)):
        for rpc in (served.stub.Generate, lambda r: list(served.stub.GenerateStream(r))):
            with pytest.raises(grpc.RpcError) as gerr:
                rpc(req)
            assert gerr.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert gerr.value.details().startswith("prompt:"), gerr.value.details()

    # prompt fits, prompt + max_tokens does not: names max_tokens
    half = " ".join(f"w{i % 400 + 5}" for i in range(max_len // 2))
    with pytest.raises(openai.BadRequestError) as err:
        served.client.completions.create(model=MODEL, prompt=half, max_tokens=max_len // 2 + 8, temperature=0)
    assert err.value.body["param"] == "max_tokens"
    # a token id outside the vocabulary: only the real engine knows the vocabulary
    with pytest.raises(grpc.RpcError) as gerr:
        served.stub.Generate(grpc_request(ids=[5, 6, 10**6]))
    assert gerr.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in gerr.value.details()

    # still serving, with the right answer, and nothing leaked
    ref = offline(served.engine.tokenizer.encode(PROMPTS[3]))
    assert served.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=MAX_TOKENS,
                                            temperature=0).choices[0].text == ref.text  # fmt: skip
    assert list(served.stub.Generate(grpc_request(PROMPTS[3])).token_ids) == ref.token_ids
    assert http_call(f"{served.http}/health")[0] == 200
    wait_kv_free(served)
    errors = scrape(served.http)
    assert total(errors, "specserve_request_errors_total", reason="invalid_argument") >= 7


# --------------------------------------------------------------------------- 5. drain with requests in flight


def test_drain_lets_in_flight_streams_finish_and_refuses_new_work(tiny_llama, offline, monkeypatch):
    drain_tokens = 250
    s = RealServed(engine_config(tiny_llama, num_blocks=256))
    gate = StepGate(monkeypatch, s.llm)
    gate.hold_after(0)  # the streams are accepted but make no progress until the checks are done
    try:
        tok = s.engine.tokenizer
        prompts = PROMPTS[:3]
        first = [threading.Event() for _ in prompts]
        results: list[dict] = [{} for _ in prompts]

        def grpc_stream(i: int) -> None:
            r = results[i]
            r["ids"], r["finish"] = [], None
            try:
                for m in s.stub.GenerateStream(grpc_request(prompts[i], max_tokens=drain_tokens, ignore_eos=True)):
                    r["ids"] += m.token_ids
                    first[i].set()
                    if m.finish_reason:
                        r["finish"] = FINISH[m.finish_reason]
            except grpc.RpcError as exc:
                r["error"] = exc.code()
            first[i].set()

        def http_stream(i: int) -> None:
            r = results[i]
            r["text"], r["finish"] = "", None
            try:
                for chunk in s.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=drain_tokens,
                                                         temperature=0, stream=True,
                                                         extra_body={"ignore_eos": True}):  # fmt: skip
                    for c in chunk.choices:
                        r["text"] += c.text
                        r["finish"] = c.finish_reason or r["finish"]
                    first[i].set()
            except openai.APIError as exc:
                r["error"] = repr(exc)
            first[i].set()

        threads = [threading.Thread(target=f, args=(i,), daemon=True)
                   for i, f in enumerate((grpc_stream, grpc_stream, http_stream))]  # fmt: skip
        for t in threads:
            t.start()
        assert wait_for(lambda: s.engine.num_in_flight == 3, 30), "the streams never reached the engine"
        gate.wait_holding()

        drained = s.handle.begin_drain(60.0)
        assert wait_for(lambda: s.handle.servers.health.draining, 30)
        # New work is refused while the three streams are still running.
        with pytest.raises(grpc.RpcError) as err:
            s.stub.Generate(grpc_request(PROMPTS[3]))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(openai.APIStatusError) as herr:
            s.client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=4, temperature=0)
        assert herr.value.status_code == 503 and herr.value.body["code"] == "server_draining"
        assert herr.value.response.headers.get("connection") == "close"  # no reuse of a closing listener
        assert http_call(f"{s.http}/health")[0] == 503
        assert s.engine.num_in_flight == 3  # held: none can have finished

        gate.release()
        drained.result(120)
        for t in threads:
            t.join(30)
        assert all(e.is_set() for e in first)
        for i, r in enumerate(results):
            assert "error" not in r, r
            assert r["finish"] == "length", r  # completed, not aborted: the drain timeout was generous
        # ... and with exactly the offline output (batched float32 equals single-request).
        for i in (0, 1):
            assert results[i]["ids"] == offline(tok.encode(prompts[i]), drain_tokens, ignore_eos=True).token_ids
        assert results[2]["text"] == offline(tok.encode(prompts[2]), drain_tokens, ignore_eos=True).text
        assert s.llm.blocks.num_free == s.llm.blocks.num_blocks and not s.llm.requests
    finally:
        gate.release()
        s.close()


def test_loadgen_across_a_drain_loses_no_accepted_request(tiny_llama, offline, tmp_path):
    """specserve-loadgen --expect-shutdown while the server drains and stops mid-run:
    every accepted request ends with a finish_reason and equals the offline output."""
    import json

    from specserve import loadgen

    max_tokens = 16
    s = RealServed(engine_config(tiny_llama, num_blocks=256))
    try:
        tok = s.engine.tokenizer
        (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
        reference = {p: offline(tok.encode(p), max_tokens).text for p in PROMPTS}
        (tmp_path / "ref.json").write_text(json.dumps(reference))
        out = tmp_path / "report.json"
        argv = ["--grpc-target", f"127.0.0.1:{s.handle.grpc_port}", "--http-url", s.http, "--clients", "6",
                "--duration-s", "120", "--cancel-fraction", "0.1", "--bad-fraction", "0.1", "--max-tokens",
                str(max_tokens), "--prompts-file", str(tmp_path / "prompts.txt"), "--reference",
                str(tmp_path / "ref.json"), "--expect-shutdown", "--output", str(out)]  # fmt: skip
        rc: list[int] = []
        t = threading.Thread(target=lambda: rc.append(loadgen.main(argv)), daemon=True)
        t.start()
        # Drain once requests have been answered (not after a fixed time); the clients stop
        # as soon as the server is unreachable, long before --duration-s.
        assert wait_for(lambda: total(scrape(s.http), "specserve_request_success_total") >= 6, 60)
        s.handle.drain(30.0)  # as SIGTERM: refuse new work, finish in-flight, stop the listeners
        t.join(60)
        assert not t.is_alive(), "the load generator did not stop once the server was gone"
        report = json.loads(out.read_text())
        assert report["lost"]["count"] == 0, report["lost"]
        assert report["errors"]["unexpected"] == {}, report["errors"]
        assert report["mismatches"]["count"] == 0 and report["mismatches"]["checked"] > 0, report["mismatches"]
        assert report["accepted"] > 0 and set(report["finish_reasons"]) <= {"stop", "length", "None"}
        # Only client-cancelled requests end without a finish_reason.
        assert report["finish_reasons"].get("None", 0) == report["requests"]["cancelled"]
        assert any(k.endswith(":unreachable") for k in report["errors"]["expected"]), report["errors"]
        assert rc == [0]
        assert s.llm.blocks.num_free == s.llm.blocks.num_blocks and not s.llm.requests
    finally:
        s.close()
