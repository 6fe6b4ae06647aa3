"""``LLM.transcribe`` (the offline door): recordings as paths, bytes or samples, long ones
split and joined; +method=ctc exact gives plain decoding's transcripts; bad input names
the field; a text model refuses."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.audio.decode import encode_wav
from specserve.errors import InvalidRequestError
from specserve.llm import LLM
from tests.engine_utils import one_thread  # noqa: F401
from tests.tiny_models import make_tiny_speech_model


def _rec(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * 250 * t * (1 + 0.3 * t)) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_speech_model(tmp_path_factory.mktemp("offline-speech"), "granite", seed=3)


def _llm(d, spec=None) -> LLM:
    return LLM(str(d), speculative_config=spec, dtype="float32", num_kv_blocks=256, block_size=4,
               speculation="fixed", hydra_overrides=["audio.max_clip_s=2.0"])


def test_transcribe_every_input_kind_and_ctc_equals_plain(model_dir, tmp_path):
    short, long = _rec(1.3, 1), _rec(4.6, 2)
    path = tmp_path / "a.flac"
    path.write_bytes(encode_wav(short, 16000, "FLAC"))
    plain = _llm(model_dir).transcribe([str(path), encode_wav(long), (short, 16000)])
    ctc = _llm(model_dir, {"method": "ctc", "num_speculative_tokens": 8}).transcribe(
        [str(path), encode_wav(long), (short, 16000)])
    assert [t.text for t in ctc] == [t.text for t in plain]
    assert plain[0].text == plain[2].text and plain[0].text  # FLAC file and raw samples: the same recording
    assert len(plain[1].segments) >= 3 and abs(plain[1].duration_s - 4.6) < 1e-3
    assert plain[1].text == " ".join(s.text.strip() for s in plain[1].segments if s.text.strip())
    assert sum(ctc[1].ctc_stages.values()) == len(ctc[1].segments) and plain[1].ctc_stages == {}


def test_bad_input_and_text_models(model_dir, tiny_llama):
    llm = _llm(model_dir)
    with pytest.raises(InvalidRequestError) as e:
        llm.transcribe(b"definitely not audio")
    assert e.value.field == "audio"
    with pytest.raises(InvalidRequestError) as e:
        llm.transcribe([encode_wav(_rec(1.0, 3)), 42])
    assert e.value.field == "audio[1]"
    with pytest.raises(InvalidRequestError) as e:
        llm.transcribe(encode_wav(_rec(1.0, 3)), temperature=4.0)
    assert e.value.field == "temperature"
    assert not llm.engine.has_unfinished()
    text = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError) as e:
        text.transcribe(encode_wav(_rec(1.0, 3)))
    assert e.value.field == "model"
