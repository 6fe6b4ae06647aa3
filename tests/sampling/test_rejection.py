"""Draft verification (specserve.sampling.rejection): losslessness, greedy exactness, seeds, padding."""

import math

import pytest
import torch

from specserve.sampling import (
    RejectionUniforms,
    keyed_uniforms,
    random_seed,
    sample_from_probs,
    seed_to_int64,
    step_uniforms,
    verify_chain,
)
from specserve.sampling.philox import SAMPLE

V = 10


def rand_uniforms(B, K, g):
    return RejectionUniforms(accept=torch.rand(B, K, generator=g), sample=torch.rand(B, K + 1, generator=g))


def random_dist(shape, g, scale=2.0):
    return torch.softmax(torch.randn(*shape, generator=g) * scale, dim=-1)


def sample_rows(probs, g):
    # probs [N, V] -> one token per row
    return sample_from_probs(probs, torch.rand(probs.shape[0], generator=g))


def emitted_at(out, j):
    """Tokens emitted at position j by the rows that got that far."""
    reached = out.num_accepted >= j
    return out.output_token_ids[reached, j]


def assert_converges(tokens, p, reference):
    """vLLM's criterion: as samples grow from 10 to N (>= 20k), the distance of the empirical
    distribution to p must shrink at least 20x more than its distance to an unrelated
    distribution.  The 10-sample distance is averaged over N/10 disjoint chunks to tame noise.
    Also: the final distance to p must be within 3x the sampling noise expected at N."""
    N = tokens.numel()
    assert N >= 20_000, f"test setup gives only {N} samples"
    small = 10
    chunks = torch.nn.functional.one_hot(tokens[: N // small * small].view(-1, small), V).float().mean(1)
    full = torch.bincount(tokens, minlength=V).float() / N

    def l1(emp, dist):
        return (emp - dist).abs().sum(-1).mean().item()

    improvement_p = l1(chunks, p) / l1(full, p)
    improvement_ref = l1(chunks, reference) / l1(full, reference)
    assert improvement_p > 20 * improvement_ref, (improvement_p, improvement_ref)
    expected_noise = (2 * p * (1 - p) / (math.pi * N)).sqrt().sum().item()  # E[L1] of an exact sampler
    assert l1(full, p) < 3 * expected_noise, (l1(full, p), expected_noise)


def convergence_batch(method, K, N, seed):
    g = torch.Generator().manual_seed(seed)
    p = random_dist((K + 1, V), g)  # [K+1, V] target at each position (context-independent)
    q = 0.5 * p[:K] + 0.5 * random_dist((K, V), g)  # [K, V] a decent but imperfect drafter
    drafts = sample_rows(q.repeat(N, 1), g).view(N, K)  # d_i ~ q_i; rows are [d_1..d_K]
    out = verify_chain(
        p.expand(N, K + 1, V),
        drafts,
        torch.full((N,), K),
        q.expand(N, K, V) if method == "probabilistic" else None,
        rand_uniforms(N, K, g),
        method,
    )
    return p, out, random_dist((V,), torch.Generator().manual_seed(seed + 1000))


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
@pytest.mark.parametrize("K", [2, 3])
def test_emitted_tokens_follow_the_target(method, K):
    p, out, reference = convergence_batch(method, K, 100_000, seed=K)
    assert_converges(emitted_at(out, 0), p[0], reference)  # the first token ~ p_1
    for j in range(1, K + 1):  # position j (given it was reached) ~ p_{j+1}; j == K is the bonus
        tokens = emitted_at(out, j)
        if method == "probabilistic" or tokens.numel() >= 20_000:  # strict rarely gets deep
            assert_converges(tokens, p[j], reference)


def test_strict_bonus_after_all_accepted_follows_the_target():
    # Strict is lossless for any drafts; a greedy drafter on peaked positions reaches the bonus often.
    K, N = 3, 100_000
    g = torch.Generator().manual_seed(7)
    p = torch.cat([random_dist((K, V), g, scale=6.0), random_dist((1, V), g)])  # [K+1, V]
    drafts = p[:K].argmax(-1).expand(N, K).contiguous()
    out = verify_chain(p.expand(N, K + 1, V), drafts, torch.full((N,), K), None, rand_uniforms(N, K, g), "strict")
    reference = random_dist((V,), g)
    assert_converges(emitted_at(out, K), p[K], reference)
    assert_converges(emitted_at(out, 0), p[0], reference)


def test_convergence_check_catches_a_biased_sampler():
    p, out, reference = convergence_batch("probabilistic", 2, 100_000, seed=2)
    biased = emitted_at(out, 0).clone()
    biased[::50] = 0  # 2% of the samples moved to token 0
    with pytest.raises(AssertionError):
        assert_converges(biased, p[0], reference)


def test_probabilistic_accepts_more_than_strict_with_a_real_draft_distribution():
    _, strict, _ = convergence_batch("strict", 3, 20_000, seed=5)
    _, prob, _ = convergence_batch("probabilistic", 3, 20_000, seed=5)
    assert prob.num_accepted.float().mean() > strict.num_accepted.float().mean() + 0.2


def greedy_case():
    # B=4, K=3; target argmax per position and drafts that match up to a point
    argmax = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [0, 1, 2, 3], [9, 8, 7, 6]])
    drafts = torch.tensor([[1, 2, 3], [5, 0, 7], [4, -1, -1], [9, 8, 5]])
    n = torch.tensor([3, 3, 0, 2])
    expected = torch.tensor([[1, 2, 3, 4], [5, 6, -1, -1], [0, -1, -1, -1], [9, 8, 7, -1]])
    return argmax, drafts, n, expected, torch.tensor([3, 1, 0, 2])


def test_greedy_fast_path():
    argmax, drafts, n, expected, num_acc = greedy_case()
    out = verify_chain(None, drafts, n, target_tokens=argmax)
    assert out.output_token_ids.tolist() == expected.tolist()
    assert out.num_accepted.tolist() == num_acc.tolist()
    assert out.to_lists() == [[1, 2, 3, 4], [5, 6], [0], [9, 8, 7]]


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_one_hot_targets_give_the_greedy_result(method, with_draft_probs):
    argmax, drafts, n, expected, num_acc = greedy_case()
    g = torch.Generator().manual_seed(3)
    target = torch.nn.functional.one_hot(argmax, V).float()  # [4, 4, V]
    q = random_dist((4, 3, V), g) if with_draft_probs else None
    for _ in range(5):
        out = verify_chain(target, drafts, n, q, rand_uniforms(4, 3, g), method)
        assert out.output_token_ids.tolist() == expected.tolist()
        assert out.num_accepted.tolist() == num_acc.tolist()


def test_padding_beyond_num_draft_tokens_is_never_accepted():
    # The padded draft matches the target's argmax at its position, but n = 1 stops there.
    target = torch.nn.functional.one_hot(torch.tensor([[4, 5, 6, 7]]), V).float()
    drafts = torch.tensor([[4, 5, 6]])
    for method in ("strict", "probabilistic"):
        out = verify_chain(target, drafts, torch.tensor([1]), None, rand_uniforms(1, 3, torch.Generator()), method)
        assert out.output_token_ids.tolist() == [[4, 5, -1, -1]]  # draft 4 accepted, bonus from p_2
        assert out.num_accepted.tolist() == [1]


def test_zero_drafts_everywhere_emits_one_target_sample():
    g = torch.Generator().manual_seed(4)
    p = random_dist((6, 1, V), g)
    drafts = torch.empty(6, 0, dtype=torch.int64)
    u = rand_uniforms(6, 0, g)
    for method in ("strict", "probabilistic"):
        out = verify_chain(p, drafts, torch.zeros(6, dtype=torch.int64), None, u, method)
        assert out.num_accepted.tolist() == [0] * 6
        assert out.output_token_ids[:, 0].tolist() == sample_from_probs(p[:, 0], u.sample[:, 0]).tolist()


def test_residual_all_zero_falls_back_to_the_target():
    # p == q and a draft that both give zero mass: rejected, residual is empty -> sample p.
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    out = verify_chain(
        p, torch.tensor([[0]]), torch.tensor([1]), p[:, :1].clone(),
        RejectionUniforms(accept=torch.tensor([[0.0]]), sample=torch.tensor([[0.6, 0.0]])), "probabilistic",
    )
    assert out.output_token_ids.tolist() == [[2, -1]]


def seeded_step(seeds, p, q, drafts):
    B, K = drafts.shape
    # an unseeded request (None) has a key of its own too, as the engine draws one at admission
    keys = torch.tensor([random_seed() if s is None else seed_to_int64(s) for s in seeds])
    outs = []
    for step in range(10):  # ten verification steps, each at the request's next K+1 output positions
        u = step_uniforms(keys, torch.full((B,), step * (K + 1)), K)
        outs.append(verify_chain(p, drafts, torch.full((B,), K), q, u, "probabilistic").output_token_ids)
    return torch.stack(outs, 1)  # [B, steps, K+1]


def test_seeded_requests_are_reproducible_whatever_the_batch():
    g = torch.Generator().manual_seed(6)
    p, q = random_dist((3, 3, V), g, scale=0.5), random_dist((3, 2, V), g, scale=0.5)
    drafts = sample_rows(q.reshape(6, V), g).view(3, 2)
    first = seeded_step([7, 8, 9], p, q, drafts)
    assert torch.equal(first, seeded_step([7, 8, 9], p, q, drafts))
    # request seeded 8 next to an unseeded one, in another row
    mixed = seeded_step([None, 8], p[[0, 1]], q[[0, 1]], drafts[[0, 1]])
    assert torch.equal(mixed[1], first[1])
    other = seeded_step([17, 18, 19], p, q, drafts)
    assert not torch.equal(other, first)


def test_step_uniforms_are_each_requests_keyed_numbers():
    u = step_uniforms(torch.tensor([3, seed_to_int64(2**64 - 1)]), torch.tensor([0, 40]), K=4)
    assert u.accept.shape == (2, 4) and u.sample.shape == (2, 5)
    expected = keyed_uniforms(torch.tensor([3]), torch.tensor([0]), 5, SAMPLE)[0]  # positions 0..4
    assert torch.equal(u.sample[0], expected)
    alone = step_uniforms(torch.tensor([3]), torch.tensor([0]), K=4)  # row 0 without its neighbour
    assert torch.equal(u.accept[0], alone.accept[0]) and torch.equal(u.sample[0], alone.sample[0])
    assert ((u.accept >= 0) & (u.accept < 1)).all() and ((u.sample >= 0) & (u.sample < 1)).all()


@pytest.mark.parametrize("rate", [0.3, 0.7])
def test_synthetic_acceptance_rate_per_position(rate):
    B, K = 50_000, 3
    g = torch.Generator().manual_seed(8)
    p = random_dist((B, K + 1, V), g)
    drafts = torch.randint(0, V, (B, K), generator=g)
    out = verify_chain(p, drafts, torch.full((B,), K), None, rand_uniforms(B, K, g), "synthetic", rate)
    for i in range(K):
        reached = (out.num_accepted >= i).sum().item()
        accepted = (out.num_accepted >= i + 1).sum().item()
        if reached >= 4000:
            assert abs(accepted / reached - rate) < 0.02, (i, accepted / reached)
    rows = torch.arange(B)
    assert torch.equal(out.output_token_ids[:, 0][out.num_accepted > 0], drafts[:, 0][out.num_accepted > 0])
    assert (out.output_token_ids[rows, out.num_accepted] >= 0).all()


def test_synthetic_ignores_the_target_but_greedy_rows_emit_argmax_on_failure():
    target = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3]] * 2), V).float()
    drafts = torch.tensor([[9, 9], [9, 9]])  # zero target probability
    u = RejectionUniforms(accept=torch.tensor([[0.1, 0.1], [0.1, 0.9]]), sample=torch.rand(2, 3))
    out = verify_chain(target, drafts, torch.tensor([2, 2]), None, u, "synthetic", 0.5)
    assert out.output_token_ids.tolist() == [[9, 9, 3], [9, 2, -1]]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(method="lossy"), "method"),
        (dict(method="synthetic"), "synthetic_acceptance_rate"),
        (dict(method="synthetic", synthetic_acceptance_rate=1.5), "synthetic_acceptance_rate"),
        (dict(synthetic_acceptance_rate=0.5), "synthetic_acceptance_rate"),
        (dict(num_draft_tokens=torch.tensor([3, 1])), "num_draft_tokens"),
        (dict(draft_token_ids=torch.tensor([[1, 12], [0, -1]])), "draft_token_ids"),
        (dict(draft_token_ids=torch.tensor([[1, -1], [0, -1]])), "draft_token_ids"),
        (dict(target_probs=torch.zeros(2, 2, V)), "target_probs"),
        (dict(target_probs=torch.zeros(2, 3, V, dtype=torch.float64)), "target_probs"),
        (dict(draft_probs=torch.zeros(2, 2, V + 1)), "draft_probs"),
        (dict(uniforms=RejectionUniforms(torch.zeros(2, 3), torch.zeros(2, 3))), "uniforms.accept"),
    ],
)
def test_errors_name_the_argument(change, match):
    args = dict(
        target_probs=torch.full((2, 3, V), 0.1),
        draft_token_ids=torch.tensor([[1, 2], [0, -1]]),
        num_draft_tokens=torch.tensor([2, 1]),
        draft_probs=None,
        uniforms=RejectionUniforms(torch.zeros(2, 2), torch.zeros(2, 3)),
        method="strict",
    ) | change
    with pytest.raises(ValueError, match=match):
        verify_chain(**args)
