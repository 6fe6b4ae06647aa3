"""Bad requests are refused with a message naming the field; nothing is allocated."""

from __future__ import annotations

import pytest

from engine_utils import greedy, tiny_config
from specserve.engine.engine import LLMEngine
from specserve.errors import InvalidRequestError
from specserve.request import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    cfg = tiny_config(tiny_llama, "ngram", num_blocks=32)
    cfg.model.max_model_len = 64
    return LLMEngine(cfg)


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], greedy(4), "prompt"),
        (list(range(5, 69)), greedy(4), "prompt"),
        ([5, 6], greedy(63), "max_tokens"),
        ([5, 99999], greedy(4), "prompt_token_ids"),
        ([5, -1], greedy(4), "prompt_token_ids"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
        ([5, 6], SamplingParams(temperature=-1), "temperature"),
        ([5, 6], SamplingParams(top_p=0.0), "top_p"),
        ([5, 6], SamplingParams(top_p=1.5), "top_p"),
        ([5, 6], SamplingParams(min_p=2.0), "min_p"),
        ([5, 6], SamplingParams(top_k=-5), "top_k"),
        ([5, 6], SamplingParams(temperature="hot"), "temperature"),
        ([5, 6], SamplingParams(stop=[""]), "stop"),
    ],
)
def test_bad_request_names_the_field(engine, prompt, params, field):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", prompt, params)
    assert e.value.field == field and field in str(e.value)
    assert not engine.has_unfinished() and engine.blocks.num_free == engine.blocks.num_blocks


def test_request_larger_than_the_kv_cache_is_refused(tiny_llama):
    cfg = tiny_config(tiny_llama, "ngram", num_blocks=4, block_size=4)
    eng = LLMEngine(cfg)
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        eng.add_request("big", list(range(5, 15)), greedy(20))


def test_duplicate_request_id(engine):
    engine.add_request("dup", [5, 6, 7], greedy(2))
    with pytest.raises(InvalidRequestError, match="request_id"):
        engine.add_request("dup", [5, 6, 7], greedy(2))
    engine.abort_request("dup")
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_draft_with_another_vocabulary_is_a_config_error(tiny_llama, tmp_path):
    from engine_utils import tiny_config
    from specserve.errors import ConfigError
    from tiny_models import make_tiny_model

    other = make_tiny_model(tmp_path / "v", "llama", vocab_size=600)
    with pytest.raises(ConfigError, match="method.model.*vocabulary size 600"):
        LLMEngine(tiny_config(tiny_llama, "draft_model", draft_dir=other))


def test_parallel_drafting_needs_a_mask_token(tiny_llama):
    from engine_utils import tiny_config
    from specserve.errors import ConfigError

    cfg = tiny_config(tiny_llama, "draft_model", draft_dir=tiny_llama)
    cfg.method.parallel_drafting = True
    with pytest.raises(ConfigError, match="method.parallel_drafting.*pard_token"):
        LLMEngine(cfg)


def test_draft_max_model_len_beyond_the_target_is_rejected(tiny_llama):
    from engine_utils import tiny_config
    from specserve.errors import ConfigError

    cfg = tiny_config(tiny_llama, "draft_model", draft_dir=tiny_llama)
    cfg.model.max_model_len = 64
    cfg.method.max_model_len = 128
    with pytest.raises(ConfigError, match="method.max_model_len"):
        LLMEngine(cfg)
