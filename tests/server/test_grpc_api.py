"""gRPC SpecServe against the fake engine: outputs, streaming, info, health, reflection, cancel, deadline."""

from __future__ import annotations

import grpc
import pytest
from fake_engine import FakeEngine, FakeTokenizer, expected_completion, expected_text
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_testutil import hold_after_steps, wait_for

from specserve.v1 import specserve_pb2 as pb

TOK = FakeTokenizer()


def test_generate_returns_the_engine_output(served):
    resp = served.stub.Generate(
        pb.GenerateRequest(request_id="r1", prompt="hello", sampling_params=pb.SamplingParams(max_tokens=10))
    )
    ids = TOK.encode("hello")
    assert resp.request_id == "r1"
    assert list(resp.token_ids) == expected_completion(ids, 10)
    assert resp.text == expected_text(ids, 10)
    assert resp.finish_reason == pb.FINISH_REASON_LENGTH
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), 10)
    s = resp.spec_decode
    assert s.num_drafts > 0 and s.num_draft_tokens == 3 * s.num_drafts
    assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)


def test_stream_deltas_add_up_and_the_last_message_carries_the_stats(served):
    req = pb.GenerateRequest(prompt="stream me", sampling_params=pb.SamplingParams(max_tokens=12))
    msgs = list(served.stub.GenerateStream(req))
    whole = served.stub.Generate(req)
    assert len(msgs) > 2
    assert "".join(m.text for m in msgs) == whole.text
    assert [t for m in msgs for t in m.token_ids] == list(whole.token_ids)
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not m.HasField("spec_decode") for m in msgs[:-1])
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[-1].spec_decode == whole.spec_decode
    assert msgs[-1].usage.completion_tokens == 12
    assert len({m.request_id for m in msgs}) == 1 and msgs[0].request_id


def test_token_ids_and_messages_inputs(served, engine):
    ids = [10, 20, 30]
    resp = served.stub.Generate(
        pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling_params=pb.SamplingParams(max_tokens=4))
    )
    assert list(resp.token_ids) == expected_completion(ids, 4)
    msgs = [pb.ChatMessage(role="system", content="be brief"), pb.ChatMessage(role="user", content="hi")]
    resp = served.stub.Generate(
        pb.GenerateRequest(
            request_id="chat-1",
            messages=pb.ChatMessages(messages=msgs),
            sampling_params=pb.SamplingParams(max_tokens=4),
        )
    )
    chat_ids = TOK.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert engine.requests["chat-1"].prompt_ids == chat_ids
    assert list(resp.token_ids) == expected_completion(chat_ids, 4)


def test_sampling_defaults_and_explicit_values_reach_the_engine(served, engine):
    served.stub.Generate(pb.GenerateRequest(request_id="d", prompt="x"))
    p = engine.requests["d"].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.seed) == (1.0, 1.0, 0, 0.0, 8, None)
    sp = pb.SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.1, max_tokens=5, seed=0,
                           stop=["zz"], stop_token_ids=[3], ignore_eos=True)  # fmt: skip
    served.stub.Generate(pb.GenerateRequest(request_id="e", prompt="x", sampling_params=sp))
    p = engine.requests["e"].params
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (0.0, 0.5, 7, 5, 0)
    assert p.min_p == pytest.approx(0.1) and p.stop == ["zz"] and p.stop_token_ids == [3] and p.ignore_eos


def test_stop_string_finishes_with_stop(served):
    ids = TOK.encode("hello")
    full = expected_text(ids, 10)
    resp = served.stub.Generate(
        pb.GenerateRequest(prompt="hello", sampling_params=pb.SamplingParams(max_tokens=10, stop=[full[4:6]]))
    )
    assert resp.finish_reason == pb.FINISH_REASON_STOP
    assert resp.text == full[:4]


def test_model_info(served):
    info = served.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.model_name, info.method, info.num_speculative_tokens) == ("fake-model", "ngram", 3)
    assert (info.max_model_len, info.dtype, info.device, info.lossless) == (256, "float32", "cpu", True)


def test_unknown_model_is_not_found(served):
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Generate(pb.GenerateRequest(prompt="x", model="other"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "model" in err.value.details()


def test_health_per_service_and_reflection(served):
    health = health_pb2_grpc.HealthStub(served.channel)
    for service in ("", "specserve.v1.SpecServe"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    [resp] = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"specserve.v1.SpecServe", "grpc.health.v1.Health"} <= names


def test_cancelled_stream_aborts_the_request(make_served):
    engine = FakeEngine()
    hold_after_steps(engine, 1)  # it cannot finish before the cancel
    s = make_served(engine)
    call = s.stub.GenerateStream(
        pb.GenerateRequest(request_id="gone", prompt="abc", sampling_params=pb.SamplingParams(max_tokens=60))
    )
    next(call)
    call.cancel()
    assert wait_for(lambda: "gone" in engine.aborted), "the engine never saw the abort"
    assert engine.num_running == 0 and engine.kv_cache_usage == 0.0


def test_deadline_is_honoured_and_aborts(make_served):
    engine = FakeEngine()
    hold_after_steps(engine, 1)  # the request cannot finish: only the deadline ends it
    s = make_served(engine)
    with pytest.raises(grpc.RpcError) as err:
        s.stub.Generate(
            pb.GenerateRequest(request_id="late", prompt="abc", sampling_params=pb.SamplingParams(max_tokens=60)),
            timeout=5.0,  # only for the request to reach the engine; the hold makes it late
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: "late" in engine.aborted)


def test_duplicate_in_flight_request_id_is_refused(make_served):
    engine = FakeEngine()
    hold_after_steps(engine, 1)  # still in flight when the duplicate arrives
    s = make_served(engine)
    call = s.stub.GenerateStream(
        pb.GenerateRequest(request_id="dup", prompt="abc", sampling_params=pb.SamplingParams(max_tokens=30))
    )
    next(call)
    with pytest.raises(grpc.RpcError) as err:
        s.stub.Generate(pb.GenerateRequest(request_id="dup", prompt="abc"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("request_id:")
    call.cancel()
