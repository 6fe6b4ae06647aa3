"""Logits controls at every verified position (penalties, logit_bias, min_tokens, grammar
masks) and log-probabilities: the vectorised plan against a per-row reference, and the
engine with speculation against the engine without it (tiny models, float32)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from engine_utils import random_prompts, tiny_config  # noqa: E402
from tiny_byte_model import make_byte_model  # noqa: E402

from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.request import SamplingParams, StructuredOutputsParams  # noqa: E402
from specserve.sampling.logits_controls import (  # noqa: E402
    LogitsPlan,
    RequestControls,
    logprob_columns,
    unpack_bitmask,
    unpack_logprobs,
)

pytestmark = pytest.mark.timeout(300)


# --------------------------------------------------------------------------- the plan vs a per-row loop


def _reference_row(x: torch.Tensor, c: RequestControls, j: int) -> torch.Tensor:
    """Row j of request c processed one token at a time, as plain decoding would."""
    x = x.clone()
    out = list(c.output_ids) + list(c.drafts[:j])
    if c.repetition_penalty != 1.0:
        for t in set(out) | set(c.prompt_ids):
            x[t] = x[t] / c.repetition_penalty if x[t] > 0 else x[t] * c.repetition_penalty
    for t in set(out):
        x[t] -= c.frequency_penalty * out.count(t) + c.presence_penalty
    for t, b in (c.logit_bias or {}).items():
        x[t] += b
    if c.num_output_tokens + j < c.min_tokens:
        for t in c.banned_until_min:
            x[t] = float("-inf")
    if c.bitmask is not None:
        allowed = unpack_bitmask(torch.from_numpy(c.bitmask[j : j + 1]), x.shape[0])[0]
        x[~allowed] = float("-inf")
    return x


def test_plan_matches_per_row_reference():
    g = torch.Generator().manual_seed(0)
    V, N = 70, 12
    logits = torch.randn(N, V, generator=g) * 3
    rng = np.random.default_rng(1)
    bitmask = rng.integers(-(2**31), 2**31 - 1, size=(3, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    reqs = [
        RequestControls(row_start=0, num_rows=3, drafts=[5, 5], output_ids=[5, 9, 9, 3], prompt_ids=[1, 2, 9],
                        presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.7),
        RequestControls(row_start=4, num_rows=1, drafts=[], logit_bias={3: 7.0, 60: -100.0}),
        RequestControls(row_start=5, num_rows=3, drafts=[2, 8], output_ids=[2], min_tokens=3, num_output_tokens=1,
                        banned_until_min=[2, 4], repetition_penalty=0.6, bitmask=bitmask),
        RequestControls(row_start=9, num_rows=2, drafts=[11], frequency_penalty=-1.0, logit_bias={11: 2.5}),
    ]  # fmt: skip
    plan = LogitsPlan(V)
    for c in reqs:
        plan.add(c)
    got = plan.apply(logits)
    want = logits.clone()
    for c in reqs:
        for j in range(c.num_rows):
            want[c.row_start + j] = _reference_row(logits[c.row_start + j], c, j)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got.nan_to_num(neginf=0), want.nan_to_num(neginf=0), rtol=0, atol=1e-5)
    assert torch.equal(got[3], logits[3]) and torch.equal(got[4 + 7], logits[4 + 7])  # untouched rows


def test_logprob_columns_roundtrip():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 40, generator=g)
    row_index = torch.tensor([[0, 1, 2], [3, 4, 4]])
    tokens = torch.tensor([[7, 8, -1], [9, -1, -1]])
    cols = logprob_columns(logits, row_index, tokens, 4).numpy()
    lp = torch.log_softmax(logits, -1)
    for b in range(2):
        chosen, top_v, top_i = unpack_logprobs(cols[b], 3, 4)
        for j in range(3):
            r = row_index[b, j]
            assert chosen[j] == pytest.approx(lp[r, max(int(tokens[b, j]), 0)].item(), abs=1e-6)
            v, i = lp[r].topk(4)
            assert list(top_i[j]) == i.tolist()
            np.testing.assert_allclose(top_v[j], v.numpy(), atol=1e-6)


# --------------------------------------------------------------------------- engine: speculation changes nothing


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return LLMEngine(tiny_config(tiny_llama)), LLMEngine(tiny_config(tiny_llama, "ngram", k=4))


CONTROLS = [
    dict(presence_penalty=0.3, frequency_penalty=0.2),
    dict(repetition_penalty=1.3),
    dict(logit_bias={7: 4.0, 9: -100.0, 30: 2.0}),
    dict(min_tokens=12, ignore_eos=False, stop_token_ids=[40]),
    dict(frequency_penalty=-0.5, logit_bias={12: 1.5}, logprobs=5),
]


@pytest.mark.parametrize("controls", CONTROLS, ids=lambda c: ",".join(c))
def test_greedy_with_controls_equals_plain_decoding(engines, controls):
    plain, spec = engines
    prompts = random_prompts(6, seed=5)
    kw = dict(temperature=0.0, max_tokens=20, ignore_eos=True) | controls
    a = plain.generate(prompts, [SamplingParams(**kw) for _ in prompts])
    b = spec.generate(prompts, [SamplingParams(**kw) for _ in prompts])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(o.spec.num_draft_tokens for o in b) > 0
    if "logit_bias" in controls:
        assert all(9 not in o.token_ids for o in a)
    if "min_tokens" in controls:
        assert all(len(o.token_ids) >= 12 or o.finish_reason.value == "length" for o in a)
    if "logprobs" in controls:
        for x, y in zip(a, b):
            assert len(x.logprobs) == len(x.token_ids) == len(y.logprobs)
            for p, q in zip(x.logprobs, y.logprobs):
                assert p.token_id == q.token_id and abs(p.logprob - q.logprob) < 1e-5
                assert [t for t, _ in p.top] == [t for t, _ in q.top] and len(p.top) == 5


def test_penalties_act_at_accepted_draft_positions(engines):
    """A self-draft makes every position a draft position: acceptance must still stop where
    a penalty (counting earlier drafts) changes the argmax, so outputs stay equal."""
    plain, _ = engines
    spec = LLMEngine(tiny_config(plain.cfg.model.path, "draft_model", k=4, draft_dir=plain.cfg.model.path))
    prompts = random_prompts(4, seed=9)
    kw = dict(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=0.4, repetition_penalty=1.1)
    a = plain.generate(prompts, [SamplingParams(**kw) for _ in prompts])
    b = spec.generate(prompts, [SamplingParams(**kw) for _ in prompts])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    acc = sum(o.spec.num_accepted_tokens for o in b)
    assert 0 < acc < sum(o.spec.num_draft_tokens for o in b)


def test_logprobs_with_sampling_are_the_same_distribution(engines):
    plain, spec = engines
    prompts = random_prompts(3, seed=4)
    kw = dict(temperature=0.9, top_k=20, max_tokens=16, ignore_eos=True, logprobs=2, seed=11)
    a = plain.generate(prompts, [SamplingParams(**kw) for _ in prompts])
    for o in a:
        assert all(lp.logprob <= 0 and len(lp.top) == 2 for lp in o.logprobs)
    b = spec.generate(prompts, [SamplingParams(**kw) for _ in prompts])
    for o in b:  # the emitted token's logprob is the one its row gives it (no temperature)
        assert len(o.logprobs) == len(o.token_ids)


def test_prompt_logprobs(engines):
    plain, spec = engines
    prompt = random_prompts(1, seed=8, lo=20, hi=21)[0]
    kw = dict(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)

    def run(eng, chunk):
        eng.scheduler.max_num_batched_tokens = chunk  # chunked prefill must not matter
        eng.add_request("p", prompt, SamplingParams(**kw))
        got = []
        while eng.has_unfinished():
            got += [o.prompt_logprobs for o in eng.step() if o.prompt_logprobs is not None]
        eng.scheduler.max_num_batched_tokens = eng.cfg.engine.max_num_batched_tokens
        assert len(got) == 1  # once, on the first output that carries tokens
        return got[0]

    a, b = run(plain, 2048), run(spec, 7)
    assert len(a) == len(prompt) and a[0] is None and b[0] is None
    for i, (p, q) in enumerate(zip(a[1:], b[1:]), 1):
        assert p.token_id == q.token_id == prompt[i] and abs(p.logprob - q.logprob) < 1e-5 and len(p.top) == 2


# --------------------------------------------------------------------------- grammars (llguidance)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def byte_engines(tmp_path_factory):
    d = make_byte_model(tmp_path_factory.mktemp("byte") / "m")
    return LLMEngine(tiny_config(d)), LLMEngine(tiny_config(d, "ngram", k=4))


@pytest.mark.parametrize("so", [
    StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"[a-z]{3,6}-[0-9]{2}"), StructuredOutputsParams(choice=["yes", "no", "maybe"]),
], ids=lambda so: so.kind())  # fmt: skip
def test_grammar_greedy_equals_constrained_plain_decoding(byte_engines, so):
    plain, spec = byte_engines
    tok = plain.tokenizer
    prompts = [tok.encode(t) for t in ("Give me JSON: ", '{"name": "x"} again {"name": "x"}', "hello")]
    kw = dict(temperature=0.0, max_tokens=60, structured_outputs=so)
    a = plain.generate(prompts, [SamplingParams(**kw) for _ in prompts])
    b = spec.generate(prompts, [SamplingParams(**kw) for _ in prompts])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for o in a:
        if so.kind() == "json":
            jsonschema.validate(json.loads(o.text), SCHEMA)
        elif so.kind() == "choice":
            assert o.text in so.choice
        elif so.kind() == "regex":
            assert o.finish_reason.value == "stop" and "-" in o.text


def test_bad_grammar_is_invalid_request(byte_engines):
    from specserve.errors import InvalidRequestError

    plain, _ = byte_engines
    with pytest.raises(InvalidRequestError):
        plain.add_request("bad", [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    assert not plain.requests
