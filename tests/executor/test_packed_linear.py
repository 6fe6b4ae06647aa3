from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.executor.models.llama import PackedLinear, can_prepack

pytestmark = pytest.mark.skipif(
    not can_prepack(torch.bfloat16, torch.device("cpu")), reason="this CPU has no oneDNN bf16 support"
)


@pytest.mark.parametrize("rows", [1, 2, 6, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_for_decode_batches(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 64, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = PackedLinear(w, b)(x).float()
    # bf16 output rounding: within 1% of the float32 reference.
    assert torch.allclose(out, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_prepacked_model_logits_match_unpacked(tiny_llama):
    from specserve.executor.kv_cache import KVCache
    from specserve.executor.loader import load_model
    from specserve.executor.backends.torch_backend import TorchRunner
    from specserve.executor.batch import SeqInput

    lm = load_model(str(tiny_llama), "bfloat16", torch.device("cpu"))
    ref = load_model(str(tiny_llama), "float32", torch.device("cpu"))
    outs = []
    for m in (lm, ref):
        kv = KVCache(m.arch.num_layers, 8, 4, m.arch.num_kv_heads, m.arch.head_dim, m.dtype, torch.device("cpu"))
        runner = TorchRunner(m, kv)  # the torch path pre-packs bf16 projections
        outs.append(runner.forward([SeqInput(list(range(5, 17)), 0, [0, 1, 2], list(range(12)))]).logits)
    assert isinstance(lm.model.layers[0].qkv_proj, PackedLinear)
    a, b = outs
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert float((a - b).abs().max() / b.abs().max()) < 0.05
