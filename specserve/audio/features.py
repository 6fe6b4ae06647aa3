"""Granite Speech's log-mel features, computed with torch (torchaudio cannot be installed
beside the pinned torch, so the mel spectrogram is written here).

The definition (Granite's feature extractor, which calls torchaudio's MelSpectrogram
with its defaults for the rest):

* power spectrogram: n_fft 512, a periodic Hann window of 400 samples centred in the
  512-point frame, hop 160 (100 frames/s), frames centred on their sample (the signal
  is reflect-padded by n_fft/2 on both sides), |STFT|^2;
* 80 triangular mel filters on the HTK mel scale (mel = 2595 log10(1 + f/700)) from 0 Hz
  to 8 kHz, without area normalisation;
* log10 of the mel energies clipped below at 1e-10; floored at the utterance's maximum
  minus 8; then divided by 4 and increased by 1;
* an odd last frame dropped, and frame pairs stacked: (frames/2, 160) at 50 Hz.

A recording of n samples gives n // 160 + 1 mel frames, (n // 160 + 1) // 2 encoder
frames, and ``num_audio_tokens``: 3 projector outputs per started window of 15 encoder
frames (about 10 per second), the ``<|audio|>`` positions of its prompt.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from specserve.audio import SAMPLE_RATE

N_FFT = 512
WIN_LENGTH = 400
HOP_LENGTH = 160
N_MELS = 80


def _hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    return 2595.0 * torch.log10(1.0 + f / 700.0)


def _mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


@lru_cache(maxsize=4)
def mel_filters(n_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """(n_fft // 2 + 1, n_mels) float32: the triangular HTK-scale filters, 0 Hz to Nyquist."""
    n_freqs = n_fft // 2 + 1
    freqs = torch.linspace(0.0, sample_rate / 2, n_freqs, dtype=torch.float64)
    m_lo, m_hi = _hz_to_mel(torch.tensor(0.0, dtype=torch.float64)), _hz_to_mel(
        torch.tensor(sample_rate / 2, dtype=torch.float64))
    edges = _mel_to_hz(torch.linspace(float(m_lo), float(m_hi), n_mels + 2, dtype=torch.float64))
    widths = edges[1:] - edges[:-1]  # (n_mels + 1,)
    rel = edges[None, :] - freqs[:, None]  # (n_freqs, n_mels + 2)
    rising = -rel[:, :-2] / widths[:-1]
    falling = rel[:, 2:] / widths[1:]
    return torch.clamp(torch.minimum(rising, falling), min=0.0).float()


@lru_cache(maxsize=4)
def _window(win_length: int = WIN_LENGTH) -> torch.Tensor:
    return torch.hann_window(win_length, periodic=True, dtype=torch.float32)


def log_mel(samples: torch.Tensor | np.ndarray) -> torch.Tensor:
    """(n,) float samples at 16 kHz -> (n // 160 + 1, 80) float32 log-mel frames, scaled
    as Granite's extractor scales them (before stacking)."""
    x = torch.as_tensor(samples, dtype=torch.float32)
    if x.dim() != 1:
        raise ValueError(f"samples: expected one channel (n,), got shape {tuple(x.shape)}")
    spec = torch.stft(x, N_FFT, hop_length=HOP_LENGTH, win_length=WIN_LENGTH, window=_window(), center=True,
                      pad_mode="reflect", return_complex=True)  # (257, frames)
    power = spec.real.square() + spec.imag.square()
    mel = power.transpose(0, 1) @ mel_filters()  # (frames, 80)
    lg = mel.clamp(min=1e-10).log10()
    lg = torch.maximum(lg, lg.max() - 8.0)
    return lg / 4.0 + 1.0


def stack_frames(lm: torch.Tensor) -> torch.Tensor:
    """(frames, 80) -> (frames // 2, 160): an odd last frame dropped, pairs side by side."""
    n = lm.shape[0] - lm.shape[0] % 2
    return lm[:n].reshape(n // 2, 2 * lm.shape[1])


def input_features(samples: torch.Tensor | np.ndarray) -> torch.Tensor:
    """(n,) samples at 16 kHz -> (n // 160 + 1) // 2 encoder input frames of 160 dims."""
    return stack_frames(log_mel(samples))


def num_encoder_frames(num_samples: int) -> int:
    return (num_samples // HOP_LENGTH + 1) // 2


def num_audio_tokens(num_samples: int, window_size: int = 15, downsample_rate: int = 5) -> int:
    """Projector outputs for a recording of ``num_samples`` (the ``<|audio|>`` positions)."""
    return math.ceil(num_encoder_frames(num_samples) / window_size) * (window_size // downsample_rate)
