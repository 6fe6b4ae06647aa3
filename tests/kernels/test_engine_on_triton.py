"""The engine on the GPU data path's real kernels: the persistent-buffer step runner
with the paged-attention and KV-write Triton kernels (run by Triton's interpreter on the
CPU here, compiled on CUDA), padded uniform verification steps and n-gram speculation.
Greedy output must equal plain decoding on the eager CPU path, every KV block freed."""

from __future__ import annotations

import pytest
import torch
from engine_utils import greedy, random_prompts, run, tiny_config

pytest.importorskip("triton")

from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.executor.backends.cuda_graphs import CudaGraphRunner  # noqa: E402
from specserve.executor.static_runner import StaticStepRunner  # noqa: E402
from specserve.kernels.paged_attention import interpreter_active  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not (interpreter_active() or torch.cuda.is_available()),
                       reason="triton was imported without TRITON_INTERPRET (run tests/kernels on its own)"),
    pytest.mark.timeout(600),
]


def test_engine_with_triton_attention_matches_plain_decoding(tiny_llama):
    prompts = random_prompts(3, seed=5, hi=12)
    params = [greedy(10) for _ in prompts]
    want = run(LLMEngine(tiny_config(tiny_llama)), prompts, params)
    cfg = tiny_config(tiny_llama, "ngram", k=3)
    eng = LLMEngine(cfg)
    eng.runner = CudaGraphRunner(StaticStepRunner(eng.target, eng.kv, max_num_seqs=4, max_num_tokens=64,
                                                  graph_query_lens=(1, 2, 3, 4), attention_impl="triton",
                                                  use_graphs=False))  # fmt: skip
    eng.uniform_steps = True
    assert run(eng, prompts, params) == want
    assert eng.blocks.num_free == eng.blocks.num_blocks
