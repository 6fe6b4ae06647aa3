"""The request surface of both servers against the fake engine: chat ``n``, usage after a
stop string, unreadable bodies and messages, over-long or control-character names, and
what an abandoned fan-out stream leaves behind."""

from __future__ import annotations

import asyncio
import gc
import gzip
import http.client
import json
import logging

import grpc
import pytest
from fake_engine import FakeEngine, FakeTokenizer, expected_completion, expected_text
from server_testutil import hold_after_steps, http_call, scrape, total, wait_for

from specserve.v1 import specserve_pb2 as pb

TOK = FakeTokenizer()
CHAT = [{"role": "user", "content": "pick a letter"}]
CHAT_IDS = TOK.apply_chat_template(CHAT)


def _sse_events(port: int, path: str, body: dict) -> list[dict | str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    raw = resp.read().decode()
    conn.close()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


# --------------------------------------------------------------------------- chat n


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [2, 3, 16])
def test_chat_n_gives_n_choices_with_their_own_seeds(served, engine, n, stream):
    r = served.openai().chat.completions.create(model="fake-model", messages=CHAT, n=n, max_tokens=5, seed=7,
                                                stream=stream)  # fmt: skip
    want = expected_text(CHAT_IDS, 5)
    if stream:
        texts: dict[int, str] = {}
        for chunk in r:
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
        assert texts == {i: want for i in range(n)}
    else:
        assert [c.index for c in r.choices] == list(range(n))
        assert all(c.message.content == want and c.finish_reason == "length" for c in r.choices)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(CHAT_IDS), 5 * n)
    assert sorted(req.params.seed for req in engine.requests.values()) == list(range(7, 7 + n))


def test_chat_n_stream_on_the_wire(served):
    events = _sse_events(served.handle.http_port, "/v1/chat/completions",
                         {"messages": CHAT, "n": 2, "max_tokens": 4, "stream": True,
                          "stream_options": {"include_usage": True}})  # fmt: skip
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert roles == [0, 1]  # one role preamble per choice, first
    assert sorted(c["choices"][0]["index"] for c in finals) == [0, 1]
    assert all("spec_decode" in c for c in finals)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert set(usage["usage"]["completion_tokens_details"]) == {"accepted_prediction_tokens",
                                                               "rejected_prediction_tokens"}


def test_chat_best_of_is_refused_naming_the_endpoint(served):
    status, body = http_call(f"{served.http}/v1/chat/completions", {"messages": CHAT, "n": 2, "best_of": 3})
    assert status == 400 and body["error"]["param"] == "best_of"
    assert "/v1/completions" in body["error"]["message"]


# --------------------------------------------------------------------------- usage after a stop string

# The fake engine emits 1 token, then 1, then 4 (accept pattern 2, 0, 3, 1): a stop string
# at the third character arrives with three tokens past it in the same step.
STOP_CASES = {
    "completions": ("/v1/completions", {"prompt": "hi"}, TOK.encode("hi")),
    "chat": ("/v1/chat/completions", {"messages": CHAT}, CHAT_IDS),
}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("endpoint", list(STOP_CASES))
def test_usage_counts_only_the_tokens_returned_before_a_stop_string(served, endpoint, n):
    path, body, prompt_ids = STOP_CASES[endpoint]
    full = expected_text(prompt_ids, 8)
    body = {**body, "max_tokens": 8, "stop": [full[2]], "n": n}
    status, resp = http_call(served.http + path, body)
    assert status == 200, resp
    texts = [c["text"] if "text" in c else c["message"]["content"] for c in resp["choices"]]
    assert texts == [full[:2]] * n and all(c["finish_reason"] == "stop" for c in resp["choices"])
    usage = resp["usage"]
    assert usage["completion_tokens"] == 2 * n  # not the 6 tokens per choice the engine generated
    assert usage["total_tokens"] == usage["prompt_tokens"] + 2 * n
    assert usage["completion_tokens_details"] == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}

    events = _sse_events(served.handle.http_port, path,
                         {**body, "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    assert events[-2]["usage"]["completion_tokens"] == 2 * n


def test_grpc_token_ids_and_usage_end_at_the_stop_string(served):
    ids = TOK.encode("hello")
    full = expected_text(ids, 10)
    req = pb.GenerateRequest(prompt="hello", sampling_params=pb.SamplingParams(max_tokens=10, stop=[full[2]]))
    resp = served.stub.Generate(req)
    assert resp.text == full[:2] and resp.finish_reason == pb.FINISH_REASON_STOP
    assert list(resp.token_ids) == expected_completion(ids, 2)
    assert resp.usage.completion_tokens == 2
    msgs = list(served.stub.GenerateStream(req))
    assert [t for m in msgs for t in m.token_ids] == expected_completion(ids, 2)
    assert "".join(m.text for m in msgs) == full[:2] and msgs[-1].usage.completion_tokens == 2


# --------------------------------------------------------------------------- unreadable input


def test_a_gzip_labelled_plain_body_is_400_naming_the_body(served):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    status, resp = http_call(f"{served.http}/v1/completions", body, headers={"Content-Encoding": "gzip"})
    assert status == 400, resp
    assert resp["error"]["param"] == "body" and "content-encoding" in resp["error"]["message"].lower()
    status, resp = http_call(f"{served.http}/v1/completions", gzip.compress(body), headers={"Content-Encoding": "gzip"})
    assert status == 200 and resp["usage"]["completion_tokens"] == 2  # real gzip still works
    assert total(scrape(served.http), "specserve_request_errors_total", reason="internal") == 0


@pytest.mark.parametrize("method", ["Generate", "GenerateStream", "GetModelInfo"])
def test_grpc_malformed_message_is_invalid_argument(served, method):
    call = (served.channel.unary_stream if method == "GenerateStream" else served.channel.unary_unary)(
        f"/specserve.v1.SpecServe/{method}"
    )
    with pytest.raises(grpc.RpcError) as err:
        result = call(b"\xff\xff\xff\xff", timeout=10)
        list(result) if method == "GenerateStream" else result
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert err.value.details().startswith("request: is not a valid specserve.v1."), err.value.details()
    assert served.stub.Generate(pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(max_tokens=2)))


# --------------------------------------------------------------------------- names from clients


def test_an_over_long_model_name_is_refused_naming_the_field(served):
    status, resp = http_call(f"{served.http}/v1/completions", {"prompt": "hi", "model": "m" * 8192})
    assert status == 400 and resp["error"]["param"] == "model"
    assert len(resp["error"]["message"]) < 200
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Generate(pb.GenerateRequest(prompt="hi", model="m" * 8192))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("model:")


@pytest.mark.parametrize("request_id", ["r" * 257, "x\x1b[31m\n" * 200_000, "line\nbreak", "bidi\u202e"])
def test_a_bad_request_id_is_refused_and_never_echoed_raw(served, engine, request_id):
    for rpc in (served.stub.Generate, lambda r: list(served.stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as err:
            rpc(pb.GenerateRequest(request_id=request_id, prompt="hi"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details()
        assert details.startswith("request_id:") and details.isprintable() and len(details) < 400, details
    assert not engine.requests
    ok = served.stub.Generate(pb.GenerateRequest(request_id="r" * 256, prompt="hi"))
    assert ok.request_id == "r" * 256


def test_client_text_in_logs_is_escaped(served, caplog):
    caplog.set_level(logging.INFO, logger="specserve.server.http")
    status, _ = http_call(f"{served.http}/v1/models/evil%1b%5b2J%0aforged")
    assert status == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "specserve.server.http"]
    assert lines and all(line.isprintable() for line in lines), lines
    assert any("\\x1b[2J\\nforged" in line for line in lines), lines


# --------------------------------------------------------------------------- an abandoned fan-out


def test_an_abandoned_n_stream_leaves_no_pending_task(make_served, caplog):
    engine = FakeEngine()
    hold_after_steps(engine, 1)  # mid-stream until the client is gone, whatever the machine's speed
    s = make_served(engine)
    caplog.set_level(logging.ERROR, logger="asyncio")
    conn = http.client.HTTPConnection("127.0.0.1", s.handle.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "bye", "max_tokens": 60, "n": 3, "stream": True}),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    ids = list(engine.requests)
    assert len(ids) == 3
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    assert wait_for(lambda: all(r in engine.aborted for r in ids)), "the engine never saw the aborts"
    assert wait_for(lambda: s.handle.servers.frontend.num_inflight == 0)

    async def pending_getters() -> list[str]:
        await asyncio.sleep(0)  # let the handler finish its cleanup
        return [repr(t) for t in asyncio.all_tasks() if "Queue.get" in repr(t.get_coro())]

    gc.collect()  # a forgotten pending task that is garbage is reported now
    leftover = asyncio.run_coroutine_threadsafe(pending_getters(), s.handle.loop).result(10)
    destroyed = [r.getMessage() for r in caplog.records if "Task was destroyed but it is pending" in r.getMessage()]
    assert leftover == [] and destroyed == [], (leftover, destroyed)
