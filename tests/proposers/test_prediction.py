"""Predicted Outputs: the prediction index (alignment, re-synchronisation after
insertions, deletions and replacements), and the engine with predictions alone and
composed with a method: greedy output equal to plain decoding, OpenAI's
accepted/rejected counts, KV blocks freed, the sampled distribution unchanged."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from engine_utils import greedy, plain_outputs, random_prompts, tiny_config, total_variation
from engine_utils import one_thread  # noqa: F401 (an autouse fixture: one torch thread)

from specserve.config import ConfigError, validate_config
from specserve.engine.engine import LLMEngine
from specserve.errors import InvalidRequestError
from specserve.proposers.prediction import PredictionIndex
from specserve.request import SamplingParams

MAX_TOKENS = 40

# ------------------------------------------------------------------ the index


def _follow(pred: list[int], output: list[int], k: int = 4, prompt: list[int] = (900, 901)) -> list[list[int]]:
    """Feed `output` one token at a time (as if every draft were rejected); the drafts at each step."""
    idx = PredictionIndex(pred, len(prompt))
    ctx = list(prompt)
    drafts = []
    for t in output:
        idx.update(ctx)
        drafts.append(idx.draft(k))
        ctx.append(t)
    return drafts


def test_drafts_follow_the_prediction_from_the_start():
    pred = list(range(10, 30))
    drafts = _follow(pred, pred[:6])
    assert drafts[0] == [10, 11, 12, 13]
    assert drafts[5] == [15, 16, 17, 18]


def test_catch_up_over_several_tokens_at_once():
    pred = list(range(10, 30))
    idx = PredictionIndex(pred, 2)
    idx.update([900, 901] + pred[:7])  # seven tokens accepted in one step
    assert idx.draft(3) == [17, 18, 19]
    assert idx.draft(100) == pred[7:]


def test_resync_after_an_insertion():
    pred = list(range(10, 40))
    output = pred[:5] + [500, 501, 502] + pred[5:12]
    drafts = _follow(pred, output)
    # While the model writes 500..502 nothing from the prediction fits ...
    assert drafts[6] == drafts[7] == drafts[8] == []
    # ... and once it resumes at pred[5] the drafts continue from there, one token on
    # the evidence of one, more as the output keeps following the prediction.
    assert drafts[9:13] == [[16], [17, 18], [18, 19, 20], [19, 20, 21, 22]]


def test_resync_after_a_deletion_and_a_replacement():
    pred = list(range(10, 40))
    deleted = pred[:5] + pred[9:15]  # 15..18 dropped
    drafts = _follow(pred, deleted)
    assert drafts[6:9] == [[20], [21, 22], [22, 23, 24]]  # the first token after the gap re-synchronises
    replaced = pred[:5] + [600] + pred[6:12]
    drafts = _follow(pred, replaced)
    assert drafts[6] == []  # right after the replacement: nothing matches
    assert drafts[7:9] == [[17], [18, 19]]  # the next token resumes the prediction


def test_far_matches_need_two_tokens_and_prefer_the_nearest_ahead():
    pred = [5, 6, 7] + list(range(100, 140)) + [5, 6, 8] + list(range(200, 220)) + [5, 6, 9]
    idx = PredictionIndex(pred, 0)
    idx.update([1, 2, 3])  # lost at the start; cursor hint stays at 0
    assert not idx.aligned
    idx.update([1, 2, 3, 130])  # one token, far from the cursor: not enough
    assert idx.draft(2) == []
    idx.update([1, 2, 3, 130, 5, 6])  # "5 6" occurs three times: the nearest ahead of the cursor wins
    assert idx.draft(1) == [7]
    idx.cursor, idx.synced = 50, None
    idx.update([1, 2, 3, 5, 6])
    assert idx.draft(1) == [9]  # nearest ahead of 50 is the last occurrence
    idx.cursor, idx.synced = 0, None
    idx.update([1, 2, 3, 105, 106])  # a longer match beats a nearer one
    assert idx.draft(4) == [107, 108]  # two tokens of evidence: two drafts


def test_exhausted_prediction_drafts_nothing():
    pred = [10, 11, 12]
    idx = PredictionIndex(pred, 1)
    idx.update([0, 10, 11, 12])
    assert idx.draft(4) == []


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, seed=5)


@pytest.fixture(scope="module")
def vanilla(tiny_llama, prompts):
    return plain_outputs(tiny_llama, prompts, MAX_TOKENS)  # really plain: no Predicted Outputs drafts either


def _perturb(tokens: list[int], rng: random.Random, edits: int = 3) -> list[int]:
    t = list(tokens)
    for _ in range(edits):
        op, i = rng.choice("isd"), rng.randrange(len(t))
        if op == "i":
            t[i:i] = [rng.randrange(5, 500) for _ in range(rng.randint(1, 4))]
        elif op == "s":
            t[i] = rng.randrange(5, 500)
        else:
            del t[i : i + rng.randint(1, 4)]
    return t


def _params(pred, **kw) -> SamplingParams:
    return greedy(MAX_TOKENS, prediction_token_ids=pred, **kw)


def _check(eng, outs, vanilla):
    assert [o.token_ids for o in outs] == vanilla
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert not eng.predictions.indexes


def test_exact_prediction_is_all_accepted(tiny_llama, prompts, vanilla):
    eng = LLMEngine(tiny_config(tiny_llama))
    outs = eng.generate(prompts, [_params(v) for v in vanilla])
    _check(eng, outs, vanilla)
    for o in outs:
        s = o.spec
        assert s.num_rejected_prediction_tokens == 0
        # Everything after the first token (the prefill's) came from the prediction.
        assert s.num_accepted_prediction_tokens >= MAX_TOKENS - 1 - s.num_drafts
        assert s.mean_acceptance_length > 5


@pytest.mark.parametrize("method", [None, "ngram", "suffix"])
def test_edited_predictions_are_lossless(tiny_llama, prompts, vanilla, method):
    rng = random.Random(1)
    preds = [_perturb(v, rng) for v in vanilla]
    eng = LLMEngine(tiny_config(tiny_llama, method, k=3))
    outs = eng.generate(prompts, [_params(p) for p in preds])
    _check(eng, outs, vanilla)
    acc = sum(o.spec.num_accepted_prediction_tokens for o in outs)
    rej = sum(o.spec.num_rejected_prediction_tokens for o in outs)
    assert acc > 4 * len(prompts) and rej > 0
    for o in outs:
        assert o.spec.num_accepted_prediction_tokens <= len(o.token_ids)
        assert o.spec.num_accepted_prediction_tokens <= o.spec.num_accepted_tokens


def test_composes_with_a_draft_model(tiny_llama, tiny_draft, prompts, vanilla):
    """Half the requests carry a prediction; the draft model drafts for the others and
    for any step a prediction has nothing; its cache stays consistent and is freed."""
    rng = random.Random(2)
    eng = LLMEngine(tiny_config(tiny_llama, "draft_model", k=3, draft_dir=tiny_draft))
    params = [_params(_perturb(v, rng) if i % 2 else None) for i, v in enumerate(vanilla[:4])]
    outs = eng.generate(prompts[:4], params)
    _check(eng, outs, vanilla[:4])
    assert eng.proposer.blocks.num_free == eng.proposer.blocks.num_blocks
    assert all(o.spec.num_accepted_prediction_tokens == 0 for o in outs[::2])
    assert all(o.spec.num_accepted_prediction_tokens > 0 for o in outs[1::2])


def test_preemption_and_chunked_prefill(tiny_llama, prompts, vanilla):
    cfg = tiny_config(tiny_llama, num_blocks=28, block_size=4)
    cfg.engine.max_num_batched_tokens = 16
    eng = LLMEngine(cfg)
    outs = eng.generate(prompts, [_params(v) for v in vanilla])
    _check(eng, outs, vanilla)


def test_stop_token_inside_the_prediction_counts_only_kept_tokens(tiny_llama, prompts, vanilla):
    ref = vanilla[0]
    stop = ref[12]
    cut = ref.index(stop) + 1
    eng = LLMEngine(tiny_config(tiny_llama))
    out = eng.generate([prompts[0]], [_params(ref, stop_token_ids=[stop])])[0]
    assert out.token_ids == ref[:cut]
    assert out.spec.num_accepted_prediction_tokens <= cut - 1


def test_num_prediction_tokens_zero_ignores_predictions(tiny_llama, prompts, vanilla):
    cfg = tiny_config(tiny_llama)
    cfg.engine.num_prediction_tokens = 0
    eng = LLMEngine(cfg)
    outs = eng.generate(prompts[:2], [_params(v) for v in vanilla[:2]])
    assert [o.token_ids for o in outs] == vanilla[:2]
    assert all(o.spec.num_drafts == 0 for o in outs)
    assert eng.num_spec_tokens == 0


def test_bad_predictions_and_config_are_one_line(tiny_llama, prompts):
    eng = LLMEngine(tiny_config(tiny_llama))
    with pytest.raises(InvalidRequestError, match="prediction: every token id must be < the vocabulary"):
        eng.add_request("x", prompts[0], _params([1, 2, 100000]))
    with pytest.raises(InvalidRequestError, match="prediction: must be a list"):
        eng.add_request("y", prompts[0], _params([1, -2]))
    with pytest.raises(InvalidRequestError, match="prediction: is 600 tokens, longer than"):
        eng.add_request("z", prompts[0], _params([5] * 600))
    cfg = tiny_config(tiny_llama)
    cfg.engine.num_prediction_tokens = -1
    with pytest.raises(ConfigError, match="engine.num_prediction_tokens"):
        validate_config(cfg)


def test_sampled_output_distribution_is_unchanged(tiny_llama):
    """The prediction is a deterministic draft: strict verification keeps the target's
    distribution.  Empirical distribution of output tokens 2..4 (where drafts are
    verified) with and without a prediction (the most common sampled output), 600
    seeded requests each; always accepting the prediction would move them by ~0.5."""
    prompt = [11, 12, 13, 14]
    n = 600

    def sample(pred):
        cfg = tiny_config(tiny_llama, num_blocks=2048, block_size=4)
        cfg.engine.max_num_seqs = 200
        eng = LLMEngine(cfg)
        ps = [SamplingParams(temperature=0.05, max_tokens=4, seed=1000 + i, ignore_eos=True,
                             prediction_token_ids=pred) for i in range(n)]
        outs = eng.generate([prompt] * n, ps)
        return outs

    base = sample(None)
    common = Counter(tuple(o.token_ids) for o in base).most_common(1)[0][0]
    with_pred = sample(list(common))
    assert sum(o.spec.num_accepted_prediction_tokens for o in with_pred) > n // 4  # drafts did get accepted
    for pos in (1, 2, 3):
        tv = total_variation(base, with_pred, pos)
        assert tv < 0.12, (pos, tv)


@pytest.mark.parametrize("method", ["strict", "probabilistic", "synthetic"])
def test_draftless_step_samples_what_the_full_step_would(method):
    """The engine's K is 8 without a method (predictions); a step in which no request
    has drafts is verified at position 0 only and must emit the same tokens."""
    import torch

    from specserve.sampling.sampler import DeviceSampler, RequestTensors, verify_step

    B, K, V = 6, 8, 97
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, V, generator=g) * 3
    rate = 0.5 if method == "synthetic" else None
    sampler = DeviceSampler(8, K, "cpu", method=method, synthetic_acceptance_rate=rate, vocab_size=V)
    temps, top_ks, top_ps, min_ps = [0.0, 0.7, 1.0, 1.3, 0.9, 0.5], [0, 5, 0, 0, 20, 0], [1, 1, .9, 1, .8, 1], [0] * 6
    seeds, offsets = [11, 12, 13, 14, 15, 16], [0, 17, 34, 5, 9, 100]
    inputs = sampler.prepare(list(range(B)), [[] for _ in range(B)], temps, top_ks, top_ps, min_ps, seeds, offsets)
    assert inputs.row_index.shape == (B, 1) and inputs.draft_ids.shape == (B, 0)
    fast = sampler.fetch(sampler.sample(logits, inputs), B)
    full = verify_step(
        logits, torch.arange(B)[:, None].expand(B, K + 1).contiguous(), torch.full((B, K), -1), torch.zeros(B, dtype=torch.long),
        RequestTensors.build(temps, top_ks, top_ps, min_ps, seeds, offsets), method=method, synthetic_acceptance_rate=rate,
    )
    assert fast == [(row[: row[-1] + 1], row[-1]) for row in full.tolist()]


@pytest.mark.slow
def test_embedded_smollm2_code_edit_is_lossless_and_mostly_predicted():
    """The real embedded model in float32, a small code edit with the original as the
    prediction: the same output as without it, most of it from the prediction."""
    import torch

    from specserve.config import Config, ModelConfig
    from specserve.executor.loader import load_model

    target = load_model("embedded:smollm2-135m-instruct", "float32", torch.device("cpu"))
    cfg = validate_config(Config(model=ModelConfig(dtype="float32")))
    cfg.engine.num_kv_blocks = 64
    eng = LLMEngine(cfg, target=target)
    tok = eng.tokenizer
    code = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
            "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n")
    ids = tok.apply_chat_template([{"role": "user", "content": f"```python\n{code}```\n\nRename `items` to `data`."}])
    plain = eng.generate([ids], [SamplingParams(temperature=0.0, max_tokens=80)])[0]
    pred = eng.generate([ids], [SamplingParams(temperature=0.0, max_tokens=80,
                                               prediction_token_ids=tok.encode(code, add_special_tokens=False))])[0]
    assert pred.token_ids == plain.token_ids
    assert pred.spec.num_accepted_prediction_tokens > len(pred.token_ids) // 3


def test_prediction_rows_of_a_method_with_draft_distributions_are_one_hot():
    """Composed with a method that returns q, a request drafting from its prediction
    gets one-hot rows, widened when its prediction drafts more than the method did."""
    import torch

    from specserve.proposers.prediction import one_hot_rows

    probs = torch.full((3, 2, 5), 0.2)
    out = one_hot_rows(probs, [[1, 2], [4, 0, 3], [2]], [False, True, False])
    assert out.shape == (3, 3, 5)
    assert torch.equal(out[0, :2], probs[0]) and torch.equal(out[2, :2], probs[2])
    assert torch.equal(out[1], torch.eye(5)[[4, 0, 3]])
    assert torch.equal(probs, torch.full((3, 2, 5), 0.2))  # the method's tensor is left alone
