"""Philox-4x32-10 in torch (specserve.sampling.philox) against independent implementations.

Three references: the published Random123 known-answer vectors, a pure-Python big-integer
Philox written here from the algorithm, and Triton's ``tl.randint4x`` (under Triton's
interpreter on CPU, compiled on a GPU), whose (seed, offset) -> (key, counter) mapping
the stream follows exactly: number i of seed s is word i % 4 of ``tl.randint4x(s, i // 4)``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specserve.sampling.philox import philox4x32_10, philox_uniforms, random_seed, seed_to_int64

REPO = Path(__file__).resolve().parents[2]
M32 = 2**32 - 1

# Random123 kat_vectors, "philox4x32 10" lines: counter (4 words), key (2 words) -> output (4 words)
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def python_philox(ctr, key):
    """Philox-4x32-10 on Python ints, straight from Salmon et al. (2011)."""
    c, k = list(ctr), list(key)
    for r in range(10):
        if r:
            k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
    return c


def python_uniform(seed, i):
    """Number i of seed's stream: word i % 4 of the block at counter i // 4, top 24 bits."""
    s = seed % 2**64
    block = python_philox((i // 4 & M32, i // 4 >> 32, 0, 0), (s & M32, s >> 32))
    return (block[i % 4] >> 8) / 2**24


@pytest.mark.parametrize("ctr, key, expected", KAT)
def test_known_answer_vectors(ctr, key, expected):
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    out = philox4x32_10(*map(t, ctr), *map(t, key))
    assert [int(x) for x in out] == list(expected)
    assert python_philox(ctr, key) == list(expected)


def test_uniforms_match_a_python_reference_for_any_seed_and_large_offsets():
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, 0x243F6A8885A308D3, 2**64 - 12345]
    offsets = [0, 3, 5, 2**32 - 2, 4 * 2**32 + 1, 2**61 + 7, 123456789, 2**40 - 1]  # counter hi word in use
    n = 11  # crosses block boundaries from every start % 4
    u = philox_uniforms(torch.tensor([seed_to_int64(s) for s in seeds]), torch.tensor(offsets), n)
    assert u.shape == (8, n) and u.dtype == torch.float32
    expected = [[python_uniform(s, o + j) for j in range(n)] for s, o in zip(seeds, offsets)]
    assert u.tolist() == expected


def test_seed_to_int64_maps_the_accepted_range_mod_2_64():
    assert seed_to_int64(0) == 0 and seed_to_int64(2**63 - 1) == 2**63 - 1
    assert seed_to_int64(2**64 - 1) == seed_to_int64(-1) == -1
    assert seed_to_int64(2**63) == seed_to_int64(-(2**63)) == -(2**63)
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            seed_to_int64(bad)
    with pytest.raises(TypeError, match="seed"):
        seed_to_int64(1.5)


def test_random_seed_is_deterministic_per_generator_and_spans_64_bits():
    a = [random_seed(torch.Generator().manual_seed(3)) for _ in range(2)]
    assert a[0] == a[1]
    g = torch.Generator().manual_seed(4)
    seeds = [random_seed(g) for _ in range(200)]
    assert len(set(seeds)) == 200
    assert all(-(2**63) <= s < 2**63 for s in seeds)
    assert any(s < 0 for s in seeds) and any(s >= 2**62 for s in seeds)  # the high bits are used


def test_stream_contract_consecutive_draws_concatenate():
    """offset += n after each draw gives the one stream, whatever the draw sizes."""
    seed = torch.tensor([seed_to_int64(-987654321)])
    whole = philox_uniforms(seed, torch.tensor([6]), 40)[0]
    parts, off = [], 6
    for n in (1, 7, 5, 0, 3, 24):
        parts.append(philox_uniforms(seed, torch.tensor([off]), n)[0])
        off += n
    assert torch.equal(torch.cat(parts), whole)


def test_rows_depend_only_on_their_own_seed_and_offset():
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**62), 2**62, (16,), generator=g)
    offsets = torch.randint(0, 2**40, (16,), generator=g)
    base = philox_uniforms(seeds, offsets, 9)
    assert torch.equal(base, philox_uniforms(seeds, offsets, 9))  # deterministic
    for b in (0, 7, 15):
        alone = philox_uniforms(seeds[b : b + 1], offsets[b : b + 1], 9)
        assert torch.equal(alone[0], base[b])
    other_seeds, other_offsets = seeds.clone(), offsets.clone()
    other_seeds[1::2] += 1  # change every odd row's neighbours' parameters
    other_offsets[1::2] += 3
    changed = philox_uniforms(other_seeds, other_offsets, 9)
    assert torch.equal(changed[0::2], base[0::2])
    assert (changed[1::2] != base[1::2]).all(dim=1).float().mean() > 0.9
    perm = torch.randperm(16, generator=g)  # row order does not matter
    assert torch.equal(philox_uniforms(seeds[perm], offsets[perm], 9), base[perm])


def test_uniform_statistics():
    N = 64
    seeds = torch.arange(N, dtype=torch.int64)  # neighbouring keys: the hardest case for independence
    u = philox_uniforms(seeds, torch.zeros(N, dtype=torch.int64), 4096).double()  # (64, 4096)
    x = u.flatten()
    n = x.numel()
    assert (x >= 0).all() and (x < 1).all()
    assert torch.equal(x * 2**24, (x * 2**24).floor())  # on the 2**-24 grid
    assert abs(x.mean().item() - 0.5) < 4 * (1 / 12 / n) ** 0.5
    assert abs(x.var().item() - 1 / 12) < 0.002
    counts = torch.bincount((x * 64).long(), minlength=64).double()  # chi-square, 63 dof
    chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum().item()
    assert chi2 < 120, chi2  # p ~ 1e-5
    # neighbouring positions, neighbouring seeds: uncorrelated
    lag1 = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1].item()
    seeds_adj = torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1].item()
    assert abs(lag1) < 0.01 and abs(seeds_adj) < 0.01
    # low bits of the words are not stuck: 2**-24 bit varies
    assert 0.45 < ((x * 2**24).long() & 1).double().mean().item() < 0.55


def test_errors_name_the_argument():
    s = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="seed"):
        philox_uniforms(s.int(), s, 2)
    with pytest.raises(ValueError, match="offset"):
        philox_uniforms(s, s[:2], 2)
    with pytest.raises(ValueError, match="n:"):
        philox_uniforms(s, s, -1)


# --- Triton's tl.randint4x as the reference -------------------------------------------------


def _triton_mode():
    """'cuda' (compiled), 'interpreter' (CPU), or None when triton was imported without the interpreter."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    interpreted = type(tl.sum).__name__ == "InterpretedFunction"
    if torch.cuda.is_available() and not interpreted:
        return "cuda"
    del triton
    return "interpreter" if interpreted else None


def _randint4x_words(seeds, blocks, device):
    """Triton: (B,) int64 seeds, (B, n) int64 block counters -> (B, n, 4) int64 words."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(seed_ptr, ctr_ptr, out_ptr, N: tl.constexpr):
        b = tl.program_id(0)
        seed = tl.load(seed_ptr + b)
        j = tl.arange(0, N)
        r0, r1, r2, r3 = tl.randint4x(seed, tl.load(ctr_ptr + b * N + j))
        out = out_ptr + (b * N + j) * 4
        tl.store(out + 0, r0.to(tl.int32, bitcast=True))
        tl.store(out + 1, r1.to(tl.int32, bitcast=True))
        tl.store(out + 2, r2.to(tl.int32, bitcast=True))
        tl.store(out + 3, r3.to(tl.int32, bitcast=True))

    B, n = blocks.shape
    out = torch.empty(B, n, 4, dtype=torch.int32, device=device)
    kernel[(B,)](seeds.to(device), blocks.contiguous().to(device), out, N=n)
    return out.cpu().long() & M32


def test_uniforms_match_triton_randint4x():
    mode = _triton_mode()
    if mode is None:
        pytest.skip("triton was imported without TRITON_INTERPRET; see test_triton_in_a_fresh_process")
    device = "cuda" if mode == "cuda" else "cpu"
    g = torch.Generator().manual_seed(1)
    seeds = torch.tensor([seed_to_int64(s) for s in (0, -1, 2**63 - 1, -(2**63), 42, 2**64 - 7)])
    seeds = torch.cat([seeds, torch.randint(-(2**63), 2**63 - 1, (2,), generator=g)])  # (8,)
    offsets = torch.tensor([0, 1, 2, 3, 2**34 + 2, 2**61 + 1, 77, 2**32 * 4 - 3])  # (8,) any start % 4
    n = 16
    idx = offsets[:, None] + torch.arange(n)  # (8, 16) stream positions
    # the adapter: number i is word i % 4 of randint4x(seed, i // 4); uniform from its top 24 bits
    words = _randint4x_words(seeds, idx // 4, device)  # (8, 16, 4)
    expected_words = words.gather(2, (idx % 4)[..., None]).squeeze(2)
    expected = (expected_words >> 8).float() * 2**-24
    got = philox_uniforms(seeds.to(device), offsets.to(device), n).cpu()
    assert torch.equal(got, expected)
    # the words themselves, not only their top 24 bits
    blocks = idx // 4
    mine = torch.stack(philox4x32_10(blocks & M32, blocks >> 32, torch.zeros_like(blocks), torch.zeros_like(blocks),
                                     (seeds & M32)[:, None], ((seeds >> 32) & M32)[:, None]), dim=-1)
    assert torch.equal(mine, words)


def test_triton_in_a_fresh_process():
    if _triton_mode() is not None:
        pytest.skip("test_uniforms_match_triton_randint4x runs in-process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "-k", "test_uniforms_match_triton_randint4x"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and " passed" in res.stdout, res.stdout[-4000:] + res.stderr[-2000:]
