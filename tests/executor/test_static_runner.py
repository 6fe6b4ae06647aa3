"""The persistent-buffer step runner (the CUDA data path) checked on the CPU, with the
paged-attention kernel's torch twin:

* its logits equal the eager CPU runner's for prefill, decode, padded uniform
  verification and ragged mixed steps over shuffled block tables;
* its step function compiles with ``torch.compile(fullgraph=True)`` (a graph break
  would mean a host synchronisation or a data-dependent shape: what a CUDA graph
  cannot hold) and gives the same logits compiled as eager;
* it makes no host synchronisation (.item/.tolist/bool/int of a tensor) inside a step;
* an engine driving it with padded uniform verification steps (what CUDA graphs
  replay) gives greedy output equal to plain decoding, with every KV block freed.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import greedy, random_prompts, run, tiny_config

from specserve.engine.engine import LLMEngine
from specserve.executor.batch import SeqInput, StepBatch
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import load_model
from specserve.executor.backends.cuda_graphs import CudaGraphRunner
from specserve.executor.backends.torch_backend import TorchRunner
from specserve.executor.static_runner import StaticStepRunner, batch_buckets

BS = 4


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_model(str(tiny_llama), "float32", torch.device("cpu"), max_model_len=128)


def make_kv(model, blocks=64):
    a = model.arch
    return KVCache(a.num_layers, blocks, BS, a.num_kv_heads, a.head_dim, model.dtype, model.device)


def steps():
    """(inputs per step) for three sequences over shuffled block tables."""
    g = torch.Generator().manual_seed(0)
    tables = [[7, 2, 11, 5, 9], [3, 14, 1, 8, 12], [6, 0, 13, 4, 10]]
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (9, 5, 14)]
    out = []
    # 1. mixed: a fresh prefill, a prefill chunk, another fresh prefill
    out.append([SeqInput(prompts[0], 0, tables[0], [8]), SeqInput(prompts[1][:3], 0, tables[1], []),
                SeqInput(prompts[2], 0, tables[2], [13])])  # fmt: skip
    # 2. ragged: the rest of a chunk next to decodes
    out.append([SeqInput([17], 9, tables[0], [0]), SeqInput(prompts[1][3:], 3, tables[1], [1]),
                SeqInput([23], 14, tables[2], [0])])  # fmt: skip
    # 3. verification with different draft counts (padded to a uniform q below)
    out.append([SeqInput([31, 40, 41, 42], 10, tables[0], [0, 1, 2, 3], 3), SeqInput([33], 5, tables[1], [0]),
                SeqInput([35, 50], 15, tables[2], [0, 1], 1)])  # fmt: skip
    return out


def test_static_runner_matches_the_eager_runner(model):
    eager = TorchRunner(model, make_kv(model))
    kv = make_kv(model)
    static = StaticStepRunner(model, kv, max_num_seqs=4, max_num_tokens=64, graph_query_lens=(1, 4),
                              attention_impl="torch", use_graphs=False)  # fmt: skip
    for i, inputs in enumerate(steps()):
        ref = eager.forward(inputs)
        pad = 4 if i == 2 else None
        batch = StepBatch.from_inputs(inputs, BS, pad_to=pad, trash_slot=kv.trash_slot, max_position=127)
        got = static.run(batch)
        if pad is None:
            torch.testing.assert_close(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
        else:  # uniform: logits of every row; the real ones are the first len(inputs[b]) of each q
            assert batch.uniform_query_len() == 4 and static.graph_key(batch) == (4, 4)
            real = torch.cat([got.logits[b * 4 + torch.tensor(s.logits_offsets)] for b, s in enumerate(inputs)])
            torch.testing.assert_close(real, ref.logits, rtol=1e-4, atol=1e-4)
    # padding never wrote a real slot: only the trash block differs from zero beyond the used slots
    used = {t * BS + o for s in steps() for t in s[0].block_table for o in range(BS)}
    assert kv.trash_slot not in used


def _decode_batch(kv, n_seqs, q):
    tables = [[i * 3, i * 3 + 1, i * 3 + 2] for i in range(n_seqs)]
    inputs = [SeqInput([5 + i] * q, 4, tables[i], list(range(q)), q - 1) for i in range(n_seqs)]
    return StepBatch.from_inputs(inputs, BS, pad_to=q, trash_slot=kv.trash_slot, max_position=127)


def test_step_function_has_no_host_sync(model, monkeypatch):
    kv = make_kv(model)
    static = StaticStepRunner(model, kv, max_num_seqs=4, max_num_tokens=64, graph_query_lens=(1, 3),
                              attention_impl="torch", use_graphs=False)  # fmt: skip
    batch = _decode_batch(kv, 3, 3)
    static._stage(batch, 4, 12)  # bucket 4: one padding sequence
    static._upload()

    def forbidden(*a, **k):
        raise AssertionError("host synchronisation inside the step")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    with torch.inference_mode():
        out = static.step_fn(4, 12, 3, None)
    monkeypatch.undo()
    assert out.logits.shape == (12, model.arch.vocab_size) and torch.isfinite(out.logits[:9]).all()


@pytest.mark.timeout(600)
def test_step_function_compiles_without_graph_breaks(model):
    """fullgraph=True raises on any graph break; the compiled step equals the eager one."""
    kv = make_kv(model)
    static = StaticStepRunner(model, kv, max_num_seqs=2, max_num_tokens=32, graph_query_lens=(1, 3),
                              attention_impl="torch", use_graphs=False)  # fmt: skip
    torch._dynamo.reset()
    for n_seqs, q in ((2, 1), (2, 3)):
        batch = _decode_batch(kv, n_seqs, q)
        static._stage(batch, n_seqs, n_seqs * q)
        static._upload()
        snapshot = kv.data.clone()
        with torch.inference_mode():
            eager = static.step_fn(n_seqs, n_seqs * q, q, None).logits.clone()
            kv.data.copy_(snapshot)
            compiled = torch.compile(static.step_fn, fullgraph=True, dynamic=False)
            got = compiled(n_seqs, n_seqs * q, q, None).logits
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_engine_with_padded_uniform_steps_is_lossless(tiny_llama, tiny_draft, method):
    """The engine as it runs on CUDA (every decode/verification step padded to one draft
    length, padding K/V to the trash slot), here on the CPU twin: greedy output equals
    plain decoding and no KV block is left behind."""
    prompts = random_prompts(6, seed=3)
    params = [greedy(20) for _ in prompts]
    want = run(LLMEngine(tiny_config(tiny_llama)), prompts, params)
    cfg = tiny_config(tiny_llama, method, k=3, draft_dir=tiny_draft if method == "draft_model" else None)
    eng = LLMEngine(cfg)
    eng.runner = CudaGraphRunner(StaticStepRunner(eng.target, eng.kv, max_num_seqs=cfg.engine.max_num_seqs,
                                                  max_num_tokens=cfg.engine.max_num_batched_tokens,
                                                  graph_query_lens=(1, 2, 3, 4), attention_impl="torch",
                                                  use_graphs=False))  # fmt: skip
    eng.uniform_steps = True
    seen = []
    orig = eng.runner.static.run

    def spy(batch, device_token_ids=None):
        seen.append(batch.uniform_query_len())
        return orig(batch, device_token_ids)

    eng.runner.static.run = spy
    assert run(eng, prompts, params) == want
    assert any(q is not None and q > 1 for q in seen)  # padded verification steps ran
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_draft_model_loop_on_the_static_runner_feeds_tokens_on_the_device(tiny_llama, tiny_draft):
    """The draft's K-step loop as on CUDA (its argmax fed back through the device buffer,
    one host read at the end; catch-up forwards chunked to the buffer size): greedy
    output equals plain decoding."""
    prompts = random_prompts(5, seed=9)
    params = [greedy(16) for _ in prompts]
    want = run(LLMEngine(tiny_config(tiny_llama)), prompts, params)
    eng = LLMEngine(tiny_config(tiny_llama, "draft_model", k=3, draft_dir=tiny_draft))
    prop = eng.proposer
    prop.runner = CudaGraphRunner(StaticStepRunner(prop.runner.loaded, prop.runner.kv, max_num_seqs=8,
                                                   max_num_tokens=32, graph_query_lens=(1,), attention_impl="torch",
                                                   use_graphs=False))  # fmt: skip
    prop.max_step_tokens = 32  # smaller than the prompts together: the catch-up runs in chunks
    got = run(eng, prompts, params)
    assert got == want
    assert eng.blocks.num_free == eng.blocks.num_blocks
