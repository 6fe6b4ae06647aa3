"""layer_skip self-speculation: greedy output equal to plain decoding (fp32, tiny
llama and qwen3 with explicit skipped layers, and with layers chosen by calibration),
both KV caches freed, preemption, the calibration's choice logged, and one-line
errors (skipping every layer, bad ids, a ratio of 1).  In bf16 on the CPU (skipped
where the fused kernel cannot run): the draft runs on a fused decoder over the kept
layers (the target's weight tensors, the compact draft cache), greedy output equal
to plain bf16 decoding, rebuilt for a new choice of layers."""

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


# -- bf16 on the CPU: the draft runs on the fused CPU decoder over the kept layers --


@pytest.fixture(scope="module")
def fused_lib():
    """Skip (with the reason) where the fused CPU decoder cannot run."""
    from specserve.executor.loader import default_cache_dir
    from specserve.kernels.cpu_decoder import KernelUnavailable, load_library

    try:
        return load_library(default_cache_dir())
    except KernelUnavailable as e:
        pytest.skip(f"fused CPU decoder unavailable here: {e}")


def _bf16_config(model, method=None, cpu_kernel="fused", **kw):
    cfg = tiny_config(model, method, **kw)
    cfg.model.dtype = "bfloat16"
    cfg.engine.cpu_kernel = cpu_kernel
    cfg.engine.num_prediction_tokens = 0
    return validate_config(cfg)


def _bf16_plain(model, prompts):
    eng = LLMEngine(_bf16_config(model))
    assert eng.runner.fused is not None
    return [o.token_ids for o in eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])]


def _count_calls(decoder) -> list[int]:
    """Wrap decoder.run (what every fused step goes through) with a call counter: the
    draft really ran on it."""
    calls = [0]
    run = decoder.run

    def counted(*a, **kw):
        calls[0] += 1
        return run(*a, **kw)

    decoder.run = counted
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_fused_draft_greedy_equals_plain(fused_lib, tiny_model_dirs, prompts, arch):
    """The fused path is batch invariant, so speculative greedy == plain greedy exactly."""
    from specserve.kernels.cpu_decoder import CpuDecoder

    model = tiny_model_dirs[arch]
    ref = _bf16_plain(model, prompts)
    eng = LLMEngine(_bf16_config(model, "layer_skip", k=3, skip_layers=[1]))
    assert eng.runner.fused is not None  # the target is fused too
    dec = eng.proposer.fused
    assert isinstance(dec, CpuDecoder) and dec is eng.proposer.inner.runner.fused
    assert dec.a.num_layers == 1 and dec._model.n_layers == 1
    # the kept layer's weights are the target's tensors (nothing copied)
    target = eng.target.model
    assert dec._layers[0].wqkv == target.layers[0].qkv_proj.weight.data_ptr()
    assert dec._layers[0].wdown == target.layers[0].down_proj.weight.data_ptr()
    assert dec.embed.data_ptr() == target.embed_tokens.weight.data_ptr()
    # ... and it reads the compact draft cache (layer 0 of one), not the target's
    k_cache, _ = eng.proposer.inner.runner.kv.layer(0)
    assert eng.proposer.inner.runner.kv.data.shape[0] == 1 and dec._layers[0].kcache == k_cache.data_ptr()
    calls = _count_calls(dec)
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    _check(eng, outs, ref)
    assert sum(o.spec.num_draft_tokens for o in outs) > 0
    assert calls[0] > 0


def test_bf16_calibration_builds_the_fused_draft(fused_lib, deep_llama, prompts):
    """No draft before calibration; the chosen layers get a fused decoder of their own,
    and choosing others (a re-calibration) builds a new one."""
    ref = _bf16_plain(deep_llama, prompts)
    eng = LLMEngine(_bf16_config(deep_llama, "layer_skip", k=4, skip_ratio=0.5, skip_calibration_tokens=40))
    assert eng.proposer.fused is None
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    _check(eng, outs, ref)
    first = eng.proposer.fused
    assert first is not None and first.a.num_layers == 3
    kept = [i for i in range(6) if i not in eng.proposer.skip_layers]
    assert [first._layers[j].wqkv for j in range(3)] == [eng.target.model.layers[i].qkv_proj.weight.data_ptr()
                                                        for i in kept]
    eng.proposer._build([0, 5])  # what a new calibration does with its choice
    second = eng.proposer.fused
    assert second is not first and second.a.num_layers == 4
    assert second._layers[0].wqkv == eng.target.model.layers[1].qkv_proj.weight.data_ptr()
    calls = _count_calls(second)
    outs = eng.generate(prompts, [greedy(MAX_TOKENS) for _ in prompts])
    _check(eng, outs, ref)
    assert calls[0] > 0


def test_bf16_calibration_on_the_fused_decoder_matches_torch(fused_lib, deep_llama):
    """Calibration's fused forwards measure what its torch forwards do: each kept
    layer's influence (the last one's from the final-normed state) and the argmax."""
    import torch

    from specserve.executor.batch import SeqInput, StepBatch
    from specserve.executor.kv_cache import KVCache
    from specserve.executor.backends.factory import RunnerFactory
    from specserve.executor.backends.torch_backend import TorchRunner
    from specserve.proposers.layer_skip import _fused_forward, skip_loaded

    target = load_model(str(deep_llama), "bfloat16", torch.device("cpu"))
    seqs = random_prompts(4, seed=1, lo=12, hi=20)
    a, block = target.arch, 16
    kv = KVCache(a.num_layers, len(seqs) * 2, block, a.num_kv_heads, a.head_dim, target.dtype, target.device)
    batch = StepBatch.from_inputs([SeqInput(list(s), 0, [2 * n, 2 * n + 1], list(range(len(s) - 1)))
                                   for n, s in enumerate(seqs)], block)
    full = RunnerFactory(cpu_kernel="fused").runner(skip_loaded(target, SkipModel(target.model)), kv).fused
    fused = _fused_forward(target, full, kv, batch)
    model = SkipModel(target.model, compact=False)
    meta, ids, pos = TorchRunner(skip_loaded(target, model), kv)._metadata(batch)
    for skip in [set(), {2}, {1, 4}]:
        pred, infl = fused(skip)
        model.set_skip(skip)
        ref_infl: list = []
        hidden, _ = model(ids, pos, meta, kv, influence=ref_infl)
        ref = model.compute_logits(hidden[torch.tensor(batch.logits_rows)]).argmax(dim=-1)
        assert [i for i, _ in infl] == [i for i, _ in ref_infl] == model.kept
        assert max(abs(x - y) for (_, x), (_, y) in zip(infl, ref_infl)) < 5e-3
        assert float((pred == ref).float().mean()) >= 0.9  # bf16 rounding may flip a near tie
    skip, agreement = calibrate(target, seqs, 2, runners=RunnerFactory(cpu_kernel="fused"))
    assert len(skip) == 2 and 0.0 <= agreement <= 1.0


def test_bf16_torch_kernel_keeps_the_torch_draft(fused_lib, tiny_llama, prompts):
    """engine.cpu_kernel=torch: the draft runs torch, like the target."""
    eng = LLMEngine(_bf16_config(tiny_llama, "layer_skip", cpu_kernel="torch", k=3, skip_layers=[1]))
    assert eng.runner.fused is None and eng.proposer.fused is None
    outs = eng.generate(prompts[:2], [greedy(8) for _ in prompts[:2]])
    assert eng.blocks.num_free == eng.blocks.num_blocks and all(len(o.token_ids) == 8 for o in outs)


def test_fp32_draft_runs_torch(tiny_llama):
    eng = LLMEngine(tiny_config(tiny_llama, "layer_skip", k=3, skip_layers=[1]))
    assert eng.runner.fused is None and eng.proposer.fused is None


@pytest.mark.slow
def test_embedded_smollm2_greedy_equals_plain_decoding(caplog):
    """The real embedded model in float32: calibrated layer skipping is lossless."""
    import torch

    from specserve.config import Config, ModelConfig
    from specserve.methods import method_options
    from specserve.request import SamplingParams

    target = load_model("embedded:smollm2-135m-instruct", "float32", torch.device("cpu"))

    def engine(method):
        cfg = Config(model=ModelConfig(dtype="float32"))
        cfg.engine.num_kv_blocks = 64
        cfg.engine.num_prediction_tokens = 0
        if method:
            cfg.method = method_options(method, num_speculative_tokens=3, skip_ratio=0.5, skip_calibration_tokens=48)
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
