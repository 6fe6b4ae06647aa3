"""+method=ctc: the relaxed rule against a reference implementation of the paper's rule on
constructed CTC posteriors; exact mode's output equal to plain decoding (greedy, any batch,
beside text requests, any hypothesis edits, any drafts per step); relaxed mode's stages
(entropy gate: no LLM forward; one-pass acceptance; resume / restart fallbacks); KV released."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.audio import AudioClip
from specserve.audio.features import num_audio_tokens
from specserve.audio.prompt import transcription_prompt
from specserve.config import Config, ModelConfig, validate_config
from specserve.engine.engine import LLMEngine
from specserve.errors import ConfigError
from specserve.executor.loader import load_model
from specserve.executor.models.granite_speech import ctc_greedy_labels, ctc_max_entropy, ctc_text
from specserve.methods import method_options
from specserve.proposers.ctc import CtcHypothesis, confidence_accept, entropy_gate
from specserve.request import SamplingParams
from tests.engine_utils import draw_k_every_step, one_thread  # noqa: F401
from tests.tiny_models import SPEECH_AUDIO_TOKEN, make_tiny_speech_model

MAX_TOKENS = 16


# ------------------------------------------------------------------ the paper's rule, by reference
def reference_decision(log_post: np.ndarray, text: str, draft_probs: list[float] | None, entropy_threshold: float,
                       floor: float) -> str:
    """Written from the paper's description: 'entropy' when the largest per-frame entropy
    (natural log, all labels incl. blank) is at most the threshold and the CTC text is not
    empty; else 'accept' when every draft token's probability >= floor; else 'reject'."""
    p = np.exp(log_post.astype(np.float64))
    ent = [-sum(pi * math.log(pi) for pi in row if pi > 0) for row in p]
    if entropy_threshold > 0 and text.strip() and max(ent) <= entropy_threshold:
        return "entropy"
    if draft_probs and min(draft_probs) >= floor:
        return "accept"
    return "reject"


def _posteriors(rng: np.random.Generator, frames: int, labels: int, sharpness: float) -> np.ndarray:
    logits = rng.standard_normal((frames, labels)) * sharpness
    peak = rng.integers(0, labels, frames)
    logits[np.arange(frames), peak] += sharpness * 3
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


@pytest.mark.parametrize("seed", range(40))
def test_relaxed_decisions_equal_the_reference_rule(seed):
    rng = np.random.default_rng(seed)
    logp = _posteriors(rng, int(rng.integers(1, 60)), 40, float(rng.uniform(0.2, 4)))
    text = ctc_text(ctc_greedy_labels(torch.tensor(logp, dtype=torch.float32)))
    probs = list(rng.uniform(0, 1, int(rng.integers(0, 6)))) if rng.random() < 0.9 else []
    thr, floor = float(rng.choice([0.0, 0.3, 0.7, 1.5])), float(rng.choice([0.0, 0.2, 0.6]))
    want = reference_decision(logp, text, probs, thr, floor)
    ent = ctc_max_entropy(torch.tensor(logp, dtype=torch.float32))
    assert abs(ent - max(-(np.exp(r) * r).sum() for r in logp)) < 1e-4
    if entropy_gate(ent, text, thr):
        got = "entropy"
    else:
        got = "accept" if confidence_accept(probs, floor) else "reject"
    assert got == want


def test_greedy_ctc_path_merges_repeats_and_drops_blanks():
    frames = [0, 104, 104, 0, 104, 105, 0, 0, 32, 32, 97]  # blank h h blank h i blank blank ' ' ' ' a
    logp = torch.full((len(frames), 128), -20.0)
    logp[torch.arange(len(frames)), torch.tensor(frames)] = 0.0
    assert ctc_greedy_labels(logp) == [104, 104, 105, 32, 97]
    assert ctc_text(ctc_greedy_labels(logp)) == "hhi a"


# ------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    d = make_tiny_speech_model(tmp_path_factory.mktemp("ctc-speech"), "granite", seed=3)
    return d, load_model(str(d), "float32", torch.device("cpu"))


def _engine(speech, method: str | None = None, k: int = 8, **kw) -> LLMEngine:
    d, loaded = speech
    cfg = Config(model=ModelConfig(name="tiny-speech", path=str(d), dtype="float32"))
    cfg.engine.num_kv_blocks = 256
    cfg.engine.block_size = 4
    cfg.engine.speculation = "fixed"
    if method is not None:
        cfg.method = method_options(method, num_speculative_tokens=k, **kw)
    return LLMEngine(validate_config(cfg), target=loaded)


def _clip(seconds: float, seed: int) -> AudioClip:
    rng = np.random.default_rng(seed)
    return AudioClip((0.2 * rng.standard_normal(int(seconds * 16000))).astype(np.float32))


def _request(loaded, clip: AudioClip, **kw) -> tuple[list[int], SamplingParams]:
    ids = transcription_prompt(loaded.tokenizer, SPEECH_AUDIO_TOKEN, num_audio_tokens(len(clip.samples)))
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("ignore_eos", True)
    return ids, SamplingParams(audio=clip, **kw)


def _fixed_hypotheses(eng: LLMEngine, hyps: dict[int, list[int]]) -> None:
    """Replace the CTC path's text by chosen token hypotheses, per recording length (the
    tiny model's CTC head is random): what the drafts are is all that matters here."""
    ctc = eng.proposer

    def hypothesis(seq, logp):
        toks = hyps[len(seq.params.audio.samples)]
        return CtcHypothesis("", list(toks), 0.0, False)

    ctc.hypothesis = hypothesis


@pytest.fixture(scope="module")
def plain(speech):
    """Plain greedy outputs of a few recordings and text prompts (the reference)."""
    eng = _engine(speech)
    clips = [_clip(s, i) for i, s in enumerate((0.7, 1.6, 2.9, 1.1))]
    reqs = [_request(speech[1], c) for c in clips]
    texts = [[5 + i, 40 + i, 77, 9 + 2 * i] for i in range(3)]
    outs = eng.generate([r[0] for r in reqs] + texts,
                        [r[1] for r in reqs] + [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
                                                for _ in texts])
    assert eng.blocks.usage == 0
    return clips, reqs, texts, [o.token_ids for o in outs]


def _edit(tokens: list[int], rng: random.Random) -> list[int]:
    out = list(tokens)
    for _ in range(rng.randint(0, 3)):
        kind = rng.choice(["insert", "delete", "replace", "truncate"])
        i = rng.randrange(max(1, len(out)))
        if kind == "insert":
            out.insert(i, rng.randrange(5, 400))
        elif kind == "delete" and out:
            del out[i]
        elif kind == "replace" and out:
            out[i] = rng.randrange(5, 400)
        elif kind == "truncate":
            out = out[: i + 1]
    return out


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), k=st.sampled_from([3, 8, 32]), erratic=st.booleans())
def test_exact_equals_plain_decoding_in_any_batch(speech, plain, seed, k, erratic):
    clips, reqs, texts, want = plain
    rng = random.Random(seed)
    eng = _engine(speech, "ctc", k=k)
    hyps = {len(c.samples): _edit(want[i], rng) for i, c in enumerate(clips)}
    _fixed_hypotheses(eng, hyps)
    if erratic:
        draw_k_every_step(eng, k, seed)
    order = list(range(len(reqs) + len(texts)))
    rng.shuffle(order)
    prompts = [reqs[i][0] if i < len(reqs) else texts[i - len(reqs)] for i in order]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             audio=reqs[i][1].audio if i < len(reqs) else None) for i in order]
    outs = eng.generate(prompts, params)
    for i, o in zip(order, outs):
        assert o.token_ids == want[i]
        if i < len(reqs):
            assert o.spec.ctc_stage in ("verified", "decoded")
        else:
            assert o.spec.ctc_stage is None
    assert eng.blocks.usage == 0 and not eng.has_unfinished()


def test_exact_verifies_the_whole_hypothesis_in_the_prefill_forward(speech, plain):
    clips, reqs, _, want = plain
    eng = _engine(speech, "ctc", k=32)
    _fixed_hypotheses(eng, {len(c.samples): want[i][:-1] for i, c in enumerate(clips)})
    calls = []
    execute = eng.runner.execute
    eng.runner.execute = lambda batch, *a, **kw: (calls.append(batch.num_tokens), execute(batch, *a, **kw))[1]
    out = eng.generate([reqs[0][0]], [reqs[0][1]])[0]
    assert out.token_ids == want[0]
    # one forward: prompt + the whole hypothesis (MAX_TOKENS - 1 drafts), all accepted, and
    # the bonus token ends the request (max_tokens)
    assert len(calls) == 1 and calls[0] == len(reqs[0][0]) + MAX_TOKENS - 1
    assert out.spec.ctc_stage == "verified" and out.spec.num_accepted_tokens == MAX_TOKENS - 1


def test_relaxed_entropy_gate_answers_without_an_llm_forward(speech, plain):
    clips, reqs, _, want = plain
    eng = _engine(speech, "ctc", k=8, ctc_acceptance="relaxed", ctc_entropy_threshold=0.7)
    hyp = [11, 12, 13]
    eng.proposer.hypothesis = lambda seq, logp: CtcHypothesis("w6 w7 w8", hyp, 0.1, True)
    calls = []
    execute = eng.runner.execute
    eng.runner.execute = lambda batch, *a, **kw: (calls.append(1), execute(batch, *a, **kw))[1]
    ids, params = _request(speech[1], clips[1], ignore_eos=False)
    out = eng.generate([ids], [params])[0]
    assert calls == [] and out.spec.ctc_stage == "entropy"
    assert out.token_ids == hyp + [eng.tokenizer.eos_token_ids[0]] and out.finish_reason.value == "stop"
    assert eng.blocks.usage == 0 and not eng.has_unfinished()
    assert not eng.info.lossless


@pytest.mark.parametrize("configured, calibrated, want", [
    (None, None, 0.7),   # neither: IBM's gate
    (None, 1.5, 1.5),    # the model's calibrated gate (config.json specserve.ctc_entropy_threshold)
    (0.3, 1.5, 0.3),     # method.ctc_entropy_threshold wins
    (0.0, 1.5, 0.0),     # and 0 turns the gate off even for a calibrated model
])
def test_relaxed_gate_is_the_configured_then_the_models_then_ibms(speech, configured, calibrated, want, monkeypatch):
    d, loaded = speech
    monkeypatch.setattr(loaded.speech, "ctc_entropy_threshold", calibrated)
    eng = _engine(speech, "ctc", k=8, ctc_acceptance="relaxed", ctc_entropy_threshold=configured)
    assert eng.proposer.entropy_threshold == want
    # the gate decides on that threshold: a posterior row of entropy ~1.0 nats passes 1.5 only
    row = torch.log_softmax(torch.tensor([2.0, 1.2, 0.9, 0.3] + [-30.0] * 124), -1)
    ent = ctc_max_entropy(row[None])
    assert 0.7 < ent < 1.5
    logp = torch.full((3, 128), -30.0)
    logp[:, 0] = 0.0
    logp[1] = row  # argmax label 0 (blank): text from a frame of "a" added below
    logp[2] = torch.full((128,), -30.0).index_fill(0, torch.tensor([97]), 0.0)
    seq = type("Seq", (), {"params": SamplingParams(temperature=0.0)})()
    hyp = eng.proposer.hypothesis(seq, logp)
    assert hyp.text == "a" and hyp.settled == (want > 0 and ent <= want)
    assert eng.proposer.opts.ctc_entropy_threshold == configured  # the config is not rewritten


@pytest.mark.parametrize("fallback", ["resume", "restart"])
def test_relaxed_one_pass_accepts_or_falls_back(speech, plain, fallback):
    clips, reqs, _, want = plain
    # a floor of 0 accepts any hypothesis in one pass; a floor of 1 accepts none
    eng = _engine(speech, "ctc", k=32, ctc_acceptance="relaxed", ctc_entropy_threshold=0.0,
                  ctc_confidence_threshold=0.0, ctc_fallback=fallback)
    odd = [21, 22, 23, 24]
    _fixed_hypotheses(eng, {len(clips[2].samples): odd})
    ids, params = _request(speech[1], clips[2], ignore_eos=False)
    out = eng.generate([ids], [params])[0]
    assert out.spec.ctc_stage == "verified" and out.token_ids == odd + [eng.tokenizer.eos_token_ids[0]]
    eng = _engine(speech, "ctc", k=32, ctc_acceptance="relaxed", ctc_entropy_threshold=0.0,
                  ctc_confidence_threshold=1.0, ctc_fallback=fallback)
    _fixed_hypotheses(eng, {len(clips[2].samples): want[2][:5] + [399] + want[2][5:]})
    out = eng.generate([ids], [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                              audio=clips[2])])[0]
    # rejected: resume keeps the accepted prefix and re-synchronises, restart decodes from the
    # prompt; greedy either way, so the output is plain decoding's
    assert out.spec.ctc_stage == "decoded" and out.token_ids == want[2]
    if fallback == "resume":
        assert out.spec.num_accepted_tokens >= 5
    else:
        assert out.spec.num_accepted_tokens == 0


def test_sampled_requests_are_verified_losslessly_in_relaxed_mode(speech, plain):
    clips, reqs, _, _ = plain
    eng = _engine(speech, "ctc", k=8, ctc_acceptance="relaxed")
    eng.proposer.hypothesis = lambda seq, logp: CtcHypothesis("x", [11, 12], 0.0, seq.params.temperature == 0)
    ids, _ = _request(speech[1], clips[0])
    out = eng.generate([ids], [SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True,
                                              audio=clips[0])])[0]
    assert out.spec.ctc_stage in ("verified", "decoded")  # not settled by the gate
    ref = _engine(speech).generate([ids], [SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True,
                                                          audio=clips[0])])[0]
    assert out.token_ids == ref.token_ids  # keyed random numbers: the same draws, the same tokens


def test_ctc_on_a_text_model_and_bad_options_fail_in_one_line(tmp_path):
    from tests.tiny_models import make_tiny_model

    with pytest.raises(ConfigError, match="ctc_acceptance"):
        validate_config(Config(model=ModelConfig(path="x"), method=method_options("ctc", num_speculative_tokens=4, ctc_acceptance="loose")))
    with pytest.raises(ConfigError, match="ctc_fallback"):
        validate_config(Config(model=ModelConfig(path="x"), method=method_options("ctc", num_speculative_tokens=4, ctc_fallback="beam")))
    with pytest.raises(ConfigError, match="ctc_confidence_threshold"):
        validate_config(Config(model=ModelConfig(path="x"), method=method_options("ctc", num_speculative_tokens=4, ctc_confidence_threshold=2)))
    with pytest.raises(ConfigError, match="ctc_entropy_threshold.*number \\(nats\\) or null"):
        validate_config(Config(model=ModelConfig(path="x"), method=method_options("ctc", num_speculative_tokens=4, ctc_entropy_threshold="high")))
    d = make_tiny_model(tmp_path / "text")
    cfg = Config(model=ModelConfig(name="t", path=str(d), dtype="float32"), method=method_options("ctc", num_speculative_tokens=4))
    cfg.engine.num_kv_blocks = 32
    with pytest.raises(ConfigError, match="speech model"):
        LLMEngine(validate_config(cfg))


def test_a_real_ctc_head_drafts_and_stays_lossless(speech, plain):
    """The tiny model's own (random) CTC head: its text re-tokenized drafts whatever it
    drafts; the output is still plain decoding's."""
    clips, reqs, _, want = plain
    eng = _engine(speech, "ctc", k=8)
    outs = eng.generate([r[0] for r in reqs], [r[1] for r in reqs])
    assert [o.token_ids for o in outs] == want[: len(reqs)]


@pytest.mark.parametrize("chunk", [7, 13, 0])
def test_a_chunked_prompt_still_verifies_its_hypothesis_in_the_first_pass(speech, plain, chunk):
    """The hypothesis rides on the prompt's last chunk however the prompt is cut (a step
    budget of ``chunk`` tokens for requests with a recording; 0: one chunk): the earlier
    chunks leave it pending."""
    clips, reqs, _, want = plain
    eng = _engine(speech, "ctc", k=32, ctc_acceptance="relaxed", ctc_entropy_threshold=0.0,
                  ctc_confidence_threshold=0.0)
    eng.cfg.audio.tokens_per_step = chunk  # read at construction: set it on the scheduler too
    eng.scheduler.background_tokens_alone = chunk
    odd = [21, 22, 23, 24]
    _fixed_hypotheses(eng, {len(clips[2].samples): odd})
    ids, params = _request(speech[1], clips[2], ignore_eos=False)
    out = eng.generate([ids], [params])[0]
    assert out.spec.ctc_stage == "verified" and out.token_ids == odd + [eng.tokenizer.eos_token_ids[0]]
    assert out.spec.num_draft_tokens == len(odd) and eng.blocks.usage == 0
