"""The encoder queue: each step encodes recordings in arrival order while their frames fit
the per-step budget (at least one a step); an aborted request leaves the queue; one
recording's failure is its own. On a real engine: a text request keeps stepping while long
recordings wait for their encoder passes, and each step encodes within the budget."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specserve.audio import AudioClip
from specserve.audio.features import num_encoder_frames
from specserve.engine.audio_stage import AudioStage


class FakeRunner:
    def __init__(self, fail_on: int | None = None):
        self.encoded: list[int] = []
        self.fail_on = fail_on

    @staticmethod
    def cost(n: int) -> int:
        return num_encoder_frames(n)

    def encode(self, samples):
        if len(samples) == self.fail_on:
            raise RuntimeError("bad recording")
        self.encoded.append(len(samples))
        return "encoding"


def _state(rid: str, seconds: float):
    clip = AudioClip(np.zeros(int(seconds * 16000), np.float32))
    return SimpleNamespace(request_id=rid, seq=SimpleNamespace(params=SimpleNamespace(audio=clip)))


def test_each_step_encodes_within_the_budget_in_arrival_order():
    runner = FakeRunner()
    stage = AudioStage(runner, frames_per_step=1000)  # 20 s of audio
    for i, s in enumerate([8, 8, 30, 4, 4]):
        stage.submit(_state(f"r{i}", s))
    steps = []
    while len(stage):
        steps.append([st.request_id for st, _ in stage.run()])
    # 8 + 8 s fit; 30 s alone (over the budget, but one a step always runs); 4 + 4 s
    assert steps == [["r0", "r1"], ["r2"], ["r3", "r4"]]


def test_abort_and_failure_are_per_request():
    runner = FakeRunner(fail_on=16000)
    stage = AudioStage(runner, frames_per_step=10_000)
    for i, s in enumerate([2, 1, 3]):
        stage.submit(_state(f"r{i}", s))
    stage.remove("r2")
    done = stage.run()
    assert [st.request_id for st, _ in done] == ["r0", "r1"]
    assert done[0][1] == "encoding" and isinstance(done[1][1], RuntimeError)
    assert len(stage) == 0


def test_a_text_request_keeps_stepping_beside_queued_recordings(tmp_path):
    import torch

    from specserve.audio.features import num_audio_tokens
    from specserve.audio.prompt import transcription_prompt
    from specserve.config import Config, ModelConfig, validate_config
    from specserve.engine.engine import LLMEngine
    from specserve.executor.loader import load_model
    from specserve.request import SamplingParams
    from tests.tiny_models import SPEECH_AUDIO_TOKEN, make_tiny_speech_model

    d = make_tiny_speech_model(tmp_path / "m", "granite", seed=3)
    loaded = load_model(str(d), "float32", torch.device("cpu"))
    cfg = Config(model=ModelConfig(name="t", path=str(d), dtype="float32"))
    cfg.engine.num_kv_blocks = 512
    cfg.engine.block_size = 4
    cfg.audio.encoder_frames_per_step = 600  # 12 s a step
    eng = LLMEngine(validate_config(cfg), target=loaded)
    per_step: list[int] = []
    encode = eng.speech.runner.encode

    def counting(samples):
        per_step[-1] += len(samples)
        return encode(samples)

    eng.speech.runner.encode = counting
    eng.add_request("text", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    rng = np.random.default_rng(0)
    for i in range(3):
        clip = AudioClip((0.1 * rng.standard_normal(10 * 16000)).astype(np.float32))  # 10 s each
        ids = transcription_prompt(loaded.tokenizer, SPEECH_AUDIO_TOKEN, num_audio_tokens(len(clip.samples)))
        eng.add_request(f"a{i}", ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, audio=clip))
    text_tokens = []
    while eng.has_unfinished():
        per_step.append(0)
        for out in eng.step():
            if out.request_id == "text":
                text_tokens.append(len(out.new_token_ids))
    # one 10 s recording a step (two would pass 12 s), and the text request got a token in each
    # of the three steps that encoded one
    assert [n for n in per_step if n] == [160000, 160000, 160000]
    assert all(n >= 1 for n in text_tokens[:3]) and sum(text_tokens) == 12
    assert eng.blocks.usage == 0
