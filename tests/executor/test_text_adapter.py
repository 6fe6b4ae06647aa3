"""A speech model's text adapter (config.json ``specserve.text_adapter``): the low-rank
factors the trainer writes (``train.lora``) merged into the text weights at load time give
the logits and greedy transcription of transformers' model with the same adapter wrapped
in, in float32; bad adapter files are refused naming the file and key."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specserve.audio import AudioClip
from specserve.audio.features import input_features, num_audio_tokens
from specserve.audio.prompt import transcription_prompt
from specserve.config import Config, ModelConfig, validate_config
from specserve.engine.engine import LLMEngine
from specserve.errors import ModelLoadError
from specserve.executor.loader import load_model
from specserve.request import SamplingParams
from specserve.train.lora import add_lora, lora_state_dict
from tests.engine_utils import one_thread  # noqa: F401
from tests.tiny_models import SPEECH_AUDIO_TOKEN, make_tiny_speech_model

MODULES = ["q_proj", "v_proj", "o_proj", "down_proj"]


def _recording(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 180 * t * (1 + t)) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def _adapted(tmp_path, text: str = "llama"):
    """A tiny speech model directory with an adapter, and transformers' model with the same
    adapter wrapped into its text model."""
    from safetensors.torch import save_file
    from transformers import GraniteSpeechForConditionalGeneration

    d = make_tiny_speech_model(tmp_path / f"speech-{text}", text)
    hf = GraniteSpeechForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32).eval()
    add_lora(hf.model.language_model, rank=4, alpha=8.0, modules=MODULES)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in hf.model.language_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)  # a trained adapter: B away from its zero start
    factors = {f"model.{k}": v for k, v in lora_state_dict(hf.model.language_model).items()}
    save_file(factors, str(d / "text_adapter.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    cfg.setdefault("specserve", {})["text_adapter"] = {"file": "text_adapter.safetensors", "scale": 2.0}
    (d / "config.json").write_text(json.dumps(cfg))
    return d, hf


@pytest.mark.parametrize("text", ["llama", "granite"])
def test_merged_adapter_equals_transformers_with_the_adapter(tmp_path, text):
    d, hf = _adapted(tmp_path, text)
    loaded = load_model(str(d), "float32", torch.device("cpu"))
    cfg = Config(model=ModelConfig(name="tiny-speech", path=str(d), dtype="float32"))
    cfg.engine.num_kv_blocks = 128
    cfg.engine.block_size = 4
    eng = LLMEngine(validate_config(cfg), target=loaded)
    clips = [_recording(s, 30 + i) for i, s in enumerate((1.1, 2.3))]
    prompts = [transcription_prompt(loaded.tokenizer, SPEECH_AUDIO_TOKEN, num_audio_tokens(len(c))) for c in clips]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, audio=AudioClip(c)) for c in clips]
    outs = eng.generate(prompts, params)
    for c, p, o in zip(clips, prompts, outs):
        cur, want = list(p), []
        with torch.no_grad():
            for _ in range(8):
                logits = hf(input_ids=torch.tensor([cur]), input_features=input_features(c)[None]).logits[0, -1]
                want.append(int(logits.argmax()))
                cur.append(want[-1])
        assert o.token_ids == want
    assert eng.blocks.usage == 0
    # the adapter changed the text weights (the test would pass vacuously otherwise)
    cfg_json = json.loads((d / "config.json").read_text())
    del cfg_json["specserve"]["text_adapter"]
    (d / "config.json").write_text(json.dumps(cfg_json))
    plain = load_model(str(d), "float32", torch.device("cpu"))
    a = dict(loaded.model.named_parameters())
    b = dict(plain.model.named_parameters())
    assert any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mutate, match", [
    (lambda cfg, d: cfg["specserve"]["text_adapter"].update(file="missing.safetensors"), "not a file"),
    (lambda cfg, d: cfg["specserve"]["text_adapter"].update(file="../config.json"), "not a file in"),
    (lambda cfg, d: cfg["specserve"]["text_adapter"].update(scale="big"), "scale must be a number"),
    (lambda cfg, d: cfg["specserve"].update(text_adapter="text_adapter.safetensors"), "text_adapter must be"),
    (lambda cfg, d: (d / "text_adapter.safetensors").write_bytes(b"not safetensors"), "cannot read"),
])
def test_bad_adapters_are_refused_naming_the_file_or_key(tmp_path, mutate, match):
    d, _ = _adapted(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    mutate(cfg, d)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(d), "float32", torch.device("cpu"))


@pytest.mark.parametrize("factors, match", [
    ({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}, "has no"),
    ({"model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
      "model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}, "not a weight of the text model"),
    ({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 63),
      "model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}, "do not fit"),
    ({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}, "pairs"),
])
def test_bad_factors_are_refused(tmp_path, factors, match):
    from safetensors.torch import save_file

    d, _ = _adapted(tmp_path)
    save_file(factors, str(d / "text_adapter.safetensors"))
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(d), "float32", torch.device("cpu"))
