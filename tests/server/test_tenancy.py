"""Tenants on the servers: several API keys, each its own cache partition (with the request's
``cache_salt``) on both front ends; ``/metrics`` behind a key; duplicate credentials refused
alike on HTTP and gRPC; and the reported side channels (prefix-cache hits read from
``/metrics``, suffix acceptance counts in responses) closed end to end on a real engine."""

from __future__ import annotations

import http.client

import grpc
import pytest
from fake_engine import FakeEngine
from server_testutil import http_call, scrape, server_config, total, wait_for

from specserve.config import Config, validate_config
from specserve.errors import ConfigError
from specserve.server import start_servers
from specserve.v1 import specserve_pb2 as pb

pytestmark = pytest.mark.timeout(120)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(s, key: str | None, **extra) -> tuple[int, dict]:
    body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2, **extra}
    return http_call(f"{s.http}/v1/completions", body, bearer(key) if key else None)


def grpc_generate(s, key: str | None, cache_salt: str | None = None, metadata=None) -> pb.GenerateResponse:
    req = pb.GenerateRequest(prompt="hi", sampling_params=pb.SamplingParams(max_tokens=2))
    if cache_salt is not None:
        req.cache_salt = cache_salt
    if metadata is None:
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
    return s.stub.Generate(req, metadata=metadata)


def last_salt(s) -> str | None:
    """The partition the engine saw on the latest request."""
    return list(s.engine.requests.values())[-1].params.cache_salt


# --------------------------------------------------------------------------- /metrics


def test_metrics_need_an_api_key_when_the_api_has_one(make_served):
    s = make_served(api_key="key-a, key-b")
    assert http_call(f"{s.http}/metrics")[0] == 401
    assert http_call(f"{s.http}/metrics", headers=bearer("wrong"))[0] == 401
    for key in ("key-a", "key-b"):
        status, text = http_call(f"{s.http}/metrics", headers=bearer(key))
        assert status == 200 and "specserve_num_requests_running" in text
    assert http_call(f"{s.http}/health")[0] == 200  # probes send no key
    open_server = make_served()
    assert http_call(f"{open_server.http}/metrics")[0] == 200  # no key configured: open as before


def test_a_metrics_key_is_the_only_key_for_metrics(make_served):
    s = make_served(api_key="key-a", metrics_key="scrape-key")
    assert http_call(f"{s.http}/metrics", headers=bearer("key-a"))[0] == 401
    assert http_call(f"{s.http}/metrics", headers=bearer("scrape-key"))[0] == 200
    assert complete(s, "scrape-key")[0] == 401  # it opens nothing else
    assert complete(s, "key-a")[0] == 200
    only_metrics = make_served(metrics_key="scrape-key")
    assert http_call(f"{only_metrics.http}/metrics")[0] == 401
    assert http_call(f"{only_metrics.http}/metrics", headers=bearer("scrape-key"))[0] == 200
    assert complete(only_metrics, None)[0] == 200


def test_keys_from_the_environment_and_bad_key_lists(make_served, monkeypatch):
    monkeypatch.setenv("TEST_TENANCY_KEYS", "key-a,key-b")
    monkeypatch.setenv("TEST_TENANCY_METRICS", "scrape-key")
    s = make_served(api_key_env="TEST_TENANCY_KEYS", metrics_key_env="TEST_TENANCY_METRICS")
    assert complete(s, "key-a")[0] == complete(s, "key-b")[0] == 200
    assert complete(s, "key-c")[0] == 401
    assert http_call(f"{s.http}/metrics", headers=bearer("scrape-key"))[0] == 200
    for key, value in (("server.api_key", "key-a,,key-b"), ("server.api_key", " , "),
                       ("server.metrics_key", "a,b"), ("server.metrics_key", " ")):  # fmt: skip
        cfg = Config()
        setattr(cfg.server, key.split(".")[1], value)
        with pytest.raises(ConfigError) as err:
            validate_config(cfg)
        assert err.value.key == key
    monkeypatch.setenv("TEST_TENANCY_KEYS", "key-a,")
    with pytest.raises(ConfigError) as err:
        start_servers(server_config(api_key_env="TEST_TENANCY_KEYS"), FakeEngine())
    assert err.value.key == "$TEST_TENANCY_KEYS"


# --------------------------------------------------------------------------- duplicate credentials


def raw_status(port: int, path: str, headers: list[tuple[str, str]], body: bytes | None = None) -> int:
    """A request with headers exactly as listed (http.client sends repeated ones as given)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("POST" if body is not None else "GET", path)
        for name, value in headers + [("Content-Length", str(len(body or b"")))]:
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


@pytest.mark.parametrize("values", [("key-a", "key-a"), ("key-a", "wrong"), ("wrong", "key-a"), ("key-a", "key-b")])
def test_duplicate_authorization_is_refused_on_both_front_ends(make_served, values):
    s = make_served(api_key="key-a,key-b")
    port = s.handle.http_port
    auth = [("Authorization", f"Bearer {v}") for v in values]
    body = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 2}'
    json_type = [("Content-Type", "application/json")]
    assert raw_status(port, "/v1/completions", json_type + auth, body) == 401
    assert raw_status(port, "/metrics", auth) == 401
    assert raw_status(port, "/v1/completions", json_type + auth[:1], body) == (200 if values[0] != "wrong" else 401)
    with pytest.raises(grpc.RpcError) as err:
        grpc_generate(s, None, metadata=tuple(("authorization", f"Bearer {v}") for v in values))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "one authorization" in err.value.details()
    assert grpc_generate(s, "key-a").finish_reason == pb.FINISH_REASON_LENGTH


# --------------------------------------------------------------------------- the partition


def test_each_key_and_salt_is_its_own_partition_on_both_front_ends(make_served):
    s = make_served(api_key="key-a,key-b")
    salts = {}
    for key in ("key-a", "key-b"):
        for salt in (None, "s1"):
            assert complete(s, key, **({"cache_salt": salt} if salt else {}))[0] == 200
            salts[key, salt] = last_salt(s)
            grpc_generate(s, key, salt)
            assert last_salt(s) == salts[key, salt]  # the same partition over gRPC
    assert len(set(salts.values())) == 4 and None not in salts.values()
    assert not any("key-a" in v or "key-b" in v for v in salts.values())  # a digest, never the key
    open_server = make_served()
    assert complete(open_server, None)[0] == 200 and last_salt(open_server) is None
    assert complete(open_server, None, cache_salt="s1")[0] == 200
    unkeyed_s1 = last_salt(open_server)
    assert unkeyed_s1 is not None and unkeyed_s1 not in salts.values()
    grpc_generate(open_server, None, "s1")
    assert last_salt(open_server) == unkeyed_s1


@pytest.mark.parametrize("salt", ["", 5, ["s"], "x" * 1025, "\ud800", "\u0000", "a\nb"])
def test_bad_cache_salt_is_refused_naming_the_field(make_served, salt):
    s = make_served()
    status, body = complete(s, None, cache_salt=salt)
    assert status == 400 and body["error"]["param"] == "cache_salt", body
    if isinstance(salt, str) and len(salt) < 1025 and salt.isprintable():
        with pytest.raises(grpc.RpcError) as err:
            grpc_generate(s, None, salt)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in err.value.details()


# --------------------------------------------------------------------------- the reported attacks, end to end


@pytest.fixture
def real_served(tiny_llama):
    from test_real_engine import RealServed

    from engine_utils import tiny_config

    made = []

    def make(method: str | None, **server):
        s = RealServed(tiny_config(tiny_llama, method, k=8, num_blocks=128, block_size=4), **server)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def ids_completion(s, key: str, ids: list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    status, out = http_call(f"{s.http}/v1/completions", body, bearer(key))
    assert status == 200, out
    return out


def test_prefix_cache_hits_in_metrics_do_not_reveal_another_keys_prompt(real_served):
    """Alice's prompt holds a PIN.  Bob sends the prompt with a wrong and a right guess and
    reads the hit counter in /metrics: no hit comes from Alice's blocks, so the right guess
    reads like the wrong one.  Alice's own repeat still hits."""
    s = real_served(None, api_key="alice,bob")
    tok = s.llm.tokenizer
    prefix = tok.encode("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16", add_special_tokens=False)
    question = tok.encode("w20 w21 w22 w23 w24 w25 w26 w27", add_special_tokens=False)

    def hits(key: str, pin: str) -> float:
        before = total(scrape(s.http, key), "specserve_prefix_cache_hits_total")
        ids_completion(s, key, prefix + tok.encode(pin, add_special_tokens=False) + question, 2)
        return total(scrape(s.http, key), "specserve_prefix_cache_hits_total") - before

    secret = "w40 w41 w42 w43"
    assert hits("alice", secret) == 0
    assert hits("bob", "w50 w51 w52 w53") == 0  # Bob's first request: nothing of his is cached
    wrong, right = hits("bob", "w60 w61 w62 w63"), hits("bob", secret)
    assert wrong == right == len(prefix) // 4 * 4  # his own earlier prefix only, whatever the guess
    assert hits("alice", secret) > right  # within a key the cache still works


def test_acceptance_counts_do_not_reveal_another_keys_answer(real_served):
    """Suffix decoding: Bob sends Alice's prompt followed by ever longer prefixes of her answer.
    His responses' spec_decode.num_accepted_tokens equal those of a server that never saw
    Alice; Alice's own repeats do draft from her answer."""
    victim = real_served("suffix", api_key="alice,bob")
    control = real_served("suffix", api_key="alice,bob")
    prompt = victim.llm.tokenizer.encode("w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21", add_special_tokens=False)
    first = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), model="tiny",
                               sampling_params=pb.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    answer = list(victim.stub.Generate(first, metadata=(("authorization", "Bearer alice"),)).token_ids)

    def accepted(s, key: str, n: int) -> int:
        return ids_completion(s, key, prompt + answer[:n], 16)["spec_decode"]["num_accepted_tokens"]

    guesses = [0, 2, 4, 8]
    seen = [accepted(victim, "bob", n) for n in guesses]
    assert seen == [accepted(control, "bob", n) for n in guesses]
    assert [accepted(victim, "alice", n) for n in guesses] != [accepted(control, "alice", n) for n in guesses]
    size = total(scrape(victim.http, "alice"), "specserve_suffix_cache_bytes")
    assert size == victim.llm.proposer.cache.num_bytes > 0
    assert total(scrape(victim.http, "bob"), "specserve_suffix_cache_responses") == len(guesses) * 2 + 1


# --------------------------------------------------------------------------- every timed cache, partitioned


@pytest.fixture
def byte_served(tmp_path):
    """A real engine on the tiny byte-level llama (llguidance reads its tokenizer), two keys."""
    from test_real_engine import RealServed
    from tiny_byte_model import make_byte_model

    from engine_utils import tiny_config

    s = RealServed(tiny_config(make_byte_model(tmp_path / "byte"), "ngram", k=4, num_blocks=128, block_size=4),
                   api_key="alice,bob")  # fmt: skip
    yield s
    s.close()


def test_the_grammar_cache_is_partitioned_like_the_prefix_cache(byte_served):
    """The report: Bob sending a schema Alice sent before was answered ~14x faster than a
    fresh one (a hit in a cache keyed by the grammar alone).  Now Bob's copy is compiled
    afresh, as a grammar nobody sent is; Alice's own repeat (and that of her cache_salt
    partition) still hits."""
    s = byte_served
    body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"choice": ["w7 w8", "w9 w10", "w11"]}}  # fmt: skip

    def compiles(key: str, **extra) -> int:
        before = s.llm.grammar_backend.cache.num_compiles
        status, out = http_call(f"{s.http}/v1/completions", {**body, **extra}, bearer(key))
        assert status == 200 and out["choices"][0]["text"] in ("w7 w8", "w9 w10", "w11"), out
        return s.llm.grammar_backend.cache.num_compiles - before

    assert compiles("alice") == 1
    assert compiles("bob") == 1  # Alice's grammar is no hit for Bob: compiled like a fresh one
    assert compiles("alice") == 0 and compiles("bob") == 0  # each key's own repeat hits
    assert compiles("alice", cache_salt="s1") == 1 and compiles("alice", cache_salt="s1") == 0
    # The same over gRPC (the same partition as HTTP for the same key).
    req = pb.GenerateRequest(prompt="w1 w2 w3", sampling_params=pb.SamplingParams(
        max_tokens=8, temperature=0, choice=["w7 w8", "w9 w10", "w11"]))  # fmt: skip
    before = s.llm.grammar_backend.cache.num_compiles
    s.stub.Generate(req, metadata=(("authorization", "Bearer bob"),))
    assert s.llm.grammar_backend.cache.num_compiles == before


# --------------------------------------------------------------------------- request ids per key


def test_request_ids_are_a_namespace_per_key(make_served):
    """Bob may use an id Alice has in flight (he cannot see or squat on hers); Alice may not
    use her own in-flight id twice.  On gRPC and HTTP (vLLM's request_id / X-Request-Id)."""
    import threading

    from fake_engine import FakeTokenizer

    engine = FakeEngine()
    held = FakeTokenizer().encode("hold")
    release = threading.Event()
    engine.stall = lambda prompt, step: prompt == held and not release.is_set()
    s = make_served(engine, api_key="alice,bob")
    alice, bob = (("authorization", "Bearer alice"),), (("authorization", "Bearer bob"),)
    pending = s.stub.Generate.future(pb.GenerateRequest(request_id="dup", prompt="hold",
                                     sampling_params=pb.SamplingParams(max_tokens=2)), metadata=alice)  # fmt: skip
    try:
        assert wait_for(lambda: s.handle.servers.frontend.num_inflight == 1)
        r = s.stub.Generate(pb.GenerateRequest(request_id="dup", prompt="hi",
                                               sampling_params=pb.SamplingParams(max_tokens=2)), metadata=bob)
        assert r.request_id == "dup" and r.finish_reason == pb.FINISH_REASON_LENGTH
        with pytest.raises(grpc.RpcError) as err:
            s.stub.Generate(pb.GenerateRequest(request_id="dup", prompt="hi"), metadata=alice)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()
        status, out = complete(s, "alice", request_id="dup")
        assert status == 400 and out["error"]["param"] == "request_id"
        status, out = complete(s, "bob", request_id="dup")
        assert status == 200 and out["id"] == "cmpl-dup"
        status, out = http_call(f"{s.http}/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 2},
                                {**bearer("bob"), "X-Request-Id": "from-header"})  # fmt: skip
        assert status == 200 and out["id"] == "cmpl-from-header"
        status, out = complete(s, "bob", request_id="dup", n=2)  # several choices hold the id too
        assert status == 200 and out["id"] == "cmpl-dup" and len(out["choices"]) == 2
    finally:
        release.set()
    assert pending.result(timeout=30).request_id == "dup"
    assert complete(s, "alice", request_id="dup")[0] == 200  # free again once it finished
