"""scripts/speech_gate_calibration.py on a tiny speech model: the curve's WER at each
threshold is relaxed mode's rule applied to its rows, the chosen threshold is the largest
within the tolerance, ``--write`` stores it in the model's config.json, and a relaxed
engine then uses it (``method.ctc_entropy_threshold`` left null) unless the config says
otherwise."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jiwer
import numpy as np
import pytest

from specserve.llm import LLM
from tests.engine_utils import one_thread  # noqa: F401
from tests.tiny_models import make_tiny_speech_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "speech_gate_calibration.py"


def _script():
    spec = importlib.util.spec_from_file_location("speech_gate_calibration", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _validation_npz(path: Path, n_train: int, texts: list[str], seed: int) -> None:
    """A trainer's data file: int16 samples of every recording, offsets, texts; the
    recordings past num_train are the validation ones."""
    rng = np.random.default_rng(seed)
    clips = [(0.2 * rng.standard_normal(int(rng.uniform(0.6, 1.6) * 16000)) * 32767).astype(np.int16)
             for _ in texts]
    offsets = np.cumsum([0] + [len(c) for c in clips])
    np.savez(path, samples=np.concatenate(clips), offsets=offsets, texts=np.asarray(texts), num_train=n_train)


def test_calibration_chooses_the_largest_gate_within_the_tolerance_and_writes_it(tmp_path):
    model = make_tiny_speech_model(tmp_path / "m", "llama", seed=4)
    data = tmp_path / "data.npz"
    texts = ["a b", "c"] + [" ".join("abcdefghijklmnop"[i:i + k]) for i, k in zip(range(8), (1, 2, 3, 1, 2, 3, 2, 1))]
    _validation_npz(data, 2, texts, 0)
    out = tmp_path / "cal.json"
    _script().main(["--model", str(model), "--out", str(out), "--within", "0.5", "--write", str(data)])
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert len(rows) == 8 and [r["ref"] for r in rows] == texts[2:]  # the validation recordings only
    refs = [r["ref"] for r in rows]
    plain = jiwer.wer(refs, [r["plain"] for r in rows])
    assert res["plain_wer"] == round(plain, 4)
    within = []
    for c in res["curve"]:  # relaxed mode's rule: the CTC answer where the gate settles, plain's elsewhere
        hyp = [r["spelt"] if r["max_entropy"] <= c["threshold"] else r["plain"] for r in rows]
        assert c["wer"] == round(jiwer.wer(refs, hyp), 4)
        assert c["settled"] == sum(r["max_entropy"] <= c["threshold"] for r in rows)
        if jiwer.wer(refs, hyp) <= plain * 1.5:
            within.append(c["threshold"])
    assert res["largest_threshold_within"] == max(within)
    cfg = json.loads((model / "config.json").read_text())["specserve"]
    assert cfg["ctc_entropy_threshold"] == max(within)
    assert cfg["ctc_entropy_threshold_calibration"]["recordings"] == 8
    # a relaxed engine takes the model's gate; a configured one wins
    llm = LLM(str(model), speculative_config={"method": "ctc", "num_speculative_tokens": 4, "ctc_acceptance": "relaxed"},
              num_kv_blocks=64, dtype="float32")
    assert llm.engine.proposer.entropy_threshold == max(within)
    assert llm.engine.proposer.entropy_threshold_source == "model"
    llm = LLM(str(model), speculative_config={"method": "ctc", "num_speculative_tokens": 4, "ctc_acceptance": "relaxed",
                                              "ctc_entropy_threshold": 0.25}, num_kv_blocks=64, dtype="float32")
    assert llm.engine.proposer.entropy_threshold == 0.25


def test_write_needs_a_model_directory(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _script().main(["--model", "smollm2-135m-speech", "--out", str(tmp_path / "x.json"), "--write", "d.npz"])
    assert "--write needs --model to be a model directory" in capsys.readouterr().err
