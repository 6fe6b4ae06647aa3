"""What every transcription door shares (HTTP, gRPC, the offline API): the request's
options and their checks, a recording cut into segments, each segment's prompt, and
the answer's shapes (json, text, verbose_json, srt, vtt).  No torch; no engine.

Options follow OpenAI's ``/v1/audio/transcriptions``: ``language`` (ISO-639-1, checked
against the languages the model declares), ``prompt`` (text placed after the
instruction), ``response_format``, ``temperature`` in [0, 1] (0 = greedy, the default),
``timestamp_granularities[]`` (``segment`` with verbose_json; ``word`` is refused: the
models give no word timings), ``stream`` (json or text).  Each bad value is an
``InvalidRequestError`` naming the field.

Segments: a recording longer than ``audio.max_clip_s`` is cut at low-energy points
(``audio.split``); each segment is one engine request, and their texts join with a space.
A segment's ``max_tokens`` is bounded by its length (``max_tokens_for``: 24 + 12 per
second, far above speech's 3 to 5 tokens a second), so a model that loops stops.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specserve.audio import SAMPLE_RATE, AudioClip
from specserve.audio.features import num_audio_tokens
from specserve.audio.prompt import transcription_prompt
from specserve.audio.split import split_audio
from specserve.errors import InvalidRequestError

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("word", "segment")
MAX_PROMPT_CHARS = 4096
_LANGUAGE = re.compile(r"^[a-z]{2}$")
LANGUAGE_NAMES = {"en": "english", "fr": "french", "de": "german", "es": "spanish", "it": "italian",
                  "pt": "portuguese", "ja": "japanese", "zh": "chinese", "nl": "dutch"}


@dataclass
class TranscriptionOptions:
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    timestamp_granularities: list[str] = field(default_factory=list)
    stream: bool = False
    seed: int | None = None

    def check(self, languages: tuple[str, ...] | None = None) -> "TranscriptionOptions":
        if self.response_format not in RESPONSE_FORMATS:
            raise InvalidRequestError("response_format", f"must be one of {', '.join(RESPONSE_FORMATS)}; "
                                                         f"got {self.response_format!r}")
        if self.language is not None:
            if not isinstance(self.language, str) or not _LANGUAGE.match(self.language):
                raise InvalidRequestError("language", f"must be an ISO-639-1 code like 'en'; got {self.language!r}")
            if languages is not None and self.language not in languages:
                raise InvalidRequestError("language", f"{self.language!r}: this model transcribes "
                                                      f"{', '.join(languages)} only")
        if self.prompt is not None and (not isinstance(self.prompt, str) or len(self.prompt) > MAX_PROMPT_CHARS):
            raise InvalidRequestError("prompt", f"must be a string of at most {MAX_PROMPT_CHARS} characters")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
            raise InvalidRequestError("temperature", f"must be a number in [0, 1]; got {t!r}")
        for g in self.timestamp_granularities:
            if g not in GRANULARITIES:
                raise InvalidRequestError("timestamp_granularities[]", f"must be word or segment; got {g!r}")
            if g == "word":
                raise InvalidRequestError("timestamp_granularities[]", "word timestamps are not available from this "
                                                                       "model; use segment")
        if self.timestamp_granularities and self.response_format != "verbose_json":
            raise InvalidRequestError("timestamp_granularities[]", "needs response_format=verbose_json")
        if self.stream and self.response_format not in ("json", "text"):
            raise InvalidRequestError("stream", f"streams json or text responses, not {self.response_format}")
        return self


@dataclass
class Segment:
    index: int
    start: int  # sample range in the recording
    end: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    outputs: Any = None  # the engine's final RequestOutput

    @property
    def start_s(self) -> float:
        return self.start / SAMPLE_RATE

    @property
    def end_s(self) -> float:
        return self.end / SAMPLE_RATE


def segments_of(samples: np.ndarray, max_clip_s: float) -> list[Segment]:
    return [Segment(i, a, b) for i, (a, b) in enumerate(split_audio(samples, max_clip_s))]


def max_tokens_for(seconds: float) -> int:
    return int(24 + 12 * seconds)


def segment_request(tokenizer: Any, speech: Any, samples: np.ndarray, seg: Segment,
                    opts: TranscriptionOptions) -> tuple[list[int], AudioClip]:
    """(prompt token ids, the segment's clip)."""
    clip = AudioClip(np.ascontiguousarray(samples[seg.start : seg.end]))
    n = num_audio_tokens(len(clip.samples), speech.window_size, speech.downsample_rate)
    ids = transcription_prompt(tokenizer, speech.audio_token_index, n, getattr(speech, "instruction", None),
                               opts.prompt, getattr(speech, "system_prompt", None))
    return ids, clip


def join_texts(texts: list[str]) -> str:
    return " ".join(t.strip() for t in texts if t.strip())


def usage(duration_s: float) -> dict[str, Any]:
    """OpenAI's usage of duration-billed transcription: whole seconds of audio, rounded up."""
    return {"type": "duration", "seconds": int(math.ceil(duration_s))}


def stage_counts(stages: list[str | None]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in stages:
        if s is not None:
            out[s] = out.get(s, 0) + 1
    return out


def _clock(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_srt(segments: list[Segment]) -> str:
    cues = [f"{i}\n{_clock(s.start_s, ',')} --> {_clock(s.end_s, ',')}\n{s.text.strip()}\n"
            for i, s in enumerate((s for s in segments if s.text.strip()), start=1)]
    return "\n".join(cues)


def to_vtt(segments: list[Segment]) -> str:
    cues = [f"{_clock(s.start_s, '.')} --> {_clock(s.end_s, '.')}\n{s.text.strip()}\n"
            for s in segments if s.text.strip()]
    return "WEBVTT\n\n" + "\n".join(cues)


def verbose_json(segments: list[Segment], duration_s: float, language: str | None, temperature: float,
                 extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "task": "transcribe",
        "language": LANGUAGE_NAMES.get(language or "en", language or "english"),
        "duration": round(duration_s, 3),
        "text": join_texts([s.text for s in segments]),
        "segments": [{"id": s.index, "seek": s.start // 160, "start": round(s.start_s, 3), "end": round(s.end_s, 3),
                      "text": s.text.strip(), "tokens": list(s.token_ids), "temperature": temperature,
                      "avg_logprob": 0.0, "compression_ratio": 1.0, "no_speech_prob": 0.0} for s in segments],
        "usage": usage(duration_s),
        **extra,
    }


class DeltaJoiner:
    """Streamed text deltas of consecutive segments whose concatenation is exactly
    ``join_texts`` of the segments' final texts: each segment's leading whitespace dropped,
    its trailing whitespace held back until more of its text comes, one space between
    segments that have text."""

    def __init__(self) -> None:
        self._segment: object = None
        self._held = ""
        self._spoke = False  # some earlier text went out
        self._in_segment = False  # this segment's text has started

    def feed(self, segment: object, text: str) -> str:
        if segment is not self._segment:
            self._segment, self._held, self._in_segment = segment, "", False
        if not self._in_segment:
            text = text.lstrip()
            if not text:
                return ""
            prefix = " " if self._spoke else ""
            self._in_segment = True
        else:
            prefix = self._held
        body = text.rstrip()
        if not body:  # whitespace inside a segment: held with what was held before
            self._held = prefix + text
            return ""
        self._held = text[len(body):]
        self._spoke = True
        return prefix + body
