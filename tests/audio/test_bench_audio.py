"""``specserve-bench bench.dataset=audio`` on a tiny speech model: one run gives WER, RTFx
and the stage counts of plain decoding, ctc exact and ctc relaxed, and ctc exact's
transcripts equal plain decoding's (the figures' values are not asserted: no clocks)."""

from __future__ import annotations

import json

import numpy as np

from specserve.audio.decode import encode_wav
from specserve.bench_audio import load_dataset, wer
from specserve.cli import bench_main
from tests.engine_utils import one_thread  # noqa: F401
from tests.tiny_models import make_tiny_speech_model


def test_wer_normalises_both_sides():
    assert wer(["Hello, World!"], ["hello world"]) == 0.0
    assert wer(["a b c d"], ["a x c"]) == 0.5


def _bench(tmp_path, seconds: tuple[float, ...], seed: int, *extra: str) -> tuple[str, dict]:
    """A tiny speech model and a directory of noise recordings; the audio bench's report."""
    d = make_tiny_speech_model(tmp_path / "m", "granite", seed=3)
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(seed)
    for i, s in enumerate(seconds):
        (data / f"r{i}.wav").write_bytes(encode_wav((0.2 * rng.standard_normal(int(s * 16000))).astype(np.float32)))
        (data / f"r{i}.txt").write_text(f"w{i} w{i + 1}\n")
    out = tmp_path / "bench.json"
    rc = bench_main([f"model.path={d}", "model.dtype=float32", "bench.dataset=audio", f"bench.audio_dir={data}",
                     f"bench.output={out}", "engine.num_kv_blocks=256", "engine.block_size=4",
                     "engine.speculation=fixed", *extra])
    assert rc == 0
    return str(data), json.loads(out.read_text())


def test_audio_bench_writes_every_run(tmp_path):
    data, report = _bench(tmp_path, (0.8, 1.4), 0, "bench.interleave=true")
    assert [n for n, _, _ in load_dataset(data, 0)] == ["r0.wav", "r1.wav"]
    assert set(report["runs"]) == {"plain", "ctc_exact", "ctc_relaxed"}
    for run in report["runs"].values():
        assert run["rtfx"] > 0 and 0 <= run["wer"]
    assert report["runs"]["ctc_exact"]["texts_differing_from_plain"] == 0
    assert sum(report["runs"]["ctc_exact"]["ctc_stages"].values()) == 2
    assert report["config"]["audio_seconds"] == 2.2 and len(report["transcripts"]) == 2
    # the tiny model declares no calibrated gate and none is configured: IBM's
    assert report["config"]["ctc_entropy_gate"]["ctc_relaxed"] == {"nats": 0.7, "from": "default"}


def test_ctc_ceiling_drafts_plain_decodings_own_transcript(tmp_path):
    """bench.ctc_ceiling: a fourth run whose hypotheses are plain decoding's tokens; every
    draft is accepted and the transcripts are plain decoding's."""
    _, report = _bench(tmp_path, (0.7, 1.9), 1, "bench.ctc_ceiling=true")
    run = report["runs"]["ctc_ceiling"]
    assert run["texts_differing_from_plain"] == 0
    assert run["draft_tokens"] > 0 and run["accepted_tokens"] == run["draft_tokens"]
    assert report["runs"]["ctc_exact"]["accepted_tokens"] < run["accepted_tokens"]
    assert [t["ctc_ceiling"] for t in report["transcripts"]] == [t["plain"] for t in report["transcripts"]]
