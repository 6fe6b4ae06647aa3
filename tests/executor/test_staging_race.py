"""Staging that cannot race, checked on the CPU against a device that runs late.

``deferred_device.DeferredDevice`` queues every torch operation and runs it only
when the host must see the device's work (an event wait, a read of tensor data),
so a non-blocking copy reads its pinned host buffer as late as a GPU may.  Under it:

* the double itself: a host write made after a copy was issued lands in the copy,
  and an event wait runs the queue through that event only;
* ``StagingBuffer``: uploads issued back to back with no synchronisation each reach
  the device with their own contents (a buffer is handed out again only after its
  previous copy ran, and the host is never made to wait on the copy it just issued);
* the engine on the persistent-buffer runner: a prompt several times
  ``max_num_batched_tokens`` long, alone (its chunks sample nothing, so no step
  synchronises), gives the eager path's greedy output.
"""

from __future__ import annotations

import torch
from deferred_device import DeferredDevice
from engine_utils import greedy, random_prompts, run, tiny_config

from specserve.engine.engine import LLMEngine
from specserve.executor.staging import StagingBuffer, staging_bytes
from specserve.executor.backends.cuda_graphs import CudaGraphRunner
from specserve.executor.static_runner import StaticStepRunner
from specserve.sampling.sampler import DeviceSampler


def test_the_double_copies_what_the_host_holds_when_the_stream_reaches_the_copy():
    host, dev_buf = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    h = host.numpy()
    dev = DeferredDevice()
    with torch.inference_mode(), dev:
        h[:] = 1
        dev_buf.copy_(host, non_blocking=True)
        seen = dev_buf * 10  # the consumer, queued behind the copy
        done = dev.event()
        done.record()
        after = dev_buf + 1  # queued behind the event
        h[:] = 2  # the host moves on before the stream ran the copy
        done.synchronize()  # runs the copy and the consumer, not what follows the event
        assert len(dev.queue) == 1
        h[:] = 3  # too late for the copy
        assert seen.tolist() == [20] * 4 and after.tolist() == [3] * 4
    assert dev.copies == 1 and dev.waits == 1


def test_staging_buffer_is_rewritten_only_after_its_copy_ran():
    fields = [("x", 3), ("f", (2, 2), torch.float32)]
    plain = StagingBuffer(fields, torch.device("cpu"))  # the CPU data path: the device reads the host buffer
    assert plain.dev is plain.hosts[0] and len(plain.hosts) == 1
    dev = DeferredDevice()
    buf = StagingBuffer(fields, torch.device("cpu"), transfer=dev)
    assert buf.dev is not buf.hosts[0] and len(buf.hosts) == 2
    assert buf.dev.numel() == staging_bytes(fields) == 16 + 16  # 12 bytes of int32 padded to 16, 16 of float32
    reads = []
    with torch.inference_mode(), dev:
        for step in range(6):
            h = buf.acquire()
            h["x"][:] = step
            h["f"][:] = step / 2
            buf.upload()
            reads.append(buf.d["x"] * 1 + buf.d["f"].sum().long())  # (3,) queued: what the step's forward reads
            # slot i's copy is waited for by the upload two steps later, not by the next one
            assert dev.waits == max(step - 1, 0)
        got = [r.tolist() for r in reads]
    assert got == [[s + 2 * s] * 3 for s in range(6)]
    assert dev.copies == 6


def _late_engine(model_dir, dev: DeferredDevice, chunk: int) -> LLMEngine:
    cfg = tiny_config(model_dir)
    cfg.engine.max_num_batched_tokens = chunk
    eng = LLMEngine(cfg)
    eng.runner = CudaGraphRunner(StaticStepRunner(eng.target, eng.kv, max_num_seqs=cfg.engine.max_num_seqs,
                                                  max_num_tokens=chunk, attention_impl="torch", use_graphs=False,
                                                  transfer=dev))  # fmt: skip
    eng.sampler = DeviceSampler(cfg.engine.max_num_seqs, eng.num_spec_tokens, "cpu", vocab_size=eng.target.arch.vocab_size,
                                transfer=dev)  # fmt: skip
    return eng


def test_long_prompt_in_chunks_is_exact_when_the_device_runs_late(tiny_llama):
    """Five prefill chunks of 8 tokens with nothing else decoding: no step samples, so
    nothing synchronises until the last chunk; each chunk's ids, positions and slots
    must still reach its own forward."""
    prompt = random_prompts(1, seed=5, lo=40, hi=41)[0]
    params = [greedy(10)]
    want = run(LLMEngine(tiny_config(tiny_llama)), [prompt], params)  # the eager torch path
    dev = DeferredDevice()
    eng = _late_engine(tiny_llama, dev, chunk=8)
    chunks = []
    orig = eng.runner.static.run
    eng.runner.static.run = lambda batch, ids=None: chunks.append(len(batch.logits_rows)) or orig(batch, ids)
    with dev:
        got = run(eng, [prompt], params)
    assert got == want
    assert chunks[:5] == [0, 0, 0, 0, 1]  # four chunks that sample nothing, then the last one
    assert dev.waits > 0  # the host ran two uploads ahead of the device: the case a race needs
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_speech_prompt_in_chunks_is_exact_when_the_device_runs_late(tmp_path, monkeypatch):
    """A recording's prompt, its audio rows cut across prefill chunks of 8 (given input
    embeddings on the persistent-buffer runner's eager path), with +method=ctc drafting
    the encoder's hypothesis: the eager torch path's greedy output when the device runs late."""
    import numpy as np

    from specserve.audio import AudioClip
    from specserve.audio.features import input_features as features
    from specserve.audio.features import num_audio_tokens
    from specserve.executor import audio_runner
    from specserve.audio.prompt import transcription_prompt
    from specserve.request import SamplingParams
    from tiny_models import SPEECH_AUDIO_TOKEN, make_tiny_speech_model

    d = make_tiny_speech_model(tmp_path / "speech")
    rng = np.random.default_rng(3)
    t = np.arange(int(1.7 * 16000)) / 16000
    samples = (0.3 * np.sin(2 * np.pi * 200 * t * (1 + t)) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    want_eng = LLMEngine(tiny_config(d, "ctc", k=4))
    prompt = transcription_prompt(want_eng.target.tokenizer, SPEECH_AUDIO_TOKEN, num_audio_tokens(len(samples)))
    assert len(prompt) > 24  # several chunks, the audio rows among them

    def params():
        return [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, audio=AudioClip(samples))]

    want = run(want_eng, [prompt], params())
    dev = DeferredDevice()
    cfg = tiny_config(d, "ctc", k=4)
    cfg.engine.max_num_batched_tokens = 8
    eng = LLMEngine(cfg)
    eng.runner = CudaGraphRunner(StaticStepRunner(eng.target, eng.kv, max_num_seqs=cfg.engine.max_num_seqs,
                                                  max_num_tokens=8 + 5, attention_impl="torch", use_graphs=False,
                                                  transfer=dev))  # fmt: skip
    eng.sampler = DeviceSampler(cfg.engine.max_num_seqs, eng.num_spec_tokens, "cpu", vocab_size=eng.target.arch.vocab_size,
                                transfer=dev)  # fmt: skip
    embedded = []
    orig = eng.runner.static.run
    eng.runner.static.run = lambda batch, ids=None: embedded.append(bool(batch.input_embeds)) or orig(batch, ids)

    def host_features(x):  # the log-mel is host work (numpy in, a CPU tensor out) on a GPU machine too
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return features(x)

    with dev, monkeypatch.context() as m:
        m.setattr(audio_runner, "input_features", host_features)
        got = run(eng, [prompt], params())
    assert got == want
    assert sum(embedded) >= 2  # the audio rows reached more than one chunk's forward
    assert dev.waits > 0
    assert eng.blocks.num_free == eng.blocks.num_blocks
