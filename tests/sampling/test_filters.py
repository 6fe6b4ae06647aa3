"""The sampling filters (temperature, top-k, top-p, min-p) and inverse-CDF sampling (specserve.sampling.filters)."""

import math

import pytest
import torch

from specserve.sampling import SamplingTensors, keyed_uniforms, logits_to_probs, random_seed, sample_from_probs
from specserve.sampling.philox import SAMPLE


def st_for(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    return SamplingTensors.build([temperature] * n, [top_k] * n, [top_p] * n, [min_p] * n, "cpu")


def log_probs(*ps):
    return torch.tensor([[math.log(p) for p in ps]], dtype=torch.float32)


def test_plain_sampling_is_softmax_of_scaled_logits():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, st_for(4, temperature=0.7))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, dim=-1))
    assert probs.dtype == torch.float32


def test_temperature_zero_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    st = SamplingTensors.build([0.0, 1.0], [0, 2], [1.0, 0.5], [0.0, 0.3], "cpu")
    assert st.greedy.tolist() == [True, False] and not st.all_greedy
    probs = logits_to_probs(logits, st)
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs[1].sum().item() == pytest.approx(1.0)
    all_greedy = logits_to_probs(logits, st_for(2, temperature=0.0))
    assert all_greedy.argmax(-1).tolist() == [1, 0] and all_greedy.sum(-1).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_the_k_largest(k):
    logits = torch.randperm(20, generator=torch.Generator().manual_seed(k)).float()[None, :] / 3
    probs = logits_to_probs(logits, st_for(1, top_k=k))[0]
    kept = set(torch.nonzero(probs).flatten().tolist())
    assert kept == set(logits[0].topk(k).indices.tolist())
    assert probs.sum().item() == pytest.approx(1.0)
    expected = torch.softmax(logits[0, sorted(kept)], dim=-1)
    torch.testing.assert_close(probs[sorted(kept)], expected)


def test_top_k_off_or_larger_than_vocab_keeps_everything():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(1))
    st = SamplingTensors.build([1.0, 1.0], [0, 50], [1.0, 1.0], [0.0, 0.0], "cpu")
    assert (logits_to_probs(logits, st) > 0).all()
    assert not SamplingTensors.build([1.0], [-1], [1.0], [0.0], "cpu").any_top_k  # -1 means off


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.3, [0]), (0.5, [0]), (0.7, [0, 1]), (0.76, [0, 1, 2]), (0.95, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_minimal_nucleus(top_p, kept):
    logits = log_probs(0.5, 0.25, 0.15, 0.1)
    probs = logits_to_probs(logits, st_for(1, top_p=top_p))[0]
    assert torch.nonzero(probs).flatten().tolist() == kept
    base = torch.tensor([0.5, 0.25, 0.15, 0.1])[kept]
    torch.testing.assert_close(probs[kept], base / base.sum())


def test_top_p_random_rows_minimal_and_sufficient():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 30, generator=g) * 2
    top_ps = (torch.rand(64, generator=g) * 0.9 + 0.05).tolist()
    st = SamplingTensors.build([1.0] * 64, [0] * 64, top_ps, [0.0] * 64, "cpu")
    probs = logits_to_probs(logits, st)
    full = torch.softmax(logits, dim=-1)
    for row in range(64):
        kept = probs[row] > 0
        order = full[row].argsort(descending=True)
        n_kept = int(kept.sum())
        assert kept[order[:n_kept]].all()  # the kept set is a prefix of the sorted distribution
        mass = full[row][order].cumsum(0)
        assert mass[n_kept - 1] >= top_ps[row] - 1e-6  # enough mass
        if n_kept > 1:
            assert mass[n_kept - 2] < top_ps[row] + 1e-6  # and minimal


def test_min_p_drops_tokens_below_fraction_of_max():
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    probs = logits_to_probs(logits, st_for(1, min_p=0.2))[0]  # threshold 0.1
    assert torch.nonzero(probs).flatten().tolist() == [0, 1, 2]
    torch.testing.assert_close(probs[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)


def test_rows_are_processed_independently():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=g)
    params = [(0.5, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.3, 0, 1.0, 0.1), (0.0, 3, 0.5, 0.5), (0.9, 10, 0.9, 0.05)]
    st = SamplingTensors.build(*zip(*params), device="cpu")
    batched = logits_to_probs(logits, st)
    for row, (t, k, p, m) in enumerate(params):
        alone = logits_to_probs(logits[row : row + 1], SamplingTensors.build([t], [k], [p], [m], "cpu"))
        torch.testing.assert_close(batched[row : row + 1], alone)


def test_inverse_cdf_mapping_and_top_edge():
    probs = torch.tensor([[0.2, 0.3, 0.5]] * 5)
    u = torch.tensor([0.0, 0.1, 0.25, 0.6, 1.0])  # 1.0 is outside [0, 1): guarded, not an error
    assert sample_from_probs(probs, u).tolist() == [0, 0, 1, 2, 2]


def test_never_selects_a_zero_probability_token():
    g = torch.Generator().manual_seed(4)
    probs = torch.rand(2000, 12, generator=g)
    probs[torch.rand(2000, 12, generator=g) < 0.5] = 0.0
    probs[:, 0] = 0.0  # first and last always empty
    probs[:, -1] = 0.0
    probs[:, 5] += 1e-3  # every row has some mass
    u = torch.rand(2000, generator=g)
    u[:100] = 0.0
    u[100:200] = 1.0 - 2**-24  # largest float32 below 1
    u[200:300] = 1.0
    tokens = sample_from_probs(probs, u)
    assert (probs.gather(1, tokens[:, None]) > 0).all()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(40000, 4)
    tokens = sample_from_probs(probs, torch.rand(40000, generator=torch.Generator().manual_seed(5)))
    freq = torch.bincount(tokens, minlength=4).float() / 40000
    assert (freq - probs[0]).abs().max() < 0.01


def keyed(seeds, num):
    """Uniforms (len(seeds), num): request b's keyed numbers at output positions 0..num-1;
    an unseeded request (None) has a key of its own, as the engine draws one at admission."""
    keys = torch.tensor([random_seed() if s is None else s for s in seeds])
    return keyed_uniforms(keys, torch.zeros(len(seeds), dtype=torch.int64), num, SAMPLE)


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    probs = torch.softmax(torch.randn(3, 100, generator=torch.Generator().manual_seed(6)), dim=-1)

    first = sample_from_probs(probs, keyed([11, 12, 13], 1)[:, 0])
    again = sample_from_probs(probs, keyed([11, 12, 13], 1)[:, 0])
    assert first.tolist() == again.tolist()
    # request seeded 12 alone, in a batch with an unseeded request, gives the same token
    alone = sample_from_probs(probs[1:2], keyed([12], 1)[:, 0])
    mixed = keyed([None, 12], 1)
    assert alone.item() == first[1].item()
    assert sample_from_probs(probs[[0, 1]], mixed[:, 0])[1].item() == first[1].item()
    other = keyed([21, 22, 23], 64)
    assert not torch.equal(other, keyed([11, 12, 13], 64))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(top_ks=[0, 0]), "top_ks"),
        (dict(top_ps=[0.0]), "top_ps"),
        (dict(min_ps=[1.5]), "min_ps"),
        (dict(temperatures=[-1.0]), "temperatures"),
        (dict(top_ks=[-2]), "top_ks"),
    ],
)
def test_build_errors_name_the_argument(kwargs, name):
    args = dict(temperatures=[1.0], top_ks=[0], top_ps=[1.0], min_ps=[0.0]) | kwargs
    with pytest.raises(ValueError, match=name):
        SamplingTensors.build(**args, device="cpu")


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="st:"):
        logits_to_probs(torch.zeros(3, 5), st_for(2))
    with pytest.raises(ValueError, match="uniforms"):
        sample_from_probs(torch.ones(3, 5), torch.zeros(2))
