"""The Granite Speech family against transformers' GraniteSpeechForConditionalGeneration, in
float32 on tiny random models (text model llama, and granite with its multipliers): the
audio rows, the logits of a prompt holding them, and the greedy transcription (engine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.audio import AudioClip
from specserve.audio.features import input_features, num_audio_tokens
from specserve.audio.prompt import transcription_prompt
from specserve.config import Config, ModelConfig, validate_config
from specserve.engine.engine import LLMEngine
from specserve.errors import InvalidRequestError, ModelLoadError
from specserve.executor.backends.torch_backend import TorchRunner
from specserve.executor.batch import SeqInput
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import load_model
from specserve.request import SamplingParams
from tests.engine_utils import one_thread  # noqa: F401
from tests.tiny_models import SPEECH_AUDIO_TOKEN, make_tiny_speech_model


def recording(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 220 * t * (1 + t)) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="module", params=["llama", "granite"])
def speech(request, tmp_path_factory):
    from transformers import GraniteSpeechForConditionalGeneration

    d = make_tiny_speech_model(tmp_path_factory.mktemp(f"speech-{request.param}"), request.param)
    hf = GraniteSpeechForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32).eval()
    loaded = load_model(str(d), "float32", torch.device("cpu"))
    return d, hf, loaded


def _prompt(loaded, samples) -> list[int]:
    return transcription_prompt(loaded.tokenizer, SPEECH_AUDIO_TOKEN, num_audio_tokens(len(samples)))


def test_audio_rows_equal_transformers(speech):
    _, hf, loaded = speech
    assert loaded.speech is not None and loaded.speech.audio_token_index == SPEECH_AUDIO_TOKEN
    for seconds in (0.4, 1.37, 3.1):  # one window, several, a partial last encoder block
        samples = recording(seconds, 1)
        feats = input_features(samples)
        with torch.no_grad():
            ref = hf.model.get_audio_features(feats[None]).pooler_output[0]
            mine, logp = loaded.speech.model.audio_embeddings(feats)
            ref_hidden = hf.model.encoder(feats[None]).last_hidden_state[0]
            ref_logp = hf.model.encoder.out(ref_hidden).log_softmax(-1)
        assert mine.shape == ref.shape == (num_audio_tokens(len(samples)), 64)
        torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)


def test_prompt_logits_equal_transformers(speech):
    _, hf, loaded = speech
    samples = recording(2.2, 2)
    ids = _prompt(loaded, samples)
    first = ids.index(SPEECH_AUDIO_TOKEN)
    feats = input_features(samples)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), input_features=feats[None]).logits[0]
        emb, _ = loaded.speech.model.audio_embeddings(feats)
    kv = KVCache(loaded.arch.num_layers, 64, 4, loaded.arch.num_kv_heads, loaded.arch.head_dim, torch.float32,
                 torch.device("cpu"))
    runner = TorchRunner(loaded, kv)
    table = list(range((len(ids) + 3) // 4))
    # the prompt in two chunks: the audio rows straddle the cut
    cut = first + emb.shape[0] // 2
    out1 = runner.forward([SeqInput(ids[:cut], 0, table, list(range(cut)), input_embeds=[(first, emb[: cut - first])])])
    out2 = runner.forward([SeqInput(ids[cut:], cut, table, list(range(len(ids) - cut)),
                                    input_embeds=[(0, emb[cut - first :])])])
    got = torch.cat([out1.logits, out2.logits])
    # transformers' GraniteSpeechForConditionalGeneration applies its own lm_head to the base
    # Granite model and so skips the text model's logits_scaling, which GraniteForCausalLM
    # (and IBM's evaluation scripts, dividing by hand) apply: specserve keeps the text
    # model's logits; argmax is the same either way.
    scaling = getattr(loaded.hf_config, "logits_scaling", 1.0) if loaded.arch.model_type == "granite" else 1.0
    torch.testing.assert_close(got * scaling, ref, atol=1e-4, rtol=1e-4)
    # without the rows the audio positions read their token's embedding: not the same logits
    plain = runner.forward([SeqInput(ids, 0, table, list(range(len(ids))))]).logits
    assert not torch.allclose(plain[-1], ref[-1], atol=1e-3)


def _hf_greedy(hf, ids: list[int], feats: torch.Tensor, n: int) -> list[int]:
    out = []
    cur = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(input_ids=torch.tensor([cur]), input_features=feats[None]).logits[0, -1]
            t = int(logits.argmax())
            out.append(t)
            cur.append(t)
    return out


def _engine(d, loaded, method=None, **kw) -> LLMEngine:
    cfg = Config(model=ModelConfig(name="tiny-speech", path=str(d), dtype="float32"))
    cfg.engine.num_kv_blocks = 128
    cfg.engine.block_size = 4
    cfg.engine.speculation = "fixed"
    if method is not None:
        from specserve.methods import method_options

        cfg.method = method_options(method, num_speculative_tokens=8, **kw)
    return LLMEngine(validate_config(cfg), target=loaded)


def test_greedy_transcription_equals_transformers(speech):
    d, hf, loaded = speech
    eng = _engine(d, loaded)
    clips = [recording(s, 10 + i) for i, s in enumerate((0.9, 2.5))]
    prompts = [_prompt(loaded, c) for c in clips]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, audio=AudioClip(c)) for c in clips]
    outs = eng.generate(prompts, params)
    for c, p, o in zip(clips, prompts, outs):
        assert o.token_ids == _hf_greedy(hf, p, input_features(c), 10)
    assert eng.blocks.usage == 0 and not eng.has_unfinished()


def test_a_text_model_refuses_recordings_and_bad_prompts_are_named(speech, tmp_path):
    d, _, loaded = speech
    eng = _engine(d, loaded)
    clip = AudioClip(recording(1.0, 3))
    good = _prompt(loaded, clip.samples)
    with pytest.raises(InvalidRequestError) as e:  # one audio position short
        short = list(good)
        short.remove(SPEECH_AUDIO_TOKEN)
        eng.add_request("a", short, SamplingParams(max_tokens=2, audio=clip))
    assert e.value.field == "prompt"
    from tests.tiny_models import make_tiny_model

    text_dir = make_tiny_model(tmp_path / "text")
    cfg = validate_config(Config(model=ModelConfig(name="t", path=str(text_dir), dtype="float32")))
    cfg.engine.num_kv_blocks = 64
    text_eng = LLMEngine(cfg)
    with pytest.raises(InvalidRequestError) as e:
        text_eng.add_request("b", [5, 6, 7], SamplingParams(max_tokens=2, audio=clip))
    assert e.value.field == "audio"
    assert not text_eng.has_unfinished()


def test_a_modality_lora_is_refused_in_one_line(tmp_path):
    import json

    d = make_tiny_speech_model(tmp_path / "lora")
    cfg = json.loads((d / "config.json").read_text())
    cfg["has_lora_adapter"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="has_lora_adapter"):
        load_model(str(d), "float32", torch.device("cpu"))


@pytest.mark.parametrize("gate", [0, -1.0, "high", True])
def test_a_bad_calibrated_entropy_gate_is_refused_naming_the_key(tmp_path, gate):
    import json

    d = make_tiny_speech_model(tmp_path / "gate")
    cfg = json.loads((d / "config.json").read_text())
    cfg.setdefault("specserve", {})["ctc_entropy_threshold"] = gate
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="specserve.ctc_entropy_threshold must be a positive number"):
        load_model(str(d), "float32", torch.device("cpu"))


def test_the_prefix_cache_keys_audio_rows_by_the_recording(speech):
    """Two recordings of one length have the same prompt token ids: only the recording's
    digest keeps the second from reusing the first's cached audio rows."""
    d, _, loaded = speech
    a, b = AudioClip(recording(2.4, 21)), AudioClip(recording(2.4, 22))
    ids = _prompt(loaded, a.samples)
    assert ids == _prompt(loaded, b.samples)

    def run(eng, clip):
        p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, audio=clip)
        return eng.generate([ids], [p])[0].token_ids

    fresh_b = run(_engine(d, loaded), b)
    eng = _engine(d, loaded)
    assert eng.cfg.engine.enable_prefix_caching
    first_a = run(eng, a)
    hits = eng.blocks.num_hit_tokens
    assert run(eng, a) == first_a and eng.blocks.num_hit_tokens > hits  # the same recording: cached
    hits = eng.blocks.num_hit_tokens
    assert run(eng, b) == fresh_b and eng.blocks.num_hit_tokens == hits  # another recording: nothing shared
