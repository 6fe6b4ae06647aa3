"""The audio front end: one room for everything a recording goes through before a model.

* ``decode``: bytes of a wav / flac / ogg / mp3 file -> float32 mono samples at 16 kHz
  (soundfile decodes, soxr resamples); bad input is an ``InvalidRequestError`` naming the
  request field.  No torch.
* ``split``: a recording longer than a clip limit -> segments cut at low-energy points
  inside an overlap, so no word is cut in half where a pause is near.  No torch.
* ``features``: Granite Speech's log-mel features (80 mels, 100 frames/s, pairs stacked
  to 160 dims at 50 Hz) computed with torch, and the number of audio tokens a
  recording becomes.

The model family that consumes the features lives in the data plane
(``specserve.executor.models.granite_speech``); the doors that receive files live in
``specserve.server.audio`` and ``specserve.llm``.
"""

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

SAMPLE_RATE = 16000


@dataclass(eq=False)
class AudioClip:
    """One recording (or one segment of a long one) as a request carries it
    (``SamplingParams.audio``): float32 mono samples at 16 kHz.  ``digest`` keys the
    prefix cache: requests share cached audio rows only for the same samples."""

    samples: np.ndarray = field(repr=False)

    @property
    def duration_s(self) -> float:
        return len(self.samples) / SAMPLE_RATE

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.samples, dtype=np.float32).tobytes()).hexdigest()[:32]
