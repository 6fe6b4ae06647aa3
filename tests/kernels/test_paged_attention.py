"""The paged-attention and KV-write Triton kernels against their torch twins
(specserve.kernels.paged_attention), and the attention twin against a naive per-query loop.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (see conftest.py), so
shapes stay small; test_triton_aot.py compiles every binary the engine launches for sm_80 and
sm_90 so that compile errors show up on machines without a GPU too.

Every batch is built to catch stray reads and writes: block tables are shuffled and padded,
cache slots outside any context hold NaN, query rows of padding tokens hold NaN, and the
output (and split-KV scratch) starts as a sentinel (NaN scratch) that rows of padding tokens
must keep.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import specserve.kernels.paged_attention as pa  # noqa: E402
from specserve.kernels.paged_attention import (  # noqa: E402
    default_num_splits,
    interpreter_active,
    make_split_scratch,
    paged_attention,
    paged_attention_reference,
    paged_attention_triton,
    write_kv,
    write_kv_reference,
    write_kv_triton,
)

INTERPRETED = interpreter_active()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
IN_PROCESS = DEVICE == "cuda" or INTERPRETED
in_process = pytest.mark.skipif(
    not IN_PROCESS, reason="triton was imported without TRITON_INTERPRET; see test_in_a_fresh_process"
)
REPO = Path(__file__).resolve().parents[2]
SENTINEL = 123.0
PAD_TOKENS = 2  # tokens past query_start_loc[B], as in a CUDA-graph bucket


def make_batch(seed, qlens, ctxs, nh, nkv, hd, block_size, dtype, spare_blocks=3):
    """A ragged batch over a shuffled paged cache.  qlen 0 marks a padding slot (seq_len 0)."""
    g = torch.Generator().manual_seed(seed)
    B = len(qlens)
    nblocks = [math.ceil(c / block_size) for c in ctxs]
    total = sum(nblocks) + spare_blocks
    perm = torch.randperm(total, generator=g)
    poison = int(perm[-1])  # padded table entries point at a NaN block
    max_blocks = max(nblocks) + 2
    tables = torch.full((B, max_blocks), poison, dtype=torch.int32)
    used = torch.zeros(total * block_size, dtype=torch.bool)
    i = 0
    for b, (n, c) in enumerate(zip(nblocks, ctxs)):
        tables[b, :n] = perm[i : i + n]
        i += n
        for p in range(c):
            used[int(tables[b, p // block_size]) * block_size + p % block_size] = True
    S = total * block_size
    k_cache = torch.randn(S, nkv, hd, generator=g)
    v_cache = torch.randn(S, nkv, hd, generator=g)
    k_cache[~used] = float("nan")  # never part of a context: reading it poisons the output
    v_cache[~used] = float("nan")
    T = sum(qlens) + PAD_TOKENS
    q = torch.randn(T, nh, hd, generator=g)
    q[sum(qlens) :] = float("nan")
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor(ctxs, dtype=torch.int32)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return dict(q=to(q.to(dtype)), k_cache=to(k_cache.to(dtype)), v_cache=to(v_cache.to(dtype)),
                block_tables=to(tables), query_start_loc=to(qsl), seq_lens=to(seq_lens)), dict(
        block_size=block_size, scale=hd**-0.5, max_query_len=max(qlens))


def naive_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, *, block_size, scale,
                    sliding_window=None, **_):
    """One query, one head at a time, in float64: the definition the twin must meet."""
    T, nh, hd = q.shape
    group = nh // k_cache.shape[1]
    out = torch.full((T, nh, hd), SENTINEL, dtype=torch.float64)
    qsl, sl, bt = query_start_loc.tolist(), seq_lens.tolist(), block_tables.tolist()
    for b in range(len(sl)):
        qlen = qsl[b + 1] - qsl[b]
        for i in range(qlen):
            p = sl[b] - qlen + i
            keys = [j for j in range(p + 1) if sliding_window is None or p - j < sliding_window]
            slots = [bt[b][j // block_size] * block_size + j % block_size for j in keys]
            for h in range(nh):
                kk = k_cache[slots, h // group].double()  # (n, hd)
                vv = v_cache[slots, h // group].double()
                w = torch.softmax(kk @ q[qsl[b] + i, h].double() * scale, 0)
                out[qsl[b] + i, h] = w @ vv
    return out


# (qlens, ctxs): qlen 1 = decode, 4 = verification of K=3 drafts, 40 = a long chunk over cached
# context, qlen == ctx = a fresh prefill, 0 = a padding sequence slot
MIXED = ([1, 4, 40, 0, 3, 4], [37, 21, 65, 0, 3, 4])
CASES = {
    # name: (qlens, ctxs, nh, nkv, hd, block_size, dtype, window, num_splits, block_q, block_n)
    "gqa_seq_major": (*MIXED, 4, 2, 16, 16, torch.float32, None, 1, None, None),
    "gqa_flat_tiles": (*MIXED, 4, 2, 16, 16, torch.float32, None, 1, 4, 16),
    "gqa_flat_split3_window": (*MIXED, 4, 2, 16, 8, torch.float32, 24, 3, 4, 16),
    "gqa_split2_small_window": (*MIXED, 4, 2, 16, 16, torch.float32, 7, 2, None, 16),
    "mha_hd64_bf16": ([4, 1, 0, 9], [40, 9, 0, 84], 2, 2, 64, 8, torch.bfloat16, None, 1, 4, 16),
    "gqa4_hd128_bf16_split": ([1, 4], [50, 99], 4, 1, 128, 32, torch.bfloat16, None, 2, None, 32),
    "mha_hd32_decode_split4": ([1, 1, 1, 0, 1], [5, 33, 70, 0, 1], 2, 2, 32, 16, torch.float32, None, 4, None, 16),
    "gqa_hd64_window_bf16": ([4, 12], [30, 12], 4, 2, 64, 16, torch.bfloat16, 5, 1, 4, 16),
    "group3_hd24_page64_window": ([1, 4, 13], [37, 21, 65], 6, 2, 24, 64, torch.float32, 9, 1, None, 16),
}


def tolerances(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


def check_padding_rows(out, qlens):
    n = sum(qlens)
    assert bool((out[n:].float() == SENTINEL).all()), "rows of padding tokens were written"
    assert not out[:n].float().isnan().any()


@in_process
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_twin(name):
    qlens, ctxs, nh, nkv, hd, bs, dtype, window, splits, block_q, block_n = CASES[name]
    args, kw = make_batch(list(CASES).index(name), qlens, ctxs, nh, nkv, hd, bs, dtype)
    kw |= dict(sliding_window=window, num_splits=splits)
    ref = paged_attention_reference(**args, **kw, out=torch.full_like(args["q"], SENTINEL))
    scratch = None
    if splits > 1:  # larger than needed and full of NaN, as a reused CUDA-graph buffer may be
        scratch = make_split_scratch(splits + 1, args["q"].shape[0] + 3, nh, hd, DEVICE)
        scratch[0].fill_(float("nan"))
        scratch[1].fill_(float("nan"))
    out = torch.full_like(args["q"], SENTINEL)
    res = paged_attention_triton(**args, **kw, out=out, scratch=scratch, block_q=block_q, block_n=block_n)
    assert res is out
    check_padding_rows(out, qlens)
    check_padding_rows(ref, qlens)
    torch.testing.assert_close(out.float(), ref.float(), **tolerances(dtype))


def test_tile_numbering_covers_both_schemes():
    plan = lambda *a, **k: pa._tile_plan(*a, **k)  # noqa: E731
    # a decode batch: one tile per sequence, numbered sequence-major
    p = plan(64, 64, 32, 8, 128, 1)
    assert not p["FLAT"] and p["num_q_tiles"] == 64 and p["BLOCK_M"] == 16
    # one long chunk among decodes: the flat numbering, bounded by T // BLOCK_Q + B
    p = plan(16 + 512, 17, 32, 8, 128, 512)
    assert p["FLAT"] and p["num_q_tiles"] == (16 + 512) // p["BLOCK_Q"] + 17
    # the test cases above run both
    assert not plan(sum(MIXED[0]) + PAD_TOKENS, 6, 4, 2, 16, 40)["FLAT"]
    assert plan(sum(MIXED[0]) + PAD_TOKENS, 6, 4, 2, 16, 40, block_q=4)["FLAT"]


def twin_vs_naive_cases():
    yield "mixed", make_batch(1, *MIXED, 4, 2, 16, 16, torch.float32), None
    yield "window", make_batch(2, *MIXED, 4, 2, 16, 8, torch.float32), 6
    yield "mha_hd64", make_batch(3, [2, 1, 0, 9], [40, 9, 0, 84], 2, 2, 64, 8, torch.float32), 20


@pytest.mark.parametrize("case", list(twin_vs_naive_cases()), ids=lambda c: c[0])
def test_twin_matches_a_naive_per_query_loop(case):
    _, (args, kw), window = case
    args = {k: v.cpu() for k, v in args.items()}
    want = naive_attention(**args, **kw, sliding_window=window)
    got = paged_attention_reference(**args, **kw, sliding_window=window, out=torch.full_like(args["q"], SENTINEL))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # without max_seq_len it measures the batch; with a loose bound it pads and masks
    loose = paged_attention_reference(**args, **kw, sliding_window=window, max_seq_len=200,
                                      out=torch.full_like(args["q"], SENTINEL))
    torch.testing.assert_close(loose, got, rtol=1e-6, atol=1e-6)


@in_process
def test_persistent_buffers_are_reused_across_calls():
    """A CUDA-graph-style replay: the same out and scratch, new values, same shapes."""
    nh, nkv, hd = 4, 2, 16
    out = torch.full((sum(MIXED[0]) + PAD_TOKENS, nh, hd), SENTINEL, device=DEVICE)
    scratch = make_split_scratch(2, out.shape[0], nh, hd, DEVICE)
    for seed, (qlens, ctxs) in enumerate([MIXED, ([4, 40, 1, 3, 4, 0], [4, 41, 61, 8, 11, 0])]):
        args, kw = make_batch(10 + seed, qlens, ctxs, nh, nkv, hd, 16, torch.float32)
        kw["max_query_len"] = 40
        ref = paged_attention_reference(**args, **kw, out=torch.full_like(out, SENTINEL))
        paged_attention_triton(**args, **kw, num_splits=2, out=out, scratch=scratch, block_q=8, block_n=16)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@in_process
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_the_twin(slot_dtype, dtype):
    g = torch.Generator().manual_seed(7)
    T, nkv, hd, S = 9, 2, 16, 40
    qkv = torch.randn(T, 3 * nkv * hd, generator=g).to(dtype).to(DEVICE)  # k and v as strided views
    k = qkv[:, nkv * hd : 2 * nkv * hd].view(T, nkv, hd)
    v = qkv[:, 2 * nkv * hd :].view(T, nkv, hd)
    slots = torch.randperm(S, generator=g)[:T]
    slots[[1, 4, 8]] = -1  # padding tokens: skipped
    slots = slots.to(slot_dtype).to(DEVICE)
    caches = [torch.randn(S, nkv, hd, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    want = [c.clone() for c in caches]
    write_kv_reference(k, v, *want, slots)
    write_kv_triton(k, v, *caches, slots)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])
    keep = (slots >= 0).cpu()
    assert torch.equal(want[0][slots[keep.to(DEVICE)].long()], k[keep.to(DEVICE)])
    write_kv(k, v, *caches, slots, impl="triton")  # the dispatcher reaches the kernel too
    assert torch.equal(caches[1], want[1])


def test_write_kv_twin_skips_negative_slots_and_casts():
    k = torch.arange(12.0).view(3, 2, 2)
    v = -k
    kc, vc = torch.zeros(4, 2, 2, dtype=torch.bfloat16), torch.zeros(4, 2, 2, dtype=torch.bfloat16)
    write_kv(k, v, kc, vc, torch.tensor([2, -1, 0]))
    assert kc[2].float().tolist() == k[0].tolist() and kc[0].float().tolist() == k[2].tolist()
    assert vc[2].float().tolist() == v[0].tolist()
    assert bool((kc[[1, 3]] == 0).all())


def test_auto_dispatch_runs_the_twin_off_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(pa, "paged_attention_triton", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(pa, "paged_attention_reference", lambda *a, **k: calls.append("torch"))
    args, kw = make_batch(0, [1], [3], 2, 1, 16, 8, torch.float32)
    args = {k: v.cpu() for k, v in args.items()}
    pa.paged_attention(**args, **kw)
    pa.paged_attention(**args, **kw, impl="triton")
    pa.paged_attention(**args, **kw, impl="torch")
    assert calls == ["torch", "triton", "torch"]
    with pytest.raises(ValueError, match="impl"):
        paged_attention(**args, **kw, impl="cuda")


def test_errors_name_the_argument(monkeypatch):
    args, kw = make_batch(0, [1, 2], [3, 5], 4, 2, 16, 8, torch.float32)
    args = {k: v.cpu() for k, v in args.items()}
    q, kc = args["q"], args["k_cache"]
    for change, match in [
        (dict(q=q[0]), "q"),
        (dict(k_cache=kc.double()), "k_cache"),
        (dict(v_cache=args["v_cache"][:, :1]), "v_cache"),
        (dict(k_cache=kc[:, :, :8], v_cache=args["v_cache"][:, :, :8]), "k_cache"),
        (dict(q=torch.randn(q.shape[0], 3, 16)), "num_kv_heads"),
        (dict(block_tables=args["block_tables"].float()), "block_tables"),
        (dict(query_start_loc=args["query_start_loc"][:2]), "query_start_loc"),
        (dict(seq_lens=args["seq_lens"].float()), "seq_lens"),
        (dict(block_size=12), "block_size"),
        (dict(out=torch.empty(1, 4, 16)), "out"),
    ]:
        with pytest.raises(ValueError, match=match):
            paged_attention_reference(**(args | kw | change))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_reference(kc[:3], kc[:3], kc, kc.clone(), torch.zeros(2, dtype=torch.int64))
    if IN_PROCESS:
        with pytest.raises(ValueError, match="num_splits"):
            paged_attention_triton(**args, **kw, num_splits=0)
        with pytest.raises(ValueError, match="scratch"):
            paged_attention_triton(**args, **kw, num_splits=2, scratch=make_split_scratch(1, 8, 4, 16, "cpu"))
        monkeypatch.setattr(pa, "interpreter_active", lambda: False)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            paged_attention_triton(**args, **kw)


def test_default_num_splits():
    # enough programs without splitting, or short contexts: no split
    assert default_num_splits(64, 32, 8, 128, 1, 32768, num_sms=132) == 1
    assert default_num_splits(1, 32, 8, 128, 1, 256, num_sms=132) == 1
    assert default_num_splits(4, 32, 8, 128, 512, 32768, num_sms=132) == 1  # a long chunk has its tiles
    # one long decode: capped at 16
    assert default_num_splits(1, 32, 8, 128, 1, 32768, num_sms=132) == 16
    # capped so that each split keeps >= 256 keys
    assert default_num_splits(1, 32, 8, 128, 1, 1024, num_sms=132) == 4
    for B in (1, 2, 3, 5, 8, 16):
        n = default_num_splits(B, 16, 2, 64, 4, 8192, num_sms=132)
        assert 1 <= n <= 16 and n & (n - 1) == 0


@pytest.mark.skipif(IN_PROCESS, reason="runs the kernel tests in-process")
def test_in_a_fresh_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
