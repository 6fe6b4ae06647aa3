"""Decode an uploaded recording into float32 mono samples at 16 kHz.

soundfile (libsndfile) reads WAV, FLAC, OGG/Vorbis, OGG/Opus and MP3 from memory; a
recording at another rate is resampled with soxr (its high-quality setting); several
channels are averaged to one.  Everything a client can get wrong is reported as an
``InvalidRequestError`` on the field the bytes came in (``file`` for the HTTP door):
not audio at all, an empty or silent-length file, a format libsndfile cannot read, a
duration past the server's limit.  Nothing here imports torch.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import numpy as np

from specserve.audio import SAMPLE_RATE
from specserve.errors import InvalidRequestError

# Shortest recording accepted: one hop of the mel front end gives a frame, but a
# recording must hold at least one encoder frame pair (20 ms).
MIN_SAMPLES = 320


@dataclass(frozen=True)
class Audio:
    """A decoded recording: float32 mono samples in [-1, 1] at ``SAMPLE_RATE``."""

    samples: np.ndarray
    source_rate: int  # the file's own rate before resampling
    source_channels: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / SAMPLE_RATE


def to_mono_16k(samples: np.ndarray, rate: int, field: str = "file") -> np.ndarray:
    """(n,) or (n, channels) samples at ``rate`` -> (m,) float32 at 16 kHz."""
    x = np.asarray(samples)
    if x.ndim == 2:
        x = x.mean(axis=1) if x.shape[1] > 1 else x[:, 0]
    elif x.ndim != 1:
        raise InvalidRequestError(field, f"audio must be one or two dimensional (samples, channels); got {x.ndim} dims")
    if not np.issubdtype(x.dtype, np.floating):
        if np.issubdtype(x.dtype, np.integer):
            x = x.astype(np.float32) / float(np.iinfo(x.dtype).max)
        else:
            raise InvalidRequestError(field, f"audio samples must be numbers, got {x.dtype}")
    x = x.astype(np.float32, copy=False)
    if not np.isfinite(x).all():
        raise InvalidRequestError(field, "audio holds NaN or infinite samples")
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
        raise InvalidRequestError(field, f"sample rate must be a positive integer, got {rate!r}")
    if rate != SAMPLE_RATE:
        import soxr

        x = soxr.resample(x, int(rate), SAMPLE_RATE, quality="HQ").astype(np.float32, copy=False)
    return np.ascontiguousarray(x)


def decode_audio(data: bytes, field: str = "file", max_duration_s: float | None = None) -> Audio:
    """The recording in ``data`` (the bytes of an audio file), as 16 kHz mono float32."""
    import soundfile as sf

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidRequestError(field, "must be the bytes of an audio file")
    if len(data) == 0:
        raise InvalidRequestError(field, "is empty")
    try:
        info = sf.info(io.BytesIO(data))
    except Exception as e:  # libsndfile: "Format not recognised", truncated headers, ...
        raise InvalidRequestError(field, f"is not audio that can be decoded (wav, flac, ogg, mp3): {_reason(e)}") from None
    if info.samplerate <= 0 or info.channels <= 0:
        raise InvalidRequestError(field, "has no sample rate or no channels")
    if max_duration_s is not None and info.frames > 0 and info.frames / info.samplerate > max_duration_s:
        raise InvalidRequestError(field, f"is {info.frames / info.samplerate:.1f} s long; this server accepts at most "
                                         f"{max_duration_s:g} s (audio.max_duration_s)")
    try:
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:
        raise InvalidRequestError(field, f"could not be decoded: {_reason(e)}") from None
    if samples.shape[0] < MIN_SAMPLES * rate / SAMPLE_RATE:
        raise InvalidRequestError(field, f"holds {samples.shape[0]} samples at {rate} Hz; at least 20 ms of audio "
                                         "is needed")
    duration = samples.shape[0] / rate
    if max_duration_s is not None and duration > max_duration_s:
        raise InvalidRequestError(field, f"is {duration:.1f} s long; this server accepts at most {max_duration_s:g} s "
                                         "(audio.max_duration_s)")
    mono = to_mono_16k(samples, rate, field)
    return Audio(mono, int(rate), int(samples.shape[1]))


def encode_wav(samples: np.ndarray, rate: int = SAMPLE_RATE, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    """``samples`` as the bytes of an audio file (WAV by default; FLAC, OGG, MP3 where
    libsndfile writes them): for tests, clients and the benchmark."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.asarray(samples), rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _reason(e: Exception) -> str:
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    text = re.sub(r"^Error opening <[^>]*>: ", "", text)  # libsndfile names the buffer object
    return text[:160]
