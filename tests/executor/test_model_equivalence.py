"""specserve's executor against transformers' reference implementation (float32)."""

from __future__ import annotations

import pytest
import torch

from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import load_model
from specserve.executor.backends.torch_backend import TorchRunner
from specserve.executor.batch import SeqInput

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def _setup(path, num_blocks=64, block_size=4):
    lm = load_model(str(path), "float32", torch.device("cpu"))
    kv = KVCache(lm.arch.num_layers, num_blocks, block_size, lm.arch.num_kv_heads, lm.arch.head_dim,
                 torch.float32, torch.device("cpu"))
    return lm, TorchRunner(lm, kv)


def _rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_paged_batch_matches_reference(tiny_model_dirs, arch):
    import transformers as tf

    path = tiny_model_dirs[arch]
    lm, runner = _setup(path)
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, lm.arch.vocab_size, (21,), generator=g).tolist()
    b = torch.randint(0, lm.arch.vocab_size, (9,), generator=g).tolist()
    with torch.no_grad():
        ref_a = ref(torch.tensor([a])).logits[0]
        ref_b = ref(torch.tensor([b])).logits[0]
    # Step 1: two fresh prefills (causal path) in one flattened batch; non-contiguous block tables.
    ta, tb = [7, 3, 11, 0, 5, 9], [2, 8, 13]
    out = runner.forward([SeqInput(a[:13], 0, ta, list(range(13))), SeqInput(b[:4], 0, tb, list(range(4)))])
    assert _rel_err(out.logits[:13], ref_a[:13]) < 1e-4
    assert _rel_err(out.logits[13:], ref_b[:4]) < 1e-4
    # Step 2: a chunk of 8 (verification-like) and single decode tokens against cached context (paged path).
    out = runner.forward([SeqInput(a[13:21], 13, ta, list(range(8))), SeqInput(b[4:5], 4, tb, [0])])
    assert _rel_err(out.logits[:8], ref_a[13:21]) < 1e-4
    assert _rel_err(out.logits[8:], ref_b[4:5]) < 1e-4
    out = runner.forward([SeqInput(b[5:9], 5, tb, [3])])
    assert _rel_err(out.logits, ref_b[8:9]) < 1e-4


def test_aux_hidden_states_are_the_residual_stream_entering_layers(tiny_llama):
    import transformers as tf

    lm, runner = _setup(tiny_llama)
    ref = tf.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = list(range(10, 20))
    with torch.no_grad():
        hs = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states  # hs[i] enters layer i
    out = runner.forward([SeqInput(ids, 0, [0, 1, 2], [9])], aux_layer_ids=(0, 1))
    for i in (0, 1):
        assert _rel_err(out.aux[i], hs[i][0]) < 1e-5


def test_sliding_window_matches_reference(tmp_path):
    import transformers as tf
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "sw", "mistral", sliding_window=6)
    lm, runner = _setup(path)
    assert lm.arch.sliding_window == 6
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = list(range(30, 50))
    with torch.no_grad():
        ref_l = ref(torch.tensor([ids])).logits[0]
    out = runner.forward([SeqInput(ids[:15], 0, list(range(5)), list(range(15)))])
    assert _rel_err(out.logits, ref_l[:15]) < 1e-4
    out = runner.forward([SeqInput(ids[15:], 15, list(range(5)), list(range(5)))])
    assert _rel_err(out.logits, ref_l[15:]) < 1e-4


def test_embedded_smollm2_matches_reference_float32():
    """The real embedded model: GGUF -> specserve executor vs transformers on the same weights."""
    import transformers as tf

    lm = load_model("embedded:smollm2-135m-instruct", "float32", torch.device("cpu"))
    assert (lm.arch.num_layers, lm.arch.hidden_size, lm.arch.vocab_size) == (30, 576, 49152)
    kv = KVCache(lm.arch.num_layers, 16, 16, lm.arch.num_kv_heads, lm.arch.head_dim, torch.float32, torch.device("cpu"))
    runner = TorchRunner(lm, kv)
    ref = tf.AutoModelForCausalLM.from_pretrained(str(lm.hf_dir), dtype=torch.float32).eval()
    ids = lm.tokenizer("The quick brown fox jumps over the lazy dog because")["input_ids"]
    with torch.no_grad():
        ref_l = ref(torch.tensor([ids])).logits[0]
    n = len(ids)
    out = runner.forward([SeqInput(ids[: n - 3], 0, [0], list(range(n - 3)))])
    assert _rel_err(out.logits, ref_l[: n - 3]) < 1e-4
    out = runner.forward([SeqInput(ids[n - 3 :], n - 3, [0], [0, 1, 2])])
    assert _rel_err(out.logits, ref_l[n - 3 :]) < 1e-4
