"""The fused CPU decoder (specserve/kernels/cpu_decoder.c) against torch.

Skipped where the kernel cannot run (neither AVX512-BF16 nor AVX2 + FMA +
F16C, or no C compiler); on this project's machines it runs.  An AVX2-only CPU
runs everything here on the AVX2 build; an AVX512 one runs the best build and,
for the matmul tests, the AVX2 build too (SPECSERVE_CPU_ISA=avx2 runs the
whole module on it)."""

from __future__ import annotations

import pytest
import torch

from specserve.errors import ConfigError
from specserve.executor.kv_cache import KVCache
from specserve.executor.loader import load_model
from specserve.executor.backends.factory import RunnerFactory
from specserve.executor.batch import SeqInput
from specserve.kernels.cpu_decoder import (
    KernelUnavailable,
    amx_usable,
    library_isa,
    load_library,
    matmul,
    pack_amx,
)

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def kcache(tmp_path_factory):
    """One kernel build per test module (each build is a few seconds of gcc)."""
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture(scope="module")
def lib(kcache):
    try:
        return load_library(kcache)
    except KernelUnavailable as e:
        pytest.skip(f"fused CPU decoder unavailable here: {e}")


@pytest.fixture(autouse=True)
def _needs_kernel(lib):
    """Every test here skips (with the reason) where the kernel cannot run."""


def _runner(path, cpu_kernel, num_blocks=64, block_size=4, fused_max_tokens=None, cache_dir=None):
    lm = load_model(str(path), "bfloat16", torch.device("cpu"))
    kv = KVCache(lm.arch.num_layers, num_blocks, block_size, lm.arch.num_kv_heads, lm.arch.head_dim,
                 torch.bfloat16, torch.device("cpu"))
    return lm, RunnerFactory(cpu_kernel=cpu_kernel, fused_max_tokens=fused_max_tokens, cache_dir=cache_dir).runner(lm, kv)


def _rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _reference_fp32(path, **kw):
    """transformers in float32 on the bf16-rounded weights: what bf16 weights compute exactly."""
    import transformers as tf

    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return ref


@pytest.fixture(scope="module", params=["simd", "amx", "avx2"])
def path(request, lib, kcache):
    """(library, through AMX): the best build's SIMD GEMV (AVX512-BF16 or AVX2),
    its AMX tiles, and the AVX2 build where the best one is AVX512."""
    if request.param == "amx":
        if not amx_usable(lib):
            pytest.skip("no AMX here")
        return lib, True
    if request.param == "avx2":
        if library_isa(lib) == "avx2":
            pytest.skip("the AVX2 build is this CPU's best: the simd case runs it")
        try:
            return load_library(kcache, "avx2"), False
        except KernelUnavailable as e:
            pytest.skip(f"no AVX2 build here: {e}")
    return lib, False


def _mm(path, x, w, bias=None):
    lib, amx = path
    return matmul(lib, x, w, pack_amx(lib, w) if amx else None, bias)


@pytest.mark.parametrize("M,N,K", [(1, 1, 32), (3, 5, 48), (7, 13, 100), (9, 64, 576), (4, 4, 31), (33, 40, 64), (70, 40, 96)])
def test_matmul_matches_fp64_reference_with_tails(lib, path, M, N, K):
    g = torch.Generator().manual_seed(M * 100 + N)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    bias = torch.randn(N, generator=g)
    ref = x.double() @ w.double().T + bias.double()
    y = _mm(path, x, w, bias)
    assert y.shape == (M, N)
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("K", [576, 100])
def test_matmul_rows_do_not_depend_on_the_batch(lib, path, K):
    """Each row is computed by the same instruction sequence whatever M is: bit-exact."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(75, K, generator=g).bfloat16()
    w = torch.randn(37, K, generator=g).bfloat16()
    full = _mm(path, x, w)
    assert torch.equal(_mm(path, x[40:], w), full[40:])
    for m in (0, 5, 17, 39, 74):
        assert torch.equal(_mm(path, x[m : m + 1], w)[0], full[m])
    assert torch.equal(_mm(path, x[2:8], w), full[2:8])
    assert torch.equal(_mm(path, x[10:30], w), full[10:30])
    assert torch.equal(_mm(path, x[3:6], w), full[3:6])


# The fused attention has register-blocked kernels for head_dim 64 and 128 and a
# generic one for anything else (the shared tiny models have head_dim 16).
HEAD_DIMS = {
    "hd64": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1),  # GQA 2
    "hd128": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=128),  # GQA 4
}


@pytest.fixture(scope="module")
def head_dim_models(tmp_path_factory):
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("head-dims")
    return {
        "hd64": make_tiny_model(root / "hd64", "llama", **HEAD_DIMS["hd64"]),
        "hd128": make_tiny_model(root / "hd128", "qwen3", **HEAD_DIMS["hd128"]),
    }


def _model_path(name, tiny_model_dirs, head_dim_models):
    return head_dim_models[name] if name in head_dim_models else tiny_model_dirs[name]


@pytest.mark.parametrize("arch", ARCHS + list(HEAD_DIMS))
def test_fused_decode_is_at_least_as_accurate_as_torch_bf16(tiny_model_dirs, head_dim_models, kcache, arch):
    """Prefill on the torch path, then decode / verification chunks on the fused path,
    two ragged sequences with non-contiguous block tables; compared with float32
    math on the same bf16 weights."""
    path = _model_path(arch, tiny_model_dirs, head_dim_models)
    _, fused = _runner(path, "fused", fused_max_tokens=8, cache_dir=kcache)
    _, plain = _runner(path, "torch")
    assert fused.fused is not None and plain.fused is None
    ref = _reference_fp32(path)
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 512, (21,), generator=g).tolist()
    b = torch.randint(0, 512, (12,), generator=g).tolist()
    with torch.no_grad():
        ref_a, ref_b = ref(torch.tensor([a])).logits[0], ref(torch.tensor([b])).logits[0]
    ta, tb = [7, 3, 11, 0, 5, 9], [2, 8, 13]
    steps = [
        [SeqInput(a[:14], 0, ta, [13]), SeqInput(b[:6], 0, tb, [5])],  # 20 tokens: torch path
        [SeqInput(a[14:20], 14, ta, list(range(6))), SeqInput(b[6:7], 6, tb, [0])],  # 7: fused
        [SeqInput(a[20:21], 20, ta, [0]), SeqInput(b[7:12], 7, tb, list(range(5)))],  # 6: fused
    ]
    expected = [
        torch.cat([ref_a[13:14], ref_b[5:6]]),
        torch.cat([ref_a[14:20], ref_b[6:7]]),
        torch.cat([ref_a[20:21], ref_b[7:12]]),
    ]
    for step, exp in zip(steps, expected):
        out_f, out_t = fused.forward(step), plain.forward(step)
        err_f, err_t = _rel_err(out_f.logits, exp), _rel_err(out_t.logits, exp)
        assert err_f < 0.03, err_f
        assert err_f <= err_t * 1.25 + 1e-3, (err_f, err_t)
        assert out_f.hidden.dtype == torch.bfloat16 and out_f.logits.dtype == torch.float32


@pytest.mark.parametrize("dims", [{}, HEAD_DIMS["hd64"]], ids=["hd16", "hd64"])
def test_fused_sliding_window_matches_reference(tmp_path, kcache, dims):
    from tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "sw", "mistral", sliding_window=6, **dims)
    _, fused = _runner(path, "fused", fused_max_tokens=4, cache_dir=kcache)
    ref = _reference_fp32(path, attn_implementation="eager")
    ids = list(range(30, 50))
    with torch.no_grad():
        ref_l = ref(torch.tensor([ids])).logits[0]
    fused.forward([SeqInput(ids[:12], 0, list(range(5)), [11])])  # torch path prefill
    for p in range(12, 20, 4):  # fused chunks of 4 with context beyond the window
        out = fused.forward([SeqInput(ids[p : p + 4], p, list(range(5)), [0, 1, 2, 3])])
        assert _rel_err(out.logits, ref_l[p : p + 4]) < 0.03


@pytest.mark.parametrize("model", ["llama", "hd64", "hd128"])
def test_verification_chunk_equals_token_by_token_decoding(tiny_model_dirs, head_dim_models, kcache, model):
    """Batch invariance end to end: K+1 positions verified in one fused forward give
    bit-identical logits to decoding them one at a time, alone or next to another
    sequence; this is what makes bf16 speculation exactly lossless here."""
    path = _model_path(model, tiny_model_dirs, head_dim_models)
    ids = [11, 42, 7, 99, 3, 250, 17, 64, 5, 301, 8, 77, 120, 9]
    other = [5, 6, 7, 8, 9, 10, 11]
    _, r1 = _runner(path, "fused", fused_max_tokens=16, cache_dir=kcache)
    r1.forward([SeqInput(ids[:8], 0, [0, 1, 2, 3], [7])])
    chunk = r1.forward([SeqInput(ids[8:14], 8, [0, 1, 2, 3], list(range(6)))]).logits
    _, r2 = _runner(path, "fused", fused_max_tokens=16, cache_dir=kcache)
    r2.forward([SeqInput(ids[:8], 0, [0, 1, 2, 3], [7])])
    r2.forward([SeqInput(other, 0, [4, 5], [6])])
    other_pos = len(other)
    for i in range(8, 14):
        step = [SeqInput([ids[i]], i, [0, 1, 2, 3], [0])]
        if i % 2:  # a neighbour in some steps only
            step.insert(0, SeqInput([other[i % len(other)]], other_pos, [4, 5, 6], [0]))
            other_pos += 1
        one = r2.forward(step).logits[-1]
        assert torch.equal(one, chunk[i - 8]), i


def test_fused_aux_hidden_states(tiny_llama, kcache):
    _, fused = _runner(tiny_llama, "fused", cache_dir=kcache)
    _, plain = _runner(tiny_llama, "torch")
    ids = list(range(10, 20))
    plain.forward([SeqInput(ids[:6], 0, [0, 1, 2], [5])])
    fused.forward([SeqInput(ids[:6], 0, [0, 1, 2], [5])], aux_layer_ids=(0, 1))
    want = plain.forward([SeqInput(ids[6:], 6, [0, 1, 2], [3])], aux_layer_ids=(0, 1))
    got = fused.forward([SeqInput(ids[6:], 6, [0, 1, 2], [3])], aux_layer_ids=(0, 1))
    assert set(got.aux) == {0, 1}
    assert torch.equal(got.aux[0], want.aux[0])  # embeddings: exact
    assert _rel_err(got.aux[1], want.aux[1]) < 0.03


def test_bad_inputs_are_clear_errors(tiny_llama, kcache):
    _, fused = _runner(tiny_llama, "fused", cache_dir=kcache)
    with pytest.raises(ValueError, match="block table covers 4 positions, needs 6"):
        fused.forward([SeqInput([1, 2], 4, [0], [1])])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fused.forward([SeqInput([1, 512], 0, [0], [1])])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fused.forward([SeqInput([-1], 0, [0], [0])])
    with pytest.raises(ValueError, match="sequence layout"):  # a position beyond the rotary table
        fused.forward([SeqInput([1], 10_000, list(range(2501)), [0])])
    with pytest.raises(ConfigError, match="engine.cpu_kernel"):
        lm = load_model(str(tiny_llama), "float32", torch.device("cpu"))
        kv = KVCache(lm.arch.num_layers, 8, 4, lm.arch.num_kv_heads, lm.arch.head_dim, torch.float32,
                     torch.device("cpu"))
        RunnerFactory(cpu_kernel="fused").runner(lm, kv)


def _bf16_engine(model_dir, tmp_path, method=None, **kw):
    from engine_utils import tiny_config

    from specserve.engine.engine import LLMEngine

    cfg = tiny_config(model_dir, method, **kw)
    cfg.model.dtype = "bfloat16"
    cfg.model.cache_dir = str(tmp_path)
    cfg.engine.cpu_kernel = "fused"
    return LLMEngine(cfg)


@pytest.mark.parametrize("method,kw", [("ngram", {"k": 3}), ("draft_model", {"k": 2})])
def test_bf16_speculation_is_exactly_lossless_on_the_fused_path(tiny_llama, tiny_draft, kcache, lib, method, kw):
    """bf16 on the fused path: speculative greedy output equals plain greedy output
    token for token (no near-tie flips), and every KV block comes back."""
    from engine_utils import greedy, random_prompts, run

    prompts = random_prompts(6, seed=5)
    vanilla = _bf16_engine(tiny_llama, kcache)
    assert vanilla.runner.fused is not None
    want = run(vanilla, prompts, [greedy(24) for _ in prompts])
    if method == "draft_model":
        kw["draft_dir"] = tiny_draft
    eng = _bf16_engine(tiny_llama, kcache, method, **kw)
    outs = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == want
    drafts = sum(o.spec.num_draft_tokens for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert drafts > 0 and 0 < accepted < drafts
    assert eng.blocks.num_free == eng.blocks.num_blocks
    if method == "draft_model":
        assert eng.proposer.runner.fused is not None
        assert eng.proposer.blocks.num_free == eng.proposer.blocks.num_blocks


def test_amx_and_avx512_decoders_agree(tiny_model_dirs, lib):
    """The two matmul back ends of the fused decoder give the same logits up to
    float32 summation order (each is checked against fp64 above)."""
    from specserve.kernels.cpu_decoder import CpuDecoder

    if not amx_usable(lib):
        pytest.skip("no AMX here")
    lm = load_model(str(tiny_model_dirs["qwen2"]), "bfloat16", torch.device("cpu"))
    outs = []
    for use_amx in (False, True):
        kv = KVCache(lm.arch.num_layers, 16, 4, lm.arch.num_kv_heads, lm.arch.head_dim, torch.bfloat16,
                     torch.device("cpu"))
        dec = CpuDecoder(lib, lm.model, kv, lm.max_model_len, use_amx=use_amx)
        ids = list(range(40, 52))
        hidden, _ = dec.forward(ids, [(0, 7, 0), (7, 5, 0)], [[0, 1], [2, 3]])
        outs.append(dec.logits(hidden))
    assert _rel_err(outs[1], outs[0]) < 5e-3


@pytest.mark.parametrize("model", ["llama", "hd64", "hd128"])
def test_fused_prefill_matches_reference_and_is_chunking_invariant(tiny_model_dirs, head_dim_models, kcache, model):
    """Prefill on the fused path too (the default): accurate against float32 math,
    and the logits of a token do not depend on how its prompt was chunked or
    batched (prefill in one 70-token step, or in chunks next to another sequence)."""
    path = _model_path(model, tiny_model_dirs, head_dim_models)
    ref = _reference_fp32(path)
    ids = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(9)).tolist()
    with torch.no_grad():
        ref_l = ref(torch.tensor([ids])).logits[0]
    table = list(range(20))
    _, r1 = _runner(path, "fused", cache_dir=kcache)
    assert r1.fused_max_tokens is None
    one = r1.forward([SeqInput(ids, 0, table, list(range(70)))]).logits
    assert _rel_err(one, ref_l) < 0.03
    _, r2 = _runner(path, "fused", cache_dir=kcache)
    other = list(range(100, 140))
    a = r2.forward([SeqInput(ids[:23], 0, table, list(range(23))), SeqInput(other, 0, [30, 31, 32, 33, 34, 35, 36, 37, 38, 39], [39])])
    b = r2.forward([SeqInput(ids[23:], 23, table, list(range(47)))])
    assert torch.equal(a.logits[:23], one[:23])
    assert torch.equal(b.logits, one[23:])


def test_auto_dtype_is_bf16_only_where_the_fused_decoder_runs(monkeypatch, lib):
    from specserve.executor.loader import resolve_dtype
    from specserve.kernels import cpu_features

    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, "auto") == torch.bfloat16  # this machine: AVX512-BF16 or AVX2, + gcc
    assert resolve_dtype("auto", cpu, "torch") == torch.float32
    assert resolve_dtype("bfloat16", cpu, "torch") == torch.bfloat16  # explicit wins
    monkeypatch.setattr(cpu_features, "find_compiler", lambda: None)
    monkeypatch.setattr(cpu_features, "SOURCE", cpu_features.SOURCE.with_name("no-such-kernel.c"))
    monkeypatch.setattr(cpu_features, "library_name", lambda: "absent.so")
    assert resolve_dtype("auto", cpu, "auto") == torch.float32  # no compiler, no prebuilt library
    monkeypatch.undo()
    monkeypatch.setattr(cpu_features, "cpu_unsupported_reason", lambda: "the CPU lacks avx512_bf16")
    assert resolve_dtype("auto", cpu, "auto") == torch.float32


def test_embedded_smollm2_bf16_on_the_fused_path(kcache):
    """The real embedded model in bf16 on the fused decoder: close to float32 math on
    the same bf16 weights, same greedy choices, and a verification chunk bit-equal to
    decoding token by token."""
    import transformers as tf

    lm = load_model("embedded:smollm2-135m-instruct", "bfloat16", torch.device("cpu"))
    kv = KVCache(lm.arch.num_layers, 16, 16, lm.arch.num_kv_heads, lm.arch.head_dim, torch.bfloat16,
                 torch.device("cpu"))
    runner = RunnerFactory(cpu_kernel="fused", cache_dir=kcache).runner(lm, kv)
    ids = lm.tokenizer("The quick brown fox jumps over the lazy dog because it wanted to")["input_ids"]
    n = len(ids)
    ref = tf.AutoModelForCausalLM.from_pretrained(str(lm.hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        ref_l = ref(torch.tensor([ids])).logits[0]
    head = runner.forward([SeqInput(ids[: n - 5], 0, [0, 1], list(range(n - 5)))]).logits
    chunk = runner.forward([SeqInput(ids[n - 5 :], n - 5, [0, 1], list(range(5)))]).logits
    got = torch.cat([head, chunk])
    assert _rel_err(got, ref_l) < 0.03  # measured 0.011
    assert (got.argmax(-1) == ref_l.argmax(-1)).float().mean() >= 0.8  # measured 12 of 13 (one near-tie)
    kv.data.zero_()
    runner.forward([SeqInput(ids[: n - 5], 0, [0, 1], [n - 6])])
    for i in range(n - 5, n):
        one = runner.forward([SeqInput([ids[i]], i, [0, 1], [0])]).logits[0]
        assert torch.equal(one, chunk[i - (n - 5)])


def test_kernel_threads_follow_torch_in_any_calling_thread(lib):
    """OpenMP keeps the thread count per calling thread: the engine's step thread
    must still get torch's setting (engine.num_threads)."""
    import threading

    seen = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = threading.Thread(target=lambda: seen.append(lib.ss_set_num_threads(torch.get_num_threads())))
        t.start()
        t.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [1]


def test_the_best_build_this_cpu_runs_is_loaded(lib):
    from specserve.kernels import cpu_features

    assert library_isa(lib) == cpu_features.kernel_isa()
    assert not (library_isa(lib) == "avx2" and amx_usable(lib))  # the AVX2 build has no AMX


def test_isa_choice_and_library_names(monkeypatch):
    """AVX512-BF16 where the CPU has it, else AVX2 + FMA + F16C, else none; the two
    builds' libraries have distinct names carrying the ISA."""
    from specserve.kernels import cpu_features as cf

    avx2 = {"avx", "avx2", "fma", "f16c", "sse4_2"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    monkeypatch.setattr(cf.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(cf.ISA_ENV, raising=False)
    for flags, want in [(avx512, "avx512"), (avx2, "avx2"), (avx2 - {"f16c"}, None), (set(), None)]:
        monkeypatch.setattr(cf, "cpu_flags", lambda flags=flags: flags)
        assert cf.kernel_isa() == want
        assert (cf.cpu_unsupported_reason() is None) == (want is not None)
    assert "f16c" in cf.cpu_unsupported_reason()  # the last case: names what AVX2 needs
    monkeypatch.setattr(cf, "cpu_flags", lambda: avx512)
    monkeypatch.setenv(cf.ISA_ENV, "avx2")
    assert cf.kernel_isa() == "avx2" and cf.cflags() == cf.AVX2_CFLAGS
    monkeypatch.setenv(cf.ISA_ENV, "sse2")
    assert "sse2" in cf.cpu_unsupported_reason()
    names = {cf.library_name(isa) for isa in cf.ISAS}
    assert len(names) == 2 and all(f"-{isa}-" in cf.library_name(isa) for isa in cf.ISAS)
    assert "-mavx512bf16" not in cf.AVX2_CFLAGS and "-mavx2" in cf.AVX2_CFLAGS


def test_fused_linear_matches_torch_on_bf16_inputs(lib):
    """FusedLinear (an EAGLE head's projections on the fused kernel) computes
    F.linear of the bf16-rounded input with fp32 accumulation, for any leading shape,
    with and without bias, with an empty batch; fuse_linears swaps only nn.Linear."""
    from torch import nn

    from specserve.kernels.cpu_decoder import FusedLinear, fuse_linears

    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(100, 37, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 3, 100, generator=g).to(torch.bfloat16)
    want = torch.nn.functional.linear(x.float(), lin.weight.float(), lin.bias.float())
    out = FusedLinear(lib, lin)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 37)
    torch.testing.assert_close(out.float(), want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    f32 = FusedLinear(lib, lin, fp32_out=True)(x)
    assert f32.dtype == torch.float32
    torch.testing.assert_close(f32, want, rtol=1e-5, atol=1e-4)
    no_bias = nn.Linear(100, 5, bias=False).to(torch.bfloat16)
    torch.testing.assert_close(FusedLinear(lib, no_bias, fp32_out=True)(x[0]),
                               x[0].float() @ no_bias.weight.float().T, rtol=1e-5, atol=1e-4)
    assert FusedLinear(lib, lin)(x[:0]).shape == (0, 3, 37)

    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4, bias=False))).to(torch.bfloat16)
    assert fuse_linears(net, lib, fp32_out=("2.0",)) == 2
    assert isinstance(net[0], FusedLinear) and isinstance(net[2][0], FusedLinear) and isinstance(net[1], nn.ReLU)
    assert net(torch.randn(3, 8).to(torch.bfloat16)).dtype == torch.float32  # the last one returns fp32


@pytest.mark.parametrize("oracle", [True, False], ids=["oracle-shared-lm-head", "random-own-lm-head"])
def test_eagle3_head_on_the_fused_path_is_lossless(tmp_path, kcache, lib, oracle):
    """bf16 on the fused path with an EAGLE-3 head: the head's projections run on the
    fused kernel, speculative greedy output equals plain greedy output token for
    token, drafts are accepted, and every KV block comes back."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "proposers"))
    from eagle_heads import make_bigram_target, write_head
    from engine_utils import greedy, random_prompts, run

    from specserve.kernels.cpu_decoder import FusedLinear

    target = make_bigram_target(tmp_path / "target", leak=0.05)
    kw = {"oracle": True} if oracle else {"seed": 1, "draft_vocab": 96}
    head = write_head(tmp_path / "head", "eagle3", aux_ids=[0, 1, 1], **kw)
    prompts = random_prompts(6, seed=3)
    want = run(_bf16_engine(target, kcache), prompts, [greedy(24) for _ in prompts])
    eng = _bf16_engine(target, kcache, "eagle3", k=3, draft_dir=head)
    assert eng.runner.fused is not None
    h = eng.proposer.head
    assert isinstance(h.fc, FusedLinear) and isinstance(h.layer.qkv_proj, FusedLinear)
    assert (h.lm_head is None) == oracle and (oracle or isinstance(h.lm_head, FusedLinear))
    outs = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == want
    assert sum(o.spec.num_draft_tokens for o in outs) > 0
    if oracle:
        assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    assert eng.blocks.num_free == eng.blocks.num_blocks


@pytest.mark.parametrize("text", ["llama", "granite"])
def test_speech_prompt_rows_on_the_fused_path(tmp_path, kcache, text):
    """A speech prompt's audio rows (``input_embeds``) run on the fused decoder: its
    logits are as close to float32 math as the torch bf16 path's (Granite's embedding
    multiplier applied to the rows alike), the rows really are read (the placeholder
    token's embedding gives other logits), and cutting the prompt through the audio
    rows does not change a logit."""
    from specserve.audio.features import input_features, num_audio_tokens
    from specserve.audio.prompt import transcription_prompt
    from tests.tiny_models import SPEECH_AUDIO_TOKEN, make_tiny_speech_model

    d = make_tiny_speech_model(tmp_path / "speech", text)
    t = torch.arange(int(1.6 * 16000)) / 16000
    feats = input_features((0.3 * torch.sin(2 * torch.pi * 220 * t * (1 + t))).numpy())
    ref_lm = load_model(str(d), "float32", torch.device("cpu"))
    ids = transcription_prompt(ref_lm.tokenizer, SPEECH_AUDIO_TOKEN, num_audio_tokens(len(t)))
    first = ids.index(SPEECH_AUDIO_TOKEN)
    with torch.no_grad():
        emb, _ = ref_lm.speech.model.audio_embeddings(feats)
    n, table = len(ids), list(range((len(ids) + 3) // 4 + 1))

    def logits(runner, cut=None, rows=True):
        given = [(first, emb)] if rows else None
        if cut is None:
            return runner.forward([SeqInput(ids, 0, table, list(range(n)), input_embeds=given)]).logits
        a = runner.forward([SeqInput(ids[:cut], 0, table, list(range(cut)), input_embeds=[(first, emb[: cut - first])])])
        b = runner.forward([SeqInput(ids[cut:], cut, table, list(range(n - cut)), input_embeds=[(0, emb[cut - first :])])])
        return torch.cat([a.logits, b.logits])

    kv32 = KVCache(ref_lm.arch.num_layers, 64, 4, ref_lm.arch.num_kv_heads, ref_lm.arch.head_dim, torch.float32,
                   torch.device("cpu"))
    from specserve.executor.backends.torch_backend import TorchRunner

    with torch.no_grad():
        for p in ref_lm.model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # what bf16 weights compute exactly
    exact = logits(TorchRunner(ref_lm, kv32))
    _, fused = _runner(d, "fused", cache_dir=kcache)
    _, plain = _runner(d, "torch")
    assert fused.fused is not None
    calls = []
    run = fused.fused.run
    fused.fused.run = lambda ids_, *a, **k: (calls.append(len(ids_)), run(ids_, *a, **k))[1]
    got = logits(fused)
    assert calls == [n]  # the decoder ran the step, not the torch fallback
    err_f, err_t = _rel_err(got, exact), _rel_err(logits(plain), exact)
    assert err_f < 0.03, err_f
    assert err_f <= err_t * 1.25 + 1e-3, (err_f, err_t)
    _, fused2 = _runner(d, "fused", cache_dir=kcache)
    assert torch.equal(logits(fused2, cut=first + emb.shape[0] // 2), got)
    _, fused3 = _runner(d, "fused", cache_dir=kcache)
    assert _rel_err(logits(fused3, rows=False)[-1:], got[-1:]) > 0.05


def test_ctc_exact_equals_plain_decoding_in_bf16_on_the_fused_path(tmp_path, kcache):
    """The speech path in bfloat16 is one numeric path: prompts with audio rows, their
    CTC drafts and the decode steps all run on the fused decoder, so ``ctc`` exact gives
    plain decoding's tokens whatever the hypothesis (edited ones included), beside a
    text request, in chunks of any size, with no block left."""
    import numpy as np

    from specserve.audio import AudioClip
    from specserve.audio.features import num_audio_tokens
    from specserve.audio.prompt import transcription_prompt
    from specserve.config import Config, ModelConfig, validate_config
    from specserve.engine.engine import LLMEngine
    from specserve.methods import method_options
    from specserve.proposers.ctc import CtcHypothesis
    from specserve.request import SamplingParams
    from tests.tiny_models import SPEECH_AUDIO_TOKEN, make_tiny_speech_model

    d = make_tiny_speech_model(tmp_path / "speech", "granite", seed=3)
    loaded = load_model(str(d), "bfloat16", torch.device("cpu"))

    def engine(method=None, chunk=None):
        cfg = Config(model=ModelConfig(name="tiny-speech", path=str(d), dtype="bfloat16", cache_dir=str(kcache)))
        cfg.engine.num_kv_blocks, cfg.engine.block_size, cfg.engine.speculation = 256, 4, "fixed"
        cfg.engine.cpu_kernel = "fused"
        cfg.audio.tokens_per_step = chunk
        if method:
            cfg.method = method_options("ctc", num_speculative_tokens=8)
        eng = LLMEngine(validate_config(cfg), target=loaded)
        assert eng.runner.fused is not None
        return eng

    rng = np.random.default_rng(0)
    clips = [AudioClip((0.2 * rng.standard_normal(int(s * 16000))).astype(np.float32)) for s in (0.9, 2.3)]
    prompts = [transcription_prompt(loaded.tokenizer, SPEECH_AUDIO_TOKEN, num_audio_tokens(len(c.samples)))
               for c in clips] + [[5, 40, 77, 9]]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, audio=c) for c in clips] + \
             [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    want = [o.token_ids for o in engine().generate(prompts, params)]
    for chunk, edit in [(None, lambda t: t[:-1]), (7, lambda t: t[:3] + [99] + t[3:]), (0, lambda t: t[2:])]:
        eng = engine("ctc", chunk)
        hyps = {len(c.samples): edit(want[i]) for i, c in enumerate(clips)}
        eng.proposer.hypothesis = lambda seq, logp: CtcHypothesis("", list(hyps[len(seq.params.audio.samples)]),
                                                                  0.0, False)
        outs = eng.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
        assert sum(o.spec.num_accepted_tokens for o in outs[:2]) > 0
        assert eng.blocks.usage == 0
