"""The audio front end: Granite's log-mel (torch) against an independent numpy
implementation of the same definition (float64, its own framing, window, FFT and
filters) within 1e-5; decoding of wav / flac / ogg / mp3 and resampling; the bad files
each refused naming the field; long recordings cut at low-energy points; the prompt."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.audio import AudioClip
from specserve.audio.decode import decode_audio, encode_wav, to_mono_16k
from specserve.audio.features import input_features, log_mel, num_audio_tokens, num_encoder_frames
from specserve.audio.split import split_audio, split_points
from specserve.audio.text import normalize_transcript
from specserve.errors import InvalidRequestError


# ------------------------------------------------------------------ the reference mel
def reference_log_mel(x: np.ndarray) -> np.ndarray:
    """Granite's features written again from the definition, in numpy float64."""
    sr, n_fft, win, hop, n_mels = 16000, 512, 400, 160, 80
    x = np.asarray(x, dtype=np.float64)
    pad = n_fft // 2
    xp = np.pad(x, (pad, pad), mode="reflect")
    frames = 1 + (len(xp) - n_fft) // hop
    n = np.arange(win)
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * n / win)  # periodic Hann
    window = np.zeros(n_fft)
    window[(n_fft - win) // 2 : (n_fft - win) // 2 + win] = hann
    power = np.empty((frames, n_fft // 2 + 1))
    for t in range(frames):
        seg = xp[t * hop : t * hop + n_fft] * window
        power[t] = np.abs(np.fft.rfft(seg)) ** 2

    def mel(f):
        return 2595.0 * np.log10(1.0 + f / 700.0)

    def hz(m):
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    edges = hz(np.linspace(mel(0.0), mel(sr / 2), n_mels + 2))
    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    fb = np.zeros((n_fft // 2 + 1, n_mels))
    for m in range(n_mels):
        lo, c, hi = edges[m], edges[m + 1], edges[m + 2]
        up = (freqs - lo) / (c - lo)
        down = (hi - freqs) / (hi - c)
        fb[:, m] = np.maximum(0.0, np.minimum(up, down))
    lm = np.log10(np.maximum(power @ fb, 1e-10))
    lm = np.maximum(lm, lm.max() - 8.0)
    return lm / 4.0 + 1.0


def _signal(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.4 * np.sin(2 * np.pi * 440 * t) * np.exp(-t) + 0.02 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.mark.parametrize("n", [320, 1000, 16000, 16161, 48000 + 37])
def test_log_mel_equals_the_reference_within_1e_5(n):
    x = _signal(n / 16000, n)
    got = log_mel(x).numpy()
    want = reference_log_mel(x)
    assert got.shape == want.shape == (n // 160 + 1, 80)
    assert np.abs(got - want).max() < 1e-5


def test_frames_are_stacked_in_pairs_and_token_counts_follow():
    for n in (320, 16000, 16160, 48000):
        f = input_features(_signal(n / 16000, 1))
        lm = log_mel(_signal(n / 16000, 1))
        assert f.shape == (num_encoder_frames(n), 160)
        assert np.array_equal(f[0].numpy(), np.concatenate([lm[0].numpy(), lm[1].numpy()]))
    assert num_audio_tokens(16000) == 3 * math.ceil(50 / 15) == 12  # ~10 per second
    assert num_audio_tokens(480000) == 300


# ------------------------------------------------------------------ decoding
@pytest.mark.parametrize("fmt,subtype", [("WAV", "PCM_16"), ("WAV", "FLOAT"), ("FLAC", None), ("OGG", "VORBIS"),
                                         ("MP3", None)])
def test_every_container_decodes_to_16k_mono(fmt, subtype):
    rate = 22050
    t = np.arange(int(1.2 * rate)) / rate
    tone = (0.5 * np.sin(2 * np.pi * 500 * t)).astype(np.float32)
    stereo = np.stack([tone, tone], axis=1)
    data = encode_wav(stereo, rate, fmt, subtype)
    a = decode_audio(data)
    assert a.source_rate == rate and a.source_channels == 2
    assert abs(a.duration_s - 1.2) < 0.06  # mp3 pads its frames
    assert a.samples.dtype == np.float32 and a.samples.ndim == 1
    # the tone survives: its power sits at 500 Hz after resampling
    spec = np.abs(np.fft.rfft(a.samples[2000:14000]))
    assert abs(np.argmax(spec) * 16000 / 12000 - 500) < 5


@pytest.mark.parametrize("data,why", [
    (b"", "is empty"),
    (b"not audio at all, just some text", "is not audio"),
    (b"RIFF\x00\x00\x00\x00WAVEfmt ", "is not audio"),
    (encode_wav(np.zeros(100, np.float32)), "at least 20 ms"),
])
def test_bad_files_name_the_field(data, why):
    with pytest.raises(InvalidRequestError) as e:
        decode_audio(data, "file")
    assert e.value.field == "file" and why in str(e.value) and "BytesIO" not in str(e.value)


def test_too_long_is_refused_before_decoding():
    with pytest.raises(InvalidRequestError, match="at most 2 s"):
        decode_audio(encode_wav(np.zeros(16000 * 3, np.float32)), "file", max_duration_s=2)


def test_to_mono_16k_checks_its_input():
    with pytest.raises(InvalidRequestError):
        to_mono_16k(np.array([np.nan, 0.0], np.float32), 16000)
    with pytest.raises(InvalidRequestError):
        to_mono_16k(np.zeros(10, np.float32), 0)
    out = to_mono_16k((np.ones(8000) * 16384).astype(np.int16), 8000)
    assert len(out) == 16000 and abs(float(out[8000]) - 0.5) < 0.01


# ------------------------------------------------------------------ splitting
@settings(max_examples=40, deadline=None)
@given(seconds=st.floats(0.5, 95.0), clip=st.sampled_from([2.0, 5.0, 30.0]), seed=st.integers(0, 100))
def test_segments_cover_the_recording_and_respect_the_clip(seconds, clip, seed):
    x = np.random.default_rng(seed).standard_normal(int(seconds * 16000)).astype(np.float32)
    segs = split_audio(x, clip)
    assert segs[0][0] == 0 and segs[-1][1] == len(x)
    assert all(a[1] == b[0] for a, b in zip(segs, segs[1:]))
    assert all(0 < e - s <= clip * 16000 for s, e in segs)
    assert all(e - s >= clip * 16000 // 2 for s, e in segs[:-1])  # a cut lies in the last second


def test_cuts_fall_in_the_pause():
    speech = np.random.default_rng(0).standard_normal(16000 * 40).astype(np.float32)
    speech[int(29.3 * 16000) : int(29.5 * 16000)] = 0.0  # a 200 ms pause just before the 30 s limit
    [cut] = split_points(speech, 30.0)
    assert 29.3 * 16000 <= cut <= 29.5 * 16000
    assert split_points(speech[: 16000 * 30], 30.0) == []


def test_clip_digest_follows_the_samples():
    a = AudioClip(np.zeros(16000, np.float32))
    assert a.digest == AudioClip(np.zeros(16000, np.float32)).digest != AudioClip(np.ones(16000, np.float32)).digest


def test_transcript_normalization():
    assert normalize_transcript("Don't stop -- it's 5 PM!") == "don't stop it's pm"
    assert normalize_transcript("  'Quoted'  words, HERE. ") == "quoted words here"


def test_the_prompt_places_the_audio_positions_in_the_user_turn(tmp_path):
    from specserve.audio.prompt import transcription_prompt
    from tests.tiny_models import _tokenizer

    _tokenizer(tmp_path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = transcription_prompt(tok, 500, 6, "w7 w8", context="w9", system="w3")
    text = tok.decode(ids)
    # (the tiny word-level vocabulary spells the role names <unk>)
    assert text == "<|im_start|> <unk> w3 <|im_end|> <|im_start|> <unk> " + "w495 " * 6 + "w7 w8 w9 <|im_end|> " \
                   "<|im_start|> <unk>"
    # a client's text that spells the audio token cannot add audio positions
    assert transcription_prompt(tok, 500, 2, "w7", context="w495 w495").count(500) == 2
