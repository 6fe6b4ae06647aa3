"""The engine on the GPU data path's real kernels: the persistent-buffer step runner
with the paged-attention and KV-write Triton kernels (run by Triton's interpreter on the
CPU here, compiled on CUDA), padded uniform verification steps and n-gram speculation;
an EAGLE-3 head's eager forwards on the same kernels.  Greedy output must equal plain
decoding on the eager CPU path, every KV block freed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_utils import greedy, head_forwards, random_prompts, run, tiny_config

sys.path.insert(0, str(Path(__file__).parents[1] / "proposers"))

pytest.importorskip("triton")

from specserve.engine.engine import LLMEngine  # noqa: E402
from specserve.executor.backends.cuda_graphs import CudaGraphRunner  # noqa: E402
from specserve.executor.static_runner import StaticStepRunner  # noqa: E402
from specserve.kernels.paged_attention import interpreter_active  # noqa: E402
from eagle_heads import make_bigram_target, write_head  # noqa: E402

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


def test_an_eagle_head_on_the_triton_kernel_drafts_as_on_the_reference(tmp_path, monkeypatch):
    """An EAGLE-3 head's forwards on the paged-attention Triton kernel (what a head runs on
    CUDA: ``RunnerFactory.head_attention``), the long prompt in chunks beside the short
    ones' rows: greedy output equals plain decoding and the head accepts drafts."""
    target = make_bigram_target(tmp_path / "target", leak=0.05)
    head = write_head(tmp_path / "head", "eagle3", oracle=True, aux_ids=[0, 1, 1])
    prompts = random_prompts(1, seed=5, lo=3, hi=6) + random_prompts(1, seed=6, lo=30, hi=31)
    params = [greedy(12) for _ in prompts]
    want = run(LLMEngine(tiny_config(target)), prompts, params)
    cfg = tiny_config(target, "eagle3", k=3, draft_dir=head)
    cfg.engine.max_num_batched_tokens = 16
    eng = LLMEngine(cfg)
    eng.proposer.attention = "triton"
    forwards = head_forwards(monkeypatch)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    assert forwards and {path for path, _, _ in forwards} == {"kernel"}
    assert eng.blocks.num_free == eng.blocks.num_blocks
