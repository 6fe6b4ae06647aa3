"""Stop strings end to end: a stream sends exactly what the whole answer is, on gRPC and
HTTP, with and without speculation (tiny random llama: plain decoding, n-gram K=4 and the
embedded server's default Predicted Outputs off), for stop strings cut out of the greedy
output itself so that they match, often inside a run of tokens one step accepted.

For each stop string (and with ``include_stop_str_in_output`` on and off): gRPC
``GenerateStream``'s token ids and log-probabilities add up to ``Generate``'s, whose count
is ``usage.completion_tokens``; HTTP streamed text and log-probability entries add up to the
non-streamed answer; and every method gives the same answer (the report: a stream sent 6
token ids and 6 log-probabilities while the answer had 3, and plain decoding and n-gram
streams differed on 3 of 11 stop strings)."""

from __future__ import annotations

import json
import random

import grpc
import pytest
from engine_utils import tiny_config
from server_testutil import http_call, wait_for
from test_real_engine import RealServed

from specserve.v1 import specserve_pb2 as pb

pytestmark = pytest.mark.timeout(300)

PROMPT = "w10 w11 w12 w10 w11 w12 w10 w11 w30 w31 w30 w31 w30"
MAX = 40


@pytest.fixture(scope="module")
def servers(tiny_llama):
    made = {
        "plain": RealServed(tiny_config(tiny_llama, None, num_blocks=256, block_size=4)),
        "ngram": RealServed(tiny_config(tiny_llama, "ngram", k=4, num_blocks=256, block_size=4)),
    }
    yield made
    for s in made.values():
        s.close()


def grpc_whole(s, stop: list[str], include: bool) -> tuple:
    sp = pb.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, stop=stop, logprobs=1,
                           include_stop_str_in_output=include)  # fmt: skip
    r = s.stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=sp), timeout=60)
    assert r.usage.completion_tokens == len(r.token_ids) == len(r.logprobs)
    return r.text, list(r.token_ids), [e.token_id for e in r.logprobs], r.finish_reason


def grpc_streamed(s, stop: list[str], include: bool) -> tuple:
    sp = pb.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True, stop=stop, logprobs=1,
                           include_stop_str_in_output=include)  # fmt: skip
    text, ids, lps, last = "", [], [], None
    for m in s.stub.GenerateStream(pb.GenerateRequest(prompt=PROMPT, sampling_params=sp), timeout=60):
        assert len(m.logprobs) == len(m.token_ids)
        text += m.text
        ids += list(m.token_ids)
        lps += [e.token_id for e in m.logprobs]
        last = m
    assert last.usage.completion_tokens == len(ids)
    return text, ids, lps, last.finish_reason


def http_answer(s, stop: list[str], include: bool, stream: bool) -> tuple:
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": MAX, "ignore_eos": True,
            "stop": stop, "logprobs": 1, "include_stop_str_in_output": include, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, out = http_call(f"{s.http}/v1/completions", body)
    assert status == 200, out
    if not stream:
        c = out["choices"][0]
        assert out["usage"]["completion_tokens"] == len(c["logprobs"]["tokens"])
        return c["text"], c["logprobs"]["tokens"], c["finish_reason"]
    text, tokens, finish, usage = "", [], None, None
    for line in out.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk["choices"]:
            text += c["text"]
            tokens += (c["logprobs"] or {}).get("tokens", [])
            finish = c["finish_reason"] or finish
    assert usage["completion_tokens"] == len(tokens)
    return text, tokens, finish


def stop_cases(text: str, n: int = 8) -> list[list[str]]:
    """Stop strings out of ``text``: short and long ones, one or two at a time."""
    rng = random.Random(4)
    cases = []
    for _ in range(n):
        a = rng.randrange(1, max(2, len(text) - 2))
        s = text[a : a + rng.randint(1, 14)]
        cases.append([s] if rng.random() < 0.6 else [s, text[rng.randrange(len(text)) :][:5]])
    return cases


def test_streams_send_what_the_answer_is_on_both_protocols_with_and_without_speculation(servers):
    plain, ngram = servers["plain"], servers["ngram"]
    reference = grpc_whole(plain, [], False)
    assert len(reference[1]) == MAX
    checked = 0
    for stop in stop_cases(reference[0]):
        for include in (False, True):
            answers = {}
            for name, s in servers.items():
                whole = grpc_whole(s, stop, include)
                assert grpc_streamed(s, stop, include) == whole, (name, stop, include)
                assert whole[1] == whole[2]  # one log-probability per token, for that token
                http_whole = http_answer(s, stop, include, stream=False)
                assert http_answer(s, stop, include, stream=True) == http_whole, (name, stop, include)
                assert http_whole[0] == whole[0] and len(http_whole[1]) == len(whole[1])
                answers[name] = whole
            assert answers["plain"] == answers["ngram"], (stop, include)  # speculation changes nothing
            text, ids = answers["plain"][0], answers["plain"][1]
            if answers["plain"][3] == pb.FINISH_REASON_STOP:
                checked += 1
                assert any(x in (reference[0][: len(text) + len(x)]) for x in stop)
                assert len(ids) < MAX  # the tokens past the stop string are gone
    assert checked >= 8
    # The n-gram server did accept drafts: its steps delivered several tokens at once.
    sp = pb.SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    assert ngram.stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=sp)).spec_decode.num_accepted_tokens > 4
    for s in (plain, ngram):
        assert wait_for(s.kv_free)


def test_the_reported_case_on_the_grpc_stream(servers):
    """A stop string whose last token arrives in the same step as tokens after it: the stream
    sends the answer's tokens only (3 in the report, where it had sent 6)."""
    plain = servers["plain"]
    text = grpc_whole(plain, [], False)[0]
    words = text.split()
    stop = [" ".join(words[3:6])]  # three words in: completed inside a step's run of tokens
    for s in servers.values():
        whole = grpc_whole(s, stop, False)
        assert whole[3] == pb.FINISH_REASON_STOP and whole[0] == text[: text.index(stop[0])]
        assert grpc_streamed(s, stop, False) == whole
        with pytest.raises(grpc.RpcError):  # a control: bad input still fails cleanly
            s.stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=pb.SamplingParams(stop=[""])))
