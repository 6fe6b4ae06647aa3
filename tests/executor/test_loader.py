from __future__ import annotations

import json

import pytest
import torch

from specserve.errors import ModelLoadError
from specserve.executor.loader import load_model, resolve_dtype


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not found.*nothing is downloaded"):
        load_model(str(tmp_path / "nope"), "float32", torch.device("cpu"))


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), "float32", torch.device("cpu"))


def test_unknown_embedded_model_is_rejected():
    with pytest.raises(ModelLoadError, match="unknown embedded model"):
        load_model("embedded:gpt-17", "float32", torch.device("cpu"))


def test_unsupported_architecture_names_the_key(tmp_path, tiny_llama):
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((tiny_llama / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="model.path.*not supported"):
        load_model(str(d), "float32", torch.device("cpu"))


def test_max_model_len_beyond_positions_is_rejected(tiny_llama):
    with pytest.raises(ModelLoadError, match="max_model_len=100000 exceeds"):
        load_model(str(tiny_llama), "float32", torch.device("cpu"), max_model_len=100000)


def test_float16_needs_cuda():
    with pytest.raises(ModelLoadError, match="float16 is only supported on CUDA"):
        resolve_dtype("float16", torch.device("cpu"))


def test_bfloat16_load(tiny_llama):
    lm = load_model(str(tiny_llama), "bfloat16", torch.device("cpu"))
    assert lm.model.embed_tokens.weight.dtype == torch.bfloat16
    assert lm.eos_token_ids == (2,)
