"""``specserve-bench bench.dataset=audio``: speech recognition figures of a speech model, in
ONE process, on the same recordings: plain decoding, ``+method=ctc`` exact and ``ctc``
relaxed (the configured ctc options, or the presets'), each transcribing every recording.

Recordings: ``bench.audio_dir`` (default: the repository's held-out fixtures,
``tests/fixtures/speech``), either ``transcripts.jsonl`` (``{"file", "text"}`` per line) or
``NAME.wav`` / ``.flac`` / ``.ogg`` / ``.mp3`` beside ``NAME.txt``.  ``bench.num_prompts``
caps how many (0 or less: all).

Per run: WER (jiwer, over the corpus; references and hypotheses both normalised by
``audio.text.normalize_transcript``: lower case, letters and apostrophes, single
spaces), RTFx (seconds of audio / seconds of wall time, encoder and every LLM step
included, one recording at a time), the ctc stage counts, draft and accepted tokens, and
for the ctc runs how many transcripts differ from plain decoding's.  ``bench.ctc_ceiling``
adds ``ctc_ceiling``: ctc exact whose hypothesis is plain decoding's own transcript of the
recording (from an untimed pass first), the speed-up a perfect CTC draft would give here.  With
``bench.interleave=true`` (the default here) the runs take turns recording by recording,
rotating which goes first, so a shared machine's drift slows them alike.  One warm-up
recording per run first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any

import torch

from specserve.audio.decode import Audio, decode_audio
from specserve.audio.offline import transcribe_recordings
from specserve.audio.text import normalize_transcript
from specserve.audio.transcription import TranscriptionOptions
from specserve.config import Config
from specserve.engine.engine import LLMEngine
from specserve.errors import ConfigError
from specserve.executor.loader import load_model, resolve_device
from specserve.methods import method_options

log = logging.getLogger(__name__)

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")


def default_audio_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "speech"


def load_dataset(directory: str | None, limit: int) -> list[tuple[str, Audio, str]]:
    """(name, recording, reference text) of the benchmark's recordings."""
    d = Path(directory) if directory else default_audio_dir()
    if not d.is_dir():
        raise ConfigError("bench.audio_dir", f"{d} is not a directory")
    items: list[tuple[str, Path, str]] = []
    index = d / "transcripts.jsonl"
    if index.is_file():
        for line in index.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                items.append((row["file"], d / row["file"], row["text"]))
    else:
        for f in sorted(d.iterdir()):
            if f.suffix.lower() in AUDIO_SUFFIXES and f.with_suffix(".txt").is_file():
                items.append((f.name, f, f.with_suffix(".txt").read_text().strip()))
    if not items:
        raise ConfigError("bench.audio_dir", f"{d} holds no recordings (transcripts.jsonl, or NAME.wav + NAME.txt)")
    if limit > 0:
        items = items[:limit]
    return [(name, decode_audio(path.read_bytes(), "bench.audio_dir"), text) for name, path, text in items]


def wer(refs: list[str], hyps: list[str]) -> float:
    import jiwer

    r = [normalize_transcript(x) or "<empty>" for x in refs]
    h = [normalize_transcript(x) for x in hyps]
    return float(jiwer.wer(r, h))


def _perfect_hypotheses(eng: LLMEngine, plain_ids: dict[int, list[int]]) -> None:
    """Make ``eng``'s CTC hypotheses plain decoding's token ids of the same segment of a
    recording (keyed by its number of samples; segments of one length share one)."""
    proposer = eng.proposer
    real = proposer.hypothesis

    def hypothesis(seq: Any, ctc_log_probs: torch.Tensor) -> Any:
        h = real(seq, ctc_log_probs)
        ids = plain_ids.get(len(seq.params.audio.samples))
        if ids is not None:
            h.token_ids, h.text = list(ids), eng.tokenizer.decode(ids)
        return h

    proposer.hypothesis = hypothesis


def _engines(cfg: Config, target: Any) -> dict[str, LLMEngine]:
    k = 32
    exact_kw: dict[str, Any] = {}
    relaxed_kw: dict[str, Any] = {"ctc_acceptance": "relaxed"}
    m = cfg.method
    if m is not None and m.method == "ctc":
        k = m.num_speculative_tokens or k
        exact_kw.update(ctc_spelling=m.ctc_spelling)
        relaxed_kw.update(ctc_entropy_threshold=m.ctc_entropy_threshold, ctc_spelling=m.ctc_spelling,
                          ctc_confidence_threshold=m.ctc_confidence_threshold, ctc_fallback=m.ctc_fallback)
    runs = {
        "plain": None,
        "ctc_exact": method_options("ctc", num_speculative_tokens=k, **exact_kw),
        "ctc_relaxed": method_options("ctc", num_speculative_tokens=k, **relaxed_kw),
    }
    if cfg.bench.ctc_ceiling:
        runs["ctc_ceiling"] = method_options("ctc", num_speculative_tokens=k, **exact_kw)
    out = {}
    for name, spec in runs.items():
        c = dataclasses.replace(cfg, method=spec)
        if spec is not None:
            spec.validate()
        out[name] = LLMEngine(c, target=target)
    return out


def run_audio_bench(cfg: Config) -> int:
    b = cfg.bench
    device = resolve_device(cfg.engine.device)
    if cfg.engine.num_threads is not None:
        torch.set_num_threads(cfg.engine.num_threads)
    m = cfg.model
    target = load_model(m.path, m.dtype, device, m.max_model_len, m.cache_dir, cpu_kernel=cfg.engine.cpu_kernel)
    if target.speech is None:
        raise ConfigError("bench.dataset", f"audio needs a speech model; {m.path} is a text model")
    data = load_dataset(b.audio_dir, b.num_prompts)
    engines = _engines(cfg, target)
    opts = TranscriptionOptions()
    log.info("audio bench: %d recordings (%.1f s), runs %s, dtype %s", len(data),
             sum(a.duration_s for _, a, _ in data), ", ".join(engines), target.dtype)
    for eng in engines.values():  # warm-up
        transcribe_recordings(eng, [data[0][1]], opts)
    if "ctc_ceiling" in engines:
        plain_ids = {}
        # untimed: plain decoding's tokens, the perfect drafts, on an engine of its own (the
        # timed engines' prefix caches must not hold these recordings already)
        ref = LLMEngine(dataclasses.replace(cfg, method=None), target=target)
        eos = set(ref.tokenizer.eos_token_ids)
        for _, audio, _ in data:
            [tr] = transcribe_recordings(ref, [audio], opts)
            for seg in tr.segments:
                ids = list(seg.token_ids)
                while ids and ids[-1] in eos:
                    ids.pop()
                plain_ids[seg.end - seg.start] = ids
        del ref
        _perfect_hypotheses(engines["ctc_ceiling"], plain_ids)
    names = list(engines)
    results: dict[str, dict[str, Any]] = {n: {"texts": [], "wall_s": 0.0, "stages": {}, "drafted": 0, "accepted": 0}
                                          for n in names}
    for i, (_, audio, _) in enumerate(data):
        order = names[i % len(names):] + names[: i % len(names)] if b.interleave else names
        for n in order:
            t0 = time.perf_counter()
            [tr] = transcribe_recordings(engines[n], [audio], opts)
            r = results[n]
            r["wall_s"] += time.perf_counter() - t0
            r["texts"].append(tr.text)
            r["drafted"] += tr.num_draft_tokens
            r["accepted"] += tr.num_accepted_tokens
            for k, v in tr.ctc_stages.items():
                r["stages"][k] = r["stages"].get(k, 0) + v
    audio_s = sum(a.duration_s for _, a, _ in data)
    refs = [t for _, _, t in data]
    report: dict[str, Any] = {
        "config": {"model": m.path, "dtype": str(target.dtype).removeprefix("torch."), "device": str(device),
                   "num_recordings": len(data), "audio_seconds": round(audio_s, 3),
                   "audio_dir": str(b.audio_dir or default_audio_dir()), "interleave": b.interleave,
                   "num_threads": cfg.engine.num_threads, "platform": platform.platform(),
                   "wer_normalization": "specserve.audio.text.normalize_transcript (lower case; letters a-z, "
                                        "apostrophes and single spaces)",
                   "ctc": {n: dataclasses.asdict(e.cfg.method) if e.cfg.method is not None else None
                           for n, e in engines.items()},
                   # the gate relaxed mode used: configured, the model's calibrated one, or IBM's
                   "ctc_entropy_gate": {n: {"nats": e.proposer.entropy_threshold,
                                            "from": e.proposer.entropy_threshold_source}
                                        for n, e in engines.items() if n != "plain"}},
        "runs": {},
    }
    plain_texts = results["plain"]["texts"]
    for n in names:
        r = results[n]
        run = {"wer": round(wer(refs, r["texts"]), 4), "rtfx": round(audio_s / r["wall_s"], 3),
               "wall_s": round(r["wall_s"], 3), "ctc_stages": r["stages"], "draft_tokens": r["drafted"],
               "accepted_tokens": r["accepted"]}
        if n != "plain":
            run["texts_differing_from_plain"] = sum(a != b_ for a, b_ in zip(r["texts"], plain_texts))
            run["rtfx_vs_plain"] = round(results["plain"]["wall_s"] / r["wall_s"], 3)
            if run["wer"] and report["runs"].get("plain", {}).get("wer"):
                run["wer_relative_to_plain"] = round(run["wer"] / report["runs"]["plain"]["wer"] - 1, 4)
        report["runs"][n] = run
    report["transcripts"] = [{"file": name, "reference": ref, **{n: results[n]["texts"][i] for n in names}}
                             for i, (name, _, ref) in enumerate(data)]
    out = Path(b.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for n in names:
        r = report["runs"][n]
        extra = f"  x{r['rtfx_vs_plain']} plain's RTFx, {r['texts_differing_from_plain']} texts differ" \
            if n != "plain" else ""
        print(f"{n:12s} WER {r['wer'] * 100:6.2f}%  RTFx {r['rtfx']:7.2f}  stages {r['ctc_stages']}{extra}")
    print(f"wrote {out}")
    return 0
