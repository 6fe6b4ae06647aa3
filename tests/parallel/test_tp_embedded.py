"""The embedded SmolLM2-135M-Instruct served with `parallelism=tp2` on the CPU answers the
official openai client exactly as one device does (greedy, float32).

SmolLM2 has 9 attention heads over 3 KV heads: rank 0 holds 2 KV groups (6 heads),
rank 1 one group (3 heads).  Slow: two servers on a real model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import openai
import pytest

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List three colours of the rainbow.",
    "Explain in one sentence why the sky is blue.",
]


def _serve(*overrides: str):
    argv = [sys.executable, "-m", "specserve.cli", "model.dtype=float32", "server.host=127.0.0.1",
            "server.grpc_port=0", "server.http_port=0", *overrides]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    lines: list[str] = []
    port: list[int] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"HTTP on http://[\d.]+:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(600) and port, "".join(lines[-30:])
    return proc, port[0], lines


def _answers(*overrides: str) -> tuple[list[str], dict, float]:
    proc, port, lines = _serve(*overrides)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300)
        model = client.models.list().data[0]
        t0 = time.perf_counter()
        texts = [client.chat.completions.create(model=model.id, temperature=0, max_tokens=48,
                                                messages=[{"role": "user", "content": p}]).choices[0].message.content
                 for p in PROMPTS]  # fmt: skip
        elapsed = time.perf_counter() - t0
        proc.terminate()
        assert proc.wait(60) == 0, "".join(lines[-30:])
        return texts, model.model_extra["parallelism"], elapsed
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_embedded_model_tp2_answers_exactly_as_tp1():
    one, layout1, t1 = _answers()
    two, layout2, t2 = _answers("parallelism=tp2")
    assert layout1 == {"tensor_parallel_size": 1, "draft_tensor_parallel_size": 1}
    assert layout2 == {"tensor_parallel_size": 2, "draft_tensor_parallel_size": 1}
    print(f"\ntp1: {t1:.1f} s, tp2: {t2:.1f} s for {len(PROMPTS)} greedy chat completions of up to 48 tokens")
    for p, a, b in zip(PROMPTS, one, two):
        print(f"{p!r}: {b!r}")
    assert one == two
    # Speculation under TP: n-gram drafts verified by the sharded target, still the same text.
    spec, _, t3 = _answers("parallelism=tp2", "+method=ngram", "method.num_speculative_tokens=4")
    print(f"tp2 + ngram (K=4): {t3:.1f} s")
    assert spec == one
