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


def test_beside_a_text_request_recordings_wait_for_the_credit_one_a_step():
    runner = FakeRunner()
    stage = AudioStage(runner, frames_per_step=3000, frames_beside_text=150)
    for i, s in enumerate([6, 6, 30]):  # 300, 300 and 1500 frames
        stage.submit(_state(f"r{i}", s))
    steps = [[st.request_id for st, _ in stage.run(beside_foreground=True)] for _ in range(16)]
    # 300 frames need two steps' credit each; the 30 s one ten steps'
    assert steps == [[], ["r0"], [], ["r1"]] + [[]] * 9 + [["r2"]] + [[]] * 2
    # a recording over the step budget runs once the credit is full (never starves)
    stage = AudioStage(runner, frames_per_step=1000, frames_beside_text=400)
    stage.submit(_state("long", 30))
    assert [len(stage.run(True)) for _ in range(3)] == [0, 0, 1]
    # nothing in the foreground: the per-step budget alone, and the credit starts again
    for i, s in enumerate([6, 6]):
        stage.submit(_state(f"q{i}", s))
    assert [st.request_id for st, _ in stage.run(True)] == ["q0"]  # 400 frames earned, one a step
    assert [st.request_id for st, _ in stage.run(False)] == ["q1"]
    assert stage.credit == 0
    # 0: no yielding
    stage = AudioStage(runner, frames_per_step=3000, frames_beside_text=0)
    for i, s in enumerate([6, 6]):
        stage.submit(_state(f"z{i}", s))
    assert len(stage.run(True)) == 2


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
    cfg.audio.encoder_frames_beside_text = 0  # the per-step budget alone (yielding: below)
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


def test_speech_work_yields_to_a_decoding_text_request_and_outputs_are_unchanged(tmp_path):
    """Beside a decoding text request each step carries at most one encoder pass and
    ``audio.tokens_beside_text`` tokens of requests with recordings; every output
    (greedy) equals the run without yielding, and nothing is left in the KV cache."""
    import torch

    from specserve.audio.features import num_audio_tokens
    from specserve.audio.prompt import transcription_prompt
    from specserve.config import Config, ModelConfig, validate_config
    from specserve.engine.engine import LLMEngine
    from specserve.executor.loader import load_model
    from specserve.request import SamplingParams
    from tests.tiny_models import SPEECH_AUDIO_TOKEN, make_tiny_speech_model

    d = make_tiny_speech_model(tmp_path / "m", "granite", seed=4)
    loaded = load_model(str(d), "float32", torch.device("cpu"))
    rng = np.random.default_rng(1)
    clips = [AudioClip((0.1 * rng.standard_normal(int(s * 16000))).astype(np.float32)) for s in (6, 3, 8)]

    def run(frames: int, tokens: int, alone: int = 0, period: int = 1):
        cfg = Config(model=ModelConfig(name="t", path=str(d), dtype="float32"))
        cfg.engine.num_kv_blocks = 512
        cfg.engine.block_size = 4
        cfg.audio.encoder_frames_beside_text = frames
        cfg.audio.tokens_beside_text = tokens
        cfg.audio.tokens_per_step = alone
        cfg.audio.yield_period = period
        cfg.audio.encoder_frames_per_step = 3000
        eng = LLMEngine(validate_config(cfg), target=loaded)
        steps: list[dict] = []
        schedule, encode = eng.scheduler.schedule, eng.speech.runner.encode

        def scheduled():
            out = schedule()
            steps[-1]["text_decodes"] = any(i.seq.request_id == "text" and i.seq.num_uncomputed == 1
                                            for i in out.scheduled)
            steps[-1]["audio_tokens"] = sum(i.num_new_tokens + i.draft_room for i in out.scheduled if i.seq.background)
            return out

        def counting(samples):
            steps[-1]["encoded"] += 1
            return encode(samples)

        eng.scheduler.schedule, eng.speech.runner.encode = scheduled, counting
        eng.add_request("text", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        outs: dict[str, list[int]] = {}
        while eng.has_unfinished():
            if len(steps) == 2:  # the recordings arrive while the text request decodes
                for i, clip in enumerate(clips):
                    ids = transcription_prompt(loaded.tokenizer, SPEECH_AUDIO_TOKEN,
                                               num_audio_tokens(len(clip.samples)))
                    eng.add_request(f"a{i}", ids,
                                    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, audio=clip))
            steps.append({"encoded": 0})
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert eng.blocks.usage == 0
        return outs, steps

    free, _ = run(0, 0)
    yielded, steps = run(150, 16, alone=64)
    assert yielded == free and sorted(free) == ["a0", "a1", "a2", "text"]
    beside = [s for s in steps if s.get("text_decodes")]
    assert len(beside) == 23  # every decode step of the text request
    assert all(s["audio_tokens"] <= 16 and s["encoded"] <= 1 for s in beside), beside
    assert all(s.get("audio_tokens", 0) <= 64 for s in steps)
    assert sum(s["encoded"] for s in beside) == 3 and sum(s["audio_tokens"] for s in beside) >= 16
    periodic, steps = run(150, 16, alone=64, period=4)  # the same share, one step in four
    assert periodic == free
    beside = [s for s in steps if s.get("text_decodes")]
    carrying = [s["audio_tokens"] for s in beside if s["audio_tokens"]]
    assert carrying and max(carrying) <= 64 and len(carrying) <= -(-len(beside) // 4) + 1, carrying
    _, unyielded = run(0, 0)
    beside = [s for s in unyielded if s.get("text_decodes")]
    assert max(s["audio_tokens"] for s in beside) > 16 and max(s["encoded"] for s in beside) > 1  # it can fail


def test_yielding_defaults_follow_the_device_and_are_validated():
    from specserve.config import AudioConfig, Config, validate_config
    from specserve.errors import ConfigError

    a = AudioConfig()
    assert a.yielding(cuda=False) == (75, 2, 64) and a.yielding(cuda=True) == (0, 256, 0)
    a.tokens_beside_text, a.tokens_per_step = 0, 0
    assert a.yielding(cuda=False) == (75, 0, 0)  # 0: off, on any device
    cfg = Config()
    cfg.audio.tokens_beside_text = -1
    with pytest.raises(ConfigError, match="audio.tokens_beside_text"):
        validate_config(cfg)
    cfg.audio.tokens_beside_text, cfg.audio.yield_period = None, 0
    with pytest.raises(ConfigError, match="audio.yield_period"):
        validate_config(cfg)
