"""vLLM's request fields on both HTTP endpoints, gRPC and the offline API, each doing what
vLLM defines (the report: ten of them were accepted and silently ignored), with
speculation lossless under each: greedy answers equal between plain decoding and n-gram
speculation.  Also the default output length when the KV cache, not max_model_len, is the
limit (the report: a 400 naming max_tokens, which the client had not sent).

Tiny random llamas: the word-level tokenizer (its decoder puts spaces between tokens) with
a post-processor that adds BOS, so ``add_special_tokens`` and ``spaces_between_special_tokens``
have something to show."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
from engine_utils import tiny_config
from server_testutil import http_call, wait_for
from test_real_engine import RealServed

from specserve import LLM, SamplingParams
from specserve.v1 import specserve_pb2 as pb

pytestmark = pytest.mark.timeout(300)

PROMPT = "w10 w11 w12 w10 w11 w12 w10 w11 w30 w31 w30 w31 w30"
CHAT = [{"role": "user", "content": "w20 w21 w20 w21 w22"}]
SPECIAL = [1, 2]  # <s>, </s>: the tiny vocabulary's special tokens (ignore_eos keeps </s> going)


@pytest.fixture(scope="module")
def bos_model(tiny_llama, tmp_path_factory):
    """The tiny llama whose tokenizer adds <s> in front of a text (as Llama's does)."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("bos") / "m"
    shutil.copytree(tiny_llama, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def servers(bos_model):
    made = {name: RealServed(tiny_config(bos_model, method, k=4, num_blocks=256, block_size=4))
            for name, method in (("plain", None), ("ngram", "ngram"))}  # fmt: skip
    yield made
    for s in made.values():
        s.close()


def complete(s, **body) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 24, "ignore_eos": True, **body}
    status, out = http_call(f"{s.http}/v1/completions", body)
    assert status == 200, out
    return out


def chat(s, **body) -> dict:
    body = {"model": "tiny", "messages": CHAT, "temperature": 0, "max_tokens": 24, "ignore_eos": True, **body}
    status, out = http_call(f"{s.http}/v1/chat/completions", body)
    assert status == 200, out
    return out


def refused(s, path: str, **body) -> str:
    base = {"model": "tiny", "temperature": 0, "max_tokens": 4}
    base.update({"prompt": PROMPT} if path == "completions" else {"messages": CHAT})
    status, out = http_call(f"{s.http}/v1/{path}", {**base, **body})
    assert status == 400, out
    return out["error"]["param"]


def both(servers, fn, **body):
    """The answer on both servers; they must agree (speculation is lossless)."""
    a, b = fn(servers["plain"], **body), fn(servers["ngram"], **body)
    key = "text" if "text" in a["choices"][0] else "message"
    assert a["choices"][0][key] == b["choices"][0][key], body
    return a


def text_of(out: dict) -> str:
    c = out["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


# --------------------------------------------------------------------------- output text


def test_include_stop_str_in_output(servers):
    for fn in (chat, complete):
        whole = text_of(both(servers, fn))
        stop = " ".join(whole.split()[4:6])
        cut = text_of(both(servers, fn, stop=[stop]))
        kept = text_of(both(servers, fn, stop=[stop], include_stop_str_in_output=True))
        assert cut == whole[: whole.index(stop)] and kept == whole[: whole.index(stop) + len(stop)]
    sp = pb.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    r = servers["ngram"].stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=sp))
    assert r.text == whole[: whole.index(stop) + len(stop)]


def test_special_tokens_in_the_text(servers):
    """allowed_token_ids limited to the two special tokens: skip_special_tokens false shows
    them (joined by the decoder's spaces, or by nothing with spaces_between_special_tokens
    false); the default hides them."""
    body = dict(allowed_token_ids=SPECIAL)
    assert text_of(both(servers, complete, **body)) == ""
    shown = text_of(both(servers, complete, skip_special_tokens=False, **body))
    joined = text_of(both(servers, complete, skip_special_tokens=False, spaces_between_special_tokens=False, **body))
    assert shown.split() and set(shown.split()) <= {"<s>", "</s>"}
    assert joined == " " + shown.lstrip().replace(" ", "")  # (the space after the prompt is the decoder's)
    out = complete(servers["plain"], skip_special_tokens=False, logprobs=0, **body)
    assert out["usage"]["completion_tokens"] == 24 == len(out["choices"][0]["logprobs"]["tokens"])
    sp = pb.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, allowed_token_ids=SPECIAL,
                           skip_special_tokens=False, spaces_between_special_tokens=False)  # fmt: skip
    assert servers["ngram"].stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=sp)).text == joined


# --------------------------------------------------------------------------- vocabulary


def test_allowed_token_ids_and_bad_words_hold_at_every_verified_position(servers):
    tok = servers["plain"].llm.tokenizer
    allowed = tok.encode("w10 w11 w12 w30", add_special_tokens=False)
    for fn in (complete, chat):
        out = both(servers, fn, allowed_token_ids=allowed, logprobs=True if fn is chat else 0)
        assert set(text_of(out).split()) <= {"w10", "w11", "w12", "w30"}
        plain = text_of(both(servers, fn))
        words = plain.split()
        banned = [words[0], " ".join(words[2:4])]  # a one-token word and a two-token one
        avoided = text_of(both(servers, fn, bad_words=banned))
        assert avoided != plain and words[0] not in avoided.split()
        assert banned[1] not in avoided
    # n-gram did speculate here (so the equalities above compared speculative decoding)
    assert complete(servers["ngram"], bad_words=banned)["spec_decode"]["num_accepted_tokens"] > 0
    sp = pb.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=banned)
    r = servers["ngram"].stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=sp))
    assert r.text == text_of(complete(servers["plain"], bad_words=banned))
    for field, value in (("allowed_token_ids", []), ("allowed_token_ids", [10**6]), ("bad_words", [""]),
                         ("bad_words", "w1"), ("bad_words", ["w"] * 129)):  # fmt: skip
        assert refused(servers["plain"], "completions", **{field: value}) == field


# --------------------------------------------------------------------------- the prompt


def test_add_special_tokens_and_truncate_prompt_tokens(servers):
    s = servers["plain"]
    with_bos, without = complete(s), complete(s, add_special_tokens=False)
    assert with_bos["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"] + 1
    assert chat(s, add_special_tokens=True)["usage"]["prompt_tokens"] == chat(s)["usage"]["prompt_tokens"] + 1
    n = without["usage"]["prompt_tokens"]
    cut = complete(s, truncate_prompt_tokens=5)
    assert cut["usage"]["prompt_tokens"] == 5
    tail = s.llm.tokenizer.encode(PROMPT)[-5:]
    assert text_of(cut) == text_of(complete(s, prompt=tail))  # the last 5 tokens, as a prompt of their own
    long_prompt = " ".join(["w40"] * 2000)  # beyond max_model_len: usable only truncated
    assert refused(s, "completions", prompt=long_prompt) == "prompt"
    assert complete(s, prompt=long_prompt, truncate_prompt_tokens=8)["usage"]["prompt_tokens"] == 8
    assert chat(s, truncate_prompt_tokens=4)["usage"]["prompt_tokens"] == 4
    assert refused(s, "completions", truncate_prompt_tokens=0) == "truncate_prompt_tokens"
    sp = pb.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, truncate_prompt_tokens=5)
    r = s.stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=sp))
    assert r.usage.prompt_tokens == 5 and r.text == text_of(cut)
    r = s.stub.Generate(pb.GenerateRequest(prompt=PROMPT, add_special_tokens=False,
                                           sampling_params=pb.SamplingParams(max_tokens=2)))  # fmt: skip
    assert r.usage.prompt_tokens == n


def test_prompt_logprobs(servers):
    s = servers["plain"]
    out = complete(s, prompt_logprobs=2)
    plps = out["choices"][0]["prompt_logprobs"]
    ids = s.llm.tokenizer.encode(PROMPT)
    assert len(plps) == len(ids) == out["usage"]["prompt_tokens"] and plps[0] is None
    for t, entry in zip(ids[1:], plps[1:]):
        assert str(t) in entry and 2 <= len(entry) <= 3
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and entry[str(t)]["rank"] >= 1
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in entry.values())
    c = chat(s, prompt_logprobs=0)
    assert len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"] and c["prompt_logprobs"][0] is None
    assert refused(s, "completions", prompt_logprobs=1, stream=True) == "prompt_logprobs"
    assert refused(s, "chat/completions", prompt_logprobs=21) == "prompt_logprobs"


def test_beam_search_is_refused_and_guided_decoding_backends_are_known(servers):
    s = servers["plain"]
    for path in ("completions", "chat/completions"):
        assert refused(s, path, use_beam_search=True) == "use_beam_search"
        assert refused(s, path, guided_decoding_backend="nonsense") == "guided_decoding_backend"
    assert complete(s, use_beam_search=False, guided_decoding_backend="xgrammar")["choices"]


# --------------------------------------------------------------------------- the default output length


@pytest.mark.parametrize("method", [None, "ngram"])
def test_the_default_max_tokens_fits_the_kv_cache(bos_model, method):
    """engine.num_kv_blocks small (64 tokens): a request without max_tokens gets what the
    cache holds beside its drafts (K, or Predicted Outputs' drafts without a method), never
    a 400 about max_tokens; a prompt that leaves no room is refused naming the prompt."""
    s = RealServed(tiny_config(bos_model, method, k=4, num_blocks=16, block_size=4), default_max_tokens=None)
    try:
        room = 16 * 4 - s.llm.num_spec_tokens
        body = {"model": "tiny", "messages": CHAT, "temperature": 0, "ignore_eos": True}
        status, out = http_call(f"{s.http}/v1/chat/completions", body)
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == room - out["usage"]["prompt_tokens"]
        prediction = {"prediction": {"type": "content", "content": "w20 w21 w20 w21"}}
        status, out = http_call(f"{s.http}/v1/chat/completions", {**body, **prediction})
        assert status == 200, out
        r = s.stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling_params=pb.SamplingParams(temperature=0)))
        assert r.finish_reason == pb.FINISH_REASON_LENGTH and r.usage.completion_tokens == room - r.usage.prompt_tokens
        long_chat = [{"role": "user", "content": " ".join(["w9"] * 70)}]
        status, out = http_call(f"{s.http}/v1/chat/completions", {**body, "messages": long_chat})
        assert status == 400 and out["error"]["param"] == "messages", out
        with pytest.raises(grpc.RpcError) as err:
            s.stub.Generate(pb.GenerateRequest(prompt=" ".join(["w9"] * 70)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("prompt")
        assert wait_for(s.kv_free)
    finally:
        s.close()


# --------------------------------------------------------------------------- the offline API


def test_the_offline_api_takes_the_same_fields(bos_model):
    llm = LLM(model=str(bos_model), dtype="float32", num_kv_blocks=128, block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    plain = LLM(model=str(bos_model), dtype="float32", num_kv_blocks=128, block_size=4)

    def run(engine, **kw):
        return engine.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw),
                               use_tqdm=False)[0]  # fmt: skip

    whole = run(plain).outputs[0].text
    stop = " ".join(whole.split()[3:5])
    for kw in ({}, {"stop": [stop], "include_stop_str_in_output": True}, {"bad_words": [whole.split()[0]]},
               {"allowed_token_ids": SPECIAL, "skip_special_tokens": False, "spaces_between_special_tokens": False},
               {"truncate_prompt_tokens": 5}, {"prompt_logprobs": 1}):  # fmt: skip
        a, b = run(plain, **kw), run(llm, **kw)
        assert a.outputs[0].text == b.outputs[0].text and a.outputs[0].token_ids == b.outputs[0].token_ids, kw
    assert run(llm, stop=[stop], include_stop_str_in_output=True).outputs[0].text.endswith(stop)
    assert set(run(llm, allowed_token_ids=SPECIAL, skip_special_tokens=False).outputs[0].text.split()) <= {"<s>", "</s>"}
    assert len(run(llm, truncate_prompt_tokens=5).prompt_token_ids) == 5
    lps = run(llm, prompt_logprobs=1).prompt_logprobs
    assert lps[0] is None and all(e is not None and min(v.rank for v in e.values()) == 1 for e in lps[1:])
    n = len(run(plain).prompt_token_ids)
    assert len(plain.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False,
                              add_special_tokens=False)[0].prompt_token_ids) == n - 1  # fmt: skip
    assert json.dumps(whole)


def test_prompt_token_ids_out_of_range_name_the_field_the_client_sent(servers):
    """[-1] and [vocabulary size] were named differently (prompt / prompt_token_ids)."""
    s = servers["plain"]
    for bad in ([-1], [512], [3, 10**9]):
        assert refused(s, "completions", prompt=bad) == "prompt"
        assert refused(s, "completions", prompt=[[5, 6], bad]) == "prompt[1]"
        with pytest.raises(grpc.RpcError) as err:
            s.stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[max(t, 0) for t in bad] + [512])))
        assert err.value.details().startswith("prompt_token_ids")
