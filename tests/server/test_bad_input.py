"""Every bad input gets INVALID_ARGUMENT / 400 naming the field, and the server keeps serving."""

from __future__ import annotations

import grpc
import pytest
from server_testutil import http_call

from specserve.v1 import specserve_pb2 as pb

LONG = "x" * 300  # the fake model's max_model_len is 256; the server's max_tokens cap is 64


def _req(prompt="hello", **sp) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling_params=pb.SamplingParams(**sp))


GRPC_CASES = [
    ("empty prompt", _req(""), "prompt"),
    ("no input", pb.GenerateRequest(), "prompt"),
    ("prompt longer than max_model_len", _req(LONG), "prompt"),
    ("prompt + max_tokens beyond max_model_len", _req("y" * 250, max_tokens=10), "max_tokens"),
    ("max_tokens 0", _req(max_tokens=0), "max_tokens"),
    ("max_tokens over the cap", _req(max_tokens=65), "max_tokens"),
    ("temperature < 0", _req(temperature=-0.5), "temperature"),
    ("top_p 0", _req(top_p=0.0), "top_p"),
    ("top_p > 1", _req(top_p=1.5), "top_p"),
    ("top_k < -1", _req(top_k=-2), "top_k"),
    ("min_p > 1", _req(min_p=2.0), "min_p"),
    ("empty stop string", _req(stop=[""]), "stop"),
    ("token id out of vocab", pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 99999])), "prompt_token_ids"),
    ("empty token ids", pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[])), "prompt_token_ids"),
    (
        "unknown role",
        pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="hi")])),
        "messages[0].role",
    ),
    ("empty messages", pb.GenerateRequest(messages=pb.ChatMessages()), "messages"),
]


@pytest.mark.parametrize("name,request_,field", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_bad_input(served, name, request_, field):
    for rpc in (served.stub.Generate, lambda r: list(served.stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as err:
            rpc(request_)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert err.value.details().startswith(f"{field}:"), err.value.details()


COMPLETION_CASES = [
    ("malformed JSON", b'{"prompt": "hi", ', "body"),
    ("not an object", b"[1, 2]", "body"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("missing prompt", {"max_tokens": 3}, "prompt"),
    ("prompt wrong type", {"prompt": 5}, "prompt"),
    ("a prompt list of mixed kinds", {"prompt": ["a", 5]}, "prompt"),
    ("n 0", {"prompt": "hi", "n": 0}, "n"),
    ("best_of < n", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    ("best_of with stream", {"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ("logprobs over 5", {"prompt": "hi", "logprobs": 6}, "logprobs"),
    ("presence_penalty out of range", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("logit_bias bad key", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("logit_bias out of range", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("response_format unknown type", {"prompt": "hi", "response_format": {"type": "yaml"}}, "response_format"),
    ("prompt longer than max_model_len", {"prompt": LONG}, "prompt"),
    ("token id out of vocab", {"prompt": [1, 99999]}, "prompt_token_ids"),
    ("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens over the cap", {"prompt": "hi", "max_tokens": 65}, "max_tokens"),
    ("max_tokens wrong type", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("max_completion_tokens 0", {"prompt": "hi", "max_completion_tokens": 0}, "max_completion_tokens"),
    ("temperature < 0", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("temperature wrong type", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("top_p 0", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("top_p > 1", {"prompt": "hi", "top_p": 1.01}, "top_p"),
    ("seed wrong type", {"prompt": "hi", "seed": 1.5}, "seed"),
    ("stop wrong type", {"prompt": "hi", "stop": 7}, "stop"),
    ("stop_token_ids wrong type", {"prompt": "hi", "stop_token_ids": ["a"]}, "stop_token_ids"),
    ("ignore_eos wrong type", {"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
    ("n too large", {"prompt": "hi", "n": 1000}, "n"),
    ("stream wrong type", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("stream_options without stream", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("model wrong type", {"prompt": "hi", "model": 3}, "model"),
    ("echo wrong type", {"prompt": "hi", "echo": "yes"}, "echo"),
]

CHAT_CASES = [
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("message not an object", {"messages": ["hi"]}, "messages[0]"),
    ("messages missing", {"max_tokens": 2}, "messages"),
    ("messages wrong type", {"messages": "hi"}, "messages"),
    ("content wrong type", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ("temperature < 0", {"messages": [{"role": "user", "content": "hi"}], "temperature": -2}, "temperature"),
    ("n too large", {"messages": [{"role": "user", "content": "hi"}], "n": 1000}, "n"),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3},
     "top_logprobs"),
    ("echo on chat", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("json_schema without schema", {"messages": [{"role": "user", "content": "hi"}],
                                    "response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
]


@pytest.mark.parametrize(
    "path,name,body,field",
    [("/v1/completions", *c) for c in COMPLETION_CASES] + [("/v1/chat/completions", *c) for c in CHAT_CASES],
    ids=[f"completions-{c[0]}" for c in COMPLETION_CASES] + [f"chat-{c[0]}" for c in CHAT_CASES],
)
def test_http_bad_input(served, path, name, body, field):
    status, resp = http_call(served.http + path, body)
    assert status == 400, (name, resp)
    error = resp["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}:"), error
    assert error["type"] == "invalid_request_error"


def test_the_server_keeps_serving_after_bad_input(served):
    for _, request_, _ in GRPC_CASES:
        with pytest.raises(grpc.RpcError):
            served.stub.Generate(request_)
    for _, body, _ in COMPLETION_CASES:
        assert http_call(served.http + "/v1/completions", body)[0] == 400
    assert served.stub.Generate(_req(max_tokens=3)).finish_reason == pb.FINISH_REASON_LENGTH
    status, resp = http_call(served.http + "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    assert status == 200 and resp["choices"][0]["finish_reason"] == "length"
    status, _ = http_call(served.http + "/health")
    assert status == 200
    assert served.engine.num_running == 0 and served.engine.num_waiting == 0


def test_unknown_route_and_method_get_openai_errors(served):
    status, resp = http_call(served.http + "/v1/nothing-here", {"x": 1})
    assert status == 404 and "error" in resp
    status, resp = http_call(served.http + "/v1/models", {"x": 1})  # POST on a GET route
    assert status == 405 and "error" in resp
