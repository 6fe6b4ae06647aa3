"""layer_skip self-speculation: greedy output equal to plain decoding (fp32, tiny
llama and qwen3 with explicit skipped layers, and with layers chosen by calibration),
both KV caches freed, preemption, the calibration's choice logged, and one-line
errors (skipping every layer, bad ids, a ratio of 1)."""

from __future__ import annotations

import logging

import pytest
from engine_utils import greedy, plain_outputs, random_prompts, tiny_config
from engine_utils import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from tiny_models import make_tiny_model

from specserve.config import ConfigError, validate_config
from specserve.engine.engine import LLMEngine
from specserve.proposers.layer_skip import SkipModel, calibrate
from specserve.executor.loader import load_model

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """Six layers, so that calibration has a choice to make."""
    return make_tiny_model(tmp_path_factory.mktemp("ls") / "deep", "llama", seed=3, num_hidden_layers=6)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, seed=9)


def _check(eng, outs, ref):
    assert [o.token_ids for o in outs] == ref
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.proposer.blocks.num_free == eng.proposer.blocks.num_blocks


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_explicit_skip_layers_greedy_equals_plain(tiny_model_dirs, prompts, arch):
    model = tiny_model_dirs[arch]
    ref = plain_outputs(model, prompts, MAX_TOKENS)
    eng = LLMEngine(tiny_config(model, "layer_skip", k=3, skip_layers=[1]))
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    _check(eng, outs, ref)
    assert sum(o.spec.num_draft_tokens for o in outs) > 0
    # the draft cache holds the kept layers only
    assert eng.proposer.inner.runner.kv.data.shape[0] == 1


def test_calibrated_choice_is_lossless_and_logged(deep_llama, prompts, caplog):
    ref = plain_outputs(deep_llama, prompts, MAX_TOKENS)
    eng = LLMEngine(tiny_config(deep_llama, "layer_skip", k=4, skip_ratio=0.5, skip_calibration_tokens=40))
    with caplog.at_level(logging.INFO, logger="specserve.proposers.layer_skip"):
        outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    _check(eng, outs, ref)
    skip = eng.proposer.skip_layers
    assert len(skip) == 3 and all(0 <= i < 6 for i in skip)
    assert any("skipping 3 of 6 layers" in r.getMessage() and str(skip) in r.getMessage() for r in caplog.records)
    assert 0.0 <= eng.proposer.agreement <= 1.0


def test_calibration_prefers_layers_that_keep_the_argmax(deep_llama):
    """Calibration's agreement is what it reports: recompute it for the chosen set."""
    import torch

    target = load_model(str(deep_llama), "float32", torch.device("cpu"))
    seqs = random_prompts(4, seed=1, lo=12, hi=20)
    skip, agreement = calibrate(target, seqs, 2)
    assert len(skip) == 2
    # an identity check: skipping nothing agrees fully
    none_skip, full = calibrate(target, seqs, 0)
    assert none_skip == [] and full == 1.0
    assert isinstance(SkipModel(target.model, set(skip)).kept, list)
    assert 0.0 <= agreement <= 1.0


def test_preemption_and_chunked_prefill(deep_llama, prompts):
    ref = plain_outputs(deep_llama, prompts, MAX_TOKENS)
    cfg = tiny_config(deep_llama, "layer_skip", k=3, skip_layers=[2, 4], num_blocks=26, block_size=4)
    cfg.engine.max_num_batched_tokens = 16
    eng = LLMEngine(cfg)
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    _check(eng, outs, ref)


@pytest.mark.parametrize(
    "kw, key, message",
    [
        ({"skip_layers": [0, 1]}, "method.skip_layers", "skips all 2 layers of the target; keep at least one"),
        ({"skip_layers": [0, 5]}, "method.skip_layers", "layer ids must be in [0, 2)"),
        ({"skip_layers": []}, "method.skip_layers", "is empty"),
    ],
)
def test_bad_skip_layers_are_one_line(tiny_llama, kw, key, message):
    with pytest.raises(ConfigError) as e:
        LLMEngine(tiny_config(tiny_llama, "layer_skip", k=3, **kw))
    assert e.value.key == key and message in str(e.value) and "\n" not in str(e.value)


def test_skip_ratio_of_one_is_refused(tiny_llama):
    with pytest.raises(ConfigError, match=r"method.skip_ratio: must be in \(0, 1\) \(1 would skip every layer\)"):
        tiny_config(tiny_llama, "layer_skip", k=3, skip_ratio=1.0)
    cfg = tiny_config(tiny_llama, "layer_skip", k=3, skip_ratio=0.1)  # rounds to no layer of two
    with pytest.raises(ConfigError, match="skips none"):
        LLMEngine(cfg)
    with pytest.raises(ConfigError, match="method.skip_calibration_tokens"):
        tiny_config(tiny_llama, "layer_skip", k=3, skip_calibration_tokens=2)
    validate_config(tiny_config(tiny_llama, "layer_skip", k=3))


@pytest.mark.slow
def test_embedded_smollm2_greedy_equals_plain_decoding(caplog):
    """The real embedded model in float32: calibrated layer skipping is lossless."""
    import torch

    from specserve.config import Config, ModelConfig, SpeculativeConfig
    from specserve.request import SamplingParams

    target = load_model("embedded:smollm2-135m-instruct", "float32", torch.device("cpu"))

    def engine(method):
        cfg = Config(model=ModelConfig(dtype="float32"))
        cfg.engine.num_kv_blocks = 64
        cfg.engine.num_prediction_tokens = 0
        if method:
            cfg.method = SpeculativeConfig(method=method, num_speculative_tokens=3, skip_ratio=0.5,
                                           skip_calibration_tokens=48)
        return LLMEngine(validate_config(cfg), target=target)

    plain = engine(None)
    tok = plain.tokenizer
    texts = ["Write a short poem about the sea.", "Explain what a hash table is in two sentences."]
    ids = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = [SamplingParams(temperature=0.0, max_tokens=32) for _ in ids]
    ref = [o.token_ids for o in plain.generate(ids, params)]
    eng = engine("layer_skip")
    with caplog.at_level(logging.INFO, logger="specserve.proposers.layer_skip"):
        outs = eng.generate(ids, params)
    assert [o.token_ids for o in outs] == ref
    assert len(eng.proposer.skip_layers) == 15
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    assert any("skipping 15 of 30 layers" in r.getMessage() for r in caplog.records)
