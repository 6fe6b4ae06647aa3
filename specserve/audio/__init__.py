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

SAMPLE_RATE = 16000
