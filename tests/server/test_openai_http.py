"""The OpenAI-compatible HTTP server, driven by the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import http.client
import json

import openai
import pytest
from fake_engine import FakeEngine, FakeTokenizer, expected_text
from server_testutil import hold_after_steps, http_call, scrape, total, wait_for

from specserve.v1 import specserve_pb2 as pb

TOK = FakeTokenizer()
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def test_completions_match_the_engine(served):
    client = served.openai()
    resp = client.completions.create(model="fake-model", prompt="hello", max_tokens=10, temperature=0)
    assert resp.choices[0].text == expected_text(TOK.encode("hello"), 10)
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.total_tokens) == (5, 10, 15)
    spec = resp.model_extra["spec_decode"]
    assert spec["num_drafts"] > 0
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])

    ids = [11, 22, 33]
    resp = client.completions.create(model="fake-model", prompt=ids, max_tokens=4)
    assert resp.choices[0].text == expected_text(ids, 4)


def test_completions_stream(served):
    client = served.openai()
    chunks = list(
        client.completions.create(
            model="fake-model", prompt="hello", max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text(TOK.encode("hello"), 12)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert "spec_decode" in finals[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_completions_plain_and_stream(served, engine):
    client = served.openai()
    prompt_ids = TOK.apply_chat_template(CHAT)
    resp = client.chat.completions.create(model="fake-model", messages=CHAT, max_completion_tokens=6)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected_text(prompt_ids, 6)
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.model_extra["spec_decode"]["num_drafts"] >= 1

    stream = client.chat.completions.create(model="fake-model", messages=CHAT, max_tokens=6, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_text(prompt_ids, 6)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_sse_wire_format_ends_with_done(served):
    conn = http.client.HTTPConnection("127.0.0.1", served.handle.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 5, "stream": True}),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = [line for line in resp.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    conn.close()


def test_models_health_and_unknown_model(served):
    models = served.openai().models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    status, body = http_call(f"{served.http}/health")
    assert status == 200 and body["status"] == "ok"
    with pytest.raises(openai.NotFoundError) as err:
        served.openai().completions.create(model="gpt-17", prompt="x")
    error = err.value.body
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["param"] == "model" and error["code"] == "model_not_found" and "gpt-17" in error["message"]


def test_metrics_agree_with_the_per_request_spec_stats(served):
    client = served.openai()
    seen = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for i in range(3):
        r = client.completions.create(model="fake-model", prompt=f"prompt {i}", max_tokens=9)
        for key in seen:
            seen[key] += r.model_extra["spec_decode"][key]
    r = served.stub.Generate(pb.GenerateRequest(prompt="via grpc", sampling_params=pb.SamplingParams(max_tokens=7)))
    for key in seen:
        seen[key] += getattr(r.spec_decode, key)
    m = scrape(served.http)
    base = {"model_name": "fake-model", "method": "ngram"}
    assert total(m, "specserve_spec_decode_num_drafts_total", **base) == seen["num_drafts"]
    assert total(m, "specserve_spec_decode_num_draft_tokens_total", **base) == seen["num_draft_tokens"]
    assert total(m, "specserve_spec_decode_num_accepted_tokens_total", **base) == seen["num_accepted_tokens"]
    assert total(m, "specserve_spec_decode_num_accepted_tokens_per_pos_total") == seen["num_accepted_tokens"]
    assert total(m, "specserve_spec_decode_acceptance_length_count") == seen["num_drafts"]
    assert total(m, "specserve_spec_decode_acceptance_length_sum") == seen["num_drafts"] + seen["num_accepted_tokens"]
    assert total(m, "specserve_request_success_total", finished_reason="length") == 4
    assert total(m, "specserve_generation_tokens_total") == 3 * 9 + 7
    assert total(m, "specserve_time_to_first_token_seconds_count") == 4
    assert total(m, "specserve_num_requests_running") == 0
    assert total(m, "specserve_kv_cache_usage_perc") == 0
    assert total(m, "specserve_spec_decode_config_info", lossless="true") == 1


def test_client_disconnect_during_sse_aborts(make_served):
    engine = FakeEngine()
    hold_after_steps(engine, 1)  # the first chunk arrives, then the stream cannot finish before the disconnect
    s = make_served(engine)
    conn = http.client.HTTPConnection("127.0.0.1", s.handle.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "bye", "max_tokens": 60, "stream": True}),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    [request_id] = list(engine.requests)
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    assert wait_for(lambda: request_id in engine.aborted), "the engine never saw the abort"
    assert engine.num_running == 0


def test_client_disconnect_while_waiting_for_a_plain_answer_aborts(make_served):
    engine = FakeEngine()
    hold_after_steps(engine, 1)  # mid-generation, so no answer can be sent before the disconnect
    s = make_served(engine)
    conn = http.client.HTTPConnection("127.0.0.1", s.handle.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "bye", "max_tokens": 60}),
                 {"Content-Type": "application/json"})  # fmt: skip
    assert wait_for(lambda: engine.num_running == 1 and not engine.hold.is_set())  # its first step ran
    [request_id] = list(engine.requests)
    conn.sock.close()
    conn.close()
    assert wait_for(lambda: request_id in engine.aborted), "the engine never saw the abort"
