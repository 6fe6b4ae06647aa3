"""``LLM.transcribe``: the offline door of speech models (``specserve.llm.LLM``).

Each recording (a path, the bytes of an audio file, or ``(samples, sample_rate)``) is
decoded and resampled, cut into segments of at most ``audio.max_clip_s``, and every
segment of every recording runs as one engine request (continuous batching across
them); the outputs come back in input order as ``Transcription`` objects: the joined
text, the segments with their times, the seconds of audio, and per segment the
speculative-decoding counters and the +method=ctc stage.  Options as the servers'
(``audio.transcription.TranscriptionOptions``); bad input raises ``InvalidRequestError``
naming the field.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specserve.audio.decode import Audio, decode_audio, to_mono_16k
from specserve.audio.transcription import (
    Segment, TranscriptionOptions, join_texts, max_tokens_for, segment_request, segments_of, stage_counts,
)
from specserve.errors import InvalidRequestError
from specserve.request import SamplingParams

_ids = itertools.count()


@dataclass
class Transcription:
    text: str
    duration_s: float
    segments: list[Segment] = field(default_factory=list)
    ctc_stages: dict[str, int] = field(default_factory=dict)  # segments per +method=ctc stage
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def load_recording(item: Any, max_duration_s: float | None, field_name: str = "audio") -> Audio:
    if isinstance(item, (str, Path)):
        p = Path(item)
        if not p.is_file():
            raise InvalidRequestError(field_name, f"{str(item)[:200]!r} is not a file")
        return decode_audio(p.read_bytes(), field_name, max_duration_s)
    if isinstance(item, (bytes, bytearray, memoryview)):
        return decode_audio(bytes(item), field_name, max_duration_s)
    if isinstance(item, tuple) and len(item) == 2:
        samples, rate = item
        x = to_mono_16k(np.asarray(samples), rate, field_name)
        if max_duration_s is not None and len(x) / 16000 > max_duration_s:
            raise InvalidRequestError(field_name, f"is {len(x) / 16000:.1f} s long; at most {max_duration_s:g} s")
        return Audio(x, int(rate), 1 if np.asarray(samples).ndim == 1 else int(np.asarray(samples).shape[1]))
    raise InvalidRequestError(field_name, "must be a path, the bytes of an audio file, or (samples, sample_rate)")


def transcribe(llm: Any, audio: Any, *, language: str | None = None, prompt: str | None = None,
               temperature: float = 0.0, seed: int | None = None) -> list[Transcription]:
    eng = llm.engine
    speech = eng.target.speech
    if speech is None:
        raise InvalidRequestError("model", f"{eng.info.model_name!r} is not a speech model: it cannot transcribe")
    items = audio if isinstance(audio, list) else [audio]
    opts = TranscriptionOptions(language=language, prompt=prompt, temperature=temperature, seed=seed).check(
        speech.languages)
    recordings = [load_recording(x, eng.cfg.audio.max_duration_s, "audio" if len(items) == 1 else f"audio[{i}]")
                  for i, x in enumerate(items)]
    with llm._lock:  # the engine is single-threaded
        return transcribe_recordings(eng, recordings, opts)


def transcribe_recordings(eng: Any, recordings: list[Audio], opts: TranscriptionOptions) -> list[Transcription]:
    """Every segment of every recording as one request on ``eng`` (an ``LLMEngine`` this
    thread owns), stepped to completion; one ``Transcription`` per recording."""
    speech, cfg = eng.target.speech, eng.cfg.audio
    jobs: list[tuple[int, Segment, list[int], SamplingParams]] = []
    for r, a in enumerate(recordings):
        for seg in segments_of(a.samples, cfg.max_clip_s):
            ids, clip = segment_request(eng.target.tokenizer, speech, a.samples, seg, opts)
            jobs.append((r, seg, ids, SamplingParams(temperature=opts.temperature, seed=opts.seed, audio=clip,
                                                     max_tokens=max_tokens_for(clip.duration_s))))
    base = f"transcribe-{next(_ids)}-{uuid.uuid4().hex[:8]}"
    rids = [f"{base}-{i}" for i in range(len(jobs))]
    added: list[str] = []
    final: dict[str, Any] = {}
    try:
        for rid, (_, _, ids, params) in zip(rids, jobs):
            eng.add_request(rid, ids, params)
            added.append(rid)
        while len(final) < len(rids):
            if not eng.has_unfinished():
                raise RuntimeError("the engine stopped with requests unfinished")
            for out in eng.step():
                if out.finished:
                    final[out.request_id] = out
    except BaseException:
        for rid in added:
            if rid not in final:
                eng.abort_request(rid)
        raise
    for rid, (_, seg, _, _) in zip(rids, jobs):
        out = final[rid]
        if out.failure is not None:
            raise out.failure
        seg.text, seg.token_ids, seg.outputs = out.text, list(out.token_ids), out
    results = []
    for r, a in enumerate(recordings):
        segs = [seg for (i, seg, _, _) in jobs if i == r]
        outs = [s.outputs for s in segs]
        results.append(Transcription(
            text=join_texts([s.text for s in segs]), duration_s=a.duration_s, segments=segs,
            ctc_stages=stage_counts([o.spec.ctc_stage for o in outs]),
            num_draft_tokens=sum(o.spec.num_draft_tokens for o in outs),
            num_accepted_tokens=sum(o.spec.num_accepted_tokens for o in outs),
        ))
    return results
