"""End-to-end losslessness and resource release of the speculative engine (tiny models, float32)."""

from __future__ import annotations

import pytest

from engine_utils import draw_k_every_step, greedy, random_prompts, run, tiny_config
from specserve.engine.engine import LLMEngine
from specserve.request import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(10, seed=3)


@pytest.fixture(scope="module")
def vanilla_outputs(tiny_llama, prompts):
    eng = LLMEngine(tiny_config(tiny_llama))
    return run(eng, prompts, [greedy(24) for _ in prompts])


@pytest.mark.parametrize("k", [1, 3, 6])
def test_ngram_greedy_equals_plain_decoding(tiny_llama, prompts, vanilla_outputs, k):
    eng = LLMEngine(tiny_config(tiny_llama, "ngram", k=k))
    outs = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == vanilla_outputs
    drafts = sum(o.spec.num_draft_tokens for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert drafts > 0 and 0 < accepted < drafts  # both acceptance and rejection were exercised
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_draft_model_greedy_equals_plain_decoding(tiny_llama, tiny_draft, prompts, vanilla_outputs):
    eng = LLMEngine(tiny_config(tiny_llama, "draft_model", k=4, draft_dir=tiny_draft))
    outs = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == vanilla_outputs
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.proposer.blocks.num_free == eng.proposer.blocks.num_blocks


def test_draft_model_that_is_the_target_accepts_everything(tiny_llama, prompts, vanilla_outputs):
    k = 4
    eng = LLMEngine(tiny_config(tiny_llama, "draft_model", k=k, draft_dir=tiny_llama))
    outs = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == vanilla_outputs
    drafts = sum(o.spec.num_drafts for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    draft_tokens = sum(o.spec.num_draft_tokens for o in outs)
    assert accepted == draft_tokens  # a self-draft is always right in float32
    assert 1 + accepted / drafts == k + 1


@pytest.mark.parametrize("method,k", [("ngram", 3), ("draft_model", 4)])
def test_drafts_per_step_changing_every_step_is_lossless(tiny_llama, prompts, vanilla_outputs, method, k):
    """Adaptive speculation (the default with a method) changes K between steps, down to 0
    (speculation off) and back: a proposer must pick up where it left, e.g. a draft
    model's KV cache catching up on the tokens it did not draft for.  Here K is drawn at
    random every step.  The draft model is the target itself, so every draft is right
    exactly when its KV cache caught up correctly."""
    eng = LLMEngine(tiny_config(tiny_llama, method, k=k, draft_dir=tiny_llama, speculation="auto"))
    assert eng.spec_control.adaptive  # auto = adaptive with a method, on the CPU too
    picked = draw_k_every_step(eng, k, seed=7)
    outs = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == vanilla_outputs
    assert set(picked) == set(range(k + 1))
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    drafted = sum(o.spec.num_draft_tokens for o in outs)
    assert 0 < accepted <= drafted
    if method == "draft_model":
        assert accepted == drafted
    assert eng.blocks.num_free == eng.blocks.num_blocks
    blocks = getattr(eng.proposer, "blocks", None)
    if blocks is not None:
        assert blocks.num_free == blocks.num_blocks


def test_preemption_under_kv_pressure_is_lossless(tiny_llama, prompts, vanilla_outputs):
    """A cache too small for all requests at once: requests wait or are preempted and
    recomputed; outputs are unchanged and every block comes back."""
    eng = LLMEngine(tiny_config(tiny_llama, "ngram", k=3, num_blocks=24, block_size=4))
    outs = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == vanilla_outputs
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_chunked_prefill_is_lossless(tiny_llama, prompts, vanilla_outputs):
    cfg = tiny_config(tiny_llama, "ngram", k=3)
    cfg.engine.max_num_batched_tokens = 8  # prompts are split into chunks
    outs = run(LLMEngine(cfg), prompts, [greedy(24) for _ in prompts])
    assert outs == vanilla_outputs


def test_mixed_requests_cancellations_leave_no_block_behind(tiny_llama):
    eng = LLMEngine(tiny_config(tiny_llama, "ngram", k=3, num_blocks=64))
    prompts = random_prompts(30, seed=11)
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.9, max_tokens=5 + i % 17, seed=i)
        eng.add_request(f"r{i}", p, params)
    steps = 0
    finished = set()
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finished.add(out.request_id)
        steps += 1
        if steps % 3 == 0:  # cancel a few requests mid-flight, including waiting ones
            for rid in list(eng.requests)[:2]:
                out = eng.abort_request(rid)
                assert out.finished and out.finish_reason is FinishReason.ABORT
                finished.add(rid)
        assert eng.blocks.num_free + sum(len(s.seq.block_table) for s in eng.requests.values()) == eng.blocks.num_blocks
    assert finished == {f"r{i}" for i in range(30)}
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert not eng.scheduler.running and not eng.scheduler.waiting


def test_seeded_sampling_is_reproducible(tiny_llama, prompts):
    def sample(seed):
        eng = LLMEngine(tiny_config(tiny_llama, "ngram", k=3))
        return run(eng, prompts[:4], [SamplingParams(temperature=1.0, top_k=50, max_tokens=20, seed=seed,
                                                     ignore_eos=True) for _ in range(4)])

    a, b, c = sample(5), sample(5), sample(6)
    assert a == b
    assert a != c


def test_seeded_output_does_not_depend_on_batch_neighbours(tiny_llama, prompts):
    params = SamplingParams(temperature=0.8, max_tokens=16, seed=42, ignore_eos=True)
    alone = run(LLMEngine(tiny_config(tiny_llama, "ngram")), [prompts[0]], [params])[0]
    eng = LLMEngine(tiny_config(tiny_llama, "ngram"))
    others = [SamplingParams(temperature=0.8, max_tokens=16, seed=i, ignore_eos=True) for i in range(3)]
    batched = run(eng, [prompts[0]] + prompts[1:4], [params] + others)[0]
    assert alone == batched


def test_stop_token_ids_max_tokens_and_eos(tiny_llama, prompts, vanilla_outputs):
    ref = vanilla_outputs[0]
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    eng = LLMEngine(tiny_config(tiny_llama, "ngram"))
    out = eng.generate([prompts[0]], [greedy(24, stop_token_ids=[stop_tok])])[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason is FinishReason.STOP
    out = eng.generate([prompts[0]], [greedy(7)])[0]
    assert out.token_ids == ref[:7] and out.finish_reason is FinishReason.LENGTH
    # EOS (id 2 in the tiny tokenizer) stops unless ignore_eos.
    eos_params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[], ignore_eos=False)
    out = eng.generate([prompts[0]], [eos_params])[0]
    if 2 in ref:
        assert out.token_ids == ref[: ref.index(2) + 1] and out.finish_reason is FinishReason.STOP
    else:
        assert out.token_ids == ref


def test_stop_string_cuts_text_and_finishes(tiny_llama, prompts, vanilla_outputs):
    eng = LLMEngine(tiny_config(tiny_llama, "ngram"))
    full = eng.generate([prompts[1]], [greedy(24)])[0].text
    words = full.split()
    stop = " ".join(words[3:5])
    out = eng.generate([prompts[1]], [greedy(24, stop=[stop])])[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == full[: full.index(stop)]
    assert stop not in out.text


def test_max_model_len_finishes_with_length(tiny_llama):
    cfg = tiny_config(tiny_llama, "ngram", k=5)
    cfg.model.max_model_len = 32
    eng = LLMEngine(cfg)
    prompt = list(range(10, 30))
    out = eng.generate([prompt], [greedy(12)])[0]
    assert out.finish_reason is FinishReason.LENGTH and len(prompt) + len(out.token_ids) == 32
