"""Block verification (``rejection_sample_method=block``): the algorithm against an exact
reference, losslessness, more accepted tokens than probabilistic verification, greedy rows
as strict, per-step keyed numbers, and the engine's output distribution.

The reference (:func:`block_outcomes`) computes the probability of every outcome of one
block in exact rational arithmetic from the algorithm's definitions; enumerating every
draft block proves it lossless, and the implementation is compared with it on keyed
numbers.
"""

from __future__ import annotations

import itertools
import math
import sys
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "proposers"))

from engine_utils import one_thread, tiny_config  # noqa: E402, F401 (one_thread: an autouse fixture)
from specserve.errors import ConfigError  # noqa: E402
from specserve.methods import Q_VERIFICATION_METHODS, REJECTION_METHODS, SpeculativeConfig  # noqa: E402
from specserve.proposers.heads import DraftColumns, HeadSampler  # noqa: E402
from specserve.request import SamplingParams  # noqa: E402
from specserve.sampling import RejectionUniforms, keyed_uniforms, step_uniforms, verify_chain  # noqa: E402
from specserve.sampling.philox import ACCEPT, DRAFT, SAMPLE  # noqa: E402
from specserve.sampling.sampler import RequestTensors, block_uniforms, verify_step  # noqa: E402

# ---------------------------------------------------------------------------------------
# The exact reference: models are functions prefix -> distribution (lists of Fractions).


def block_outcomes(P, Q, drafts) -> dict[tuple[int, int], Fraction]:
    """P(tau = i, Y = y | drafts) of block verification, exactly: tau drafts kept, then y."""
    K = len(drafts)
    p = [P(drafts[:i]) for i in range(K + 1)]
    q = [Q(drafts[:i]) for i in range(K)]
    w = [Fraction(1)]
    for i, d in enumerate(drafts):
        w.append(min(Fraction(1), w[-1] * p[i][d] / q[i][d]) if q[i][d] else Fraction(int(w[-1] * p[i][d] > 0)))
    h = {}
    for i in range(1, K):
        r = sum(max(w[i] * a - b, Fraction(0)) for a, b in zip(p[i], q[i]))
        h[i] = r / (r + 1 - w[i]) if r + 1 - w[i] > 0 else Fraction(1)
    h[K] = w[K]
    out: dict[tuple[int, int], Fraction] = {}
    not_longer = Fraction(1)  # P(no longer block passed its test)
    for i in range(K, -1, -1):
        stop = not_longer * (h[i] if i > 0 else 1)
        not_longer *= 1 - h[i] if i > 0 else 0
        if stop == 0:
            continue
        if i == K:
            dist = p[K]
        else:
            res = [max(w[i] * a - b, Fraction(0)) for a, b in zip(p[i], q[i])]
            total = sum(res)
            assert total > 0, "a stop with probability > 0 has an empty residual"
            dist = [x / total for x in res]
        for y, py in enumerate(dist):
            if py:
                out[(i, y)] = out.get((i, y), Fraction(0)) + stop * py
    return out


def seq_prob(P, s) -> Fraction:
    return math.prod((P(tuple(s[:j]))[s[j]] for j in range(len(s))), start=Fraction(1))


def completed_distribution(P, Q, V, K) -> dict[tuple, Fraction]:
    """The distribution of one step's emitted tokens, completed to K + 1 tokens by the target."""
    out: dict[tuple, Fraction] = {}
    for d in itertools.product(range(V), repeat=K):
        pd = seq_prob(Q, d)
        if pd == 0:
            continue
        for (i, y), pr in block_outcomes(P, Q, d).items():
            head = d[:i] + (y,)
            for tail in itertools.product(range(V), repeat=K - i):
                s = head + tail
                rest = math.prod((P(s[:j])[s[j]] for j in range(i + 1, K + 1)), start=Fraction(1))
                out[s] = out.get(s, Fraction(0)) + pd * pr * rest
    return out


def expected_accepted(P, Q, V, K, method) -> Fraction:
    total = Fraction(0)
    for d in itertools.product(range(V), repeat=K):
        pd = seq_prob(Q, d)
        if pd == 0:
            continue
        if method == "block":
            total += pd * sum(i * pr for (i, _), pr in block_outcomes(P, Q, d).items())
        else:  # probabilistic: P(tau >= i) = prod_{j < i} min(1, p_j(d_j) / q_j(d_j))
            run = Fraction(1)
            for j in range(K):
                run *= min(Fraction(1), P(d[:j])[d[j]] / Q(d[:j])[d[j]])
                total += pd * run
    return total


def table_model(table: dict, V: int):
    """A model given by {last token or None: weights}, normalised to Fractions."""
    dists = {k: [Fraction(x, sum(v)) for x in v] for k, v in table.items()}
    return lambda prefix: dists[prefix[-1] if prefix else None]


def random_model(V: int, seed: int, zeros: bool = True):
    g = torch.Generator().manual_seed(seed)
    table = {}
    for k in [None, *range(V)]:
        w = torch.randint(0 if zeros else 1, 9, (V,), generator=g).tolist()
        w[int(torch.randint(0, V, (1,), generator=g))] += 1  # never all zero
        table[k] = w
    return table_model(table, V)


# hand-made: a zero of q where p has mass, a zero of p where q has mass, and p == q after token 2
HAND_P = table_model({None: [1, 2, 3], 0: [1, 0, 1], 1: [5, 1, 2], 2: [1, 1, 1]}, 3)
HAND_Q = table_model({None: [3, 2, 0], 0: [1, 2, 1], 1: [1, 1, 6], 2: [1, 1, 1]}, 3)


def as_tensor(fn, prefixes) -> torch.Tensor:
    return torch.tensor([[float(x) for x in fn(p)] for p in prefixes], dtype=torch.float32)


def step_inputs(P, Q, drafts: tuple, rows: int):
    """verify_chain's inputs for ``rows`` copies of one draft block."""
    K = len(drafts)
    tp = as_tensor(P, [drafts[:i] for i in range(K + 1)])
    dq = as_tensor(Q, [drafts[:i] for i in range(K)])
    return (tp.expand(rows, K + 1, -1).contiguous(), torch.tensor(drafts).expand(rows, K).contiguous(),
            torch.full((rows,), K), dq.expand(rows, K, -1).contiguous())


def noise_tv(probs: list[float], n: int) -> float:
    """E[total variation] of an exact sampler's empirical distribution over n samples (approx.)."""
    return sum(0.5 * math.sqrt(2 * p * (1 - p) / (math.pi * n)) for p in probs)


# ---------------------------------------------------------------------------------------


def test_the_method_is_registered_and_reads_q():
    assert "block" in REJECTION_METHODS and "block" in Q_VERIFICATION_METHODS
    assert SpeculativeConfig(rejection_sample_method="block").samples_drafts


def test_config_accepts_block_and_names_it_in_errors(tmp_path):
    cfg = tiny_config(tmp_path, "ngram", k=2, rejection_sample_method="block")
    assert cfg.method.rejection_sample_method == "block"
    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, "ngram", k=2, rejection_sample_method="blocks")
    assert str(e.value).startswith("method.rejection_sample_method") and "block" in str(e.value)


@pytest.mark.parametrize("P, Q, V, K", [
    (HAND_P, HAND_Q, 3, 2),
    (HAND_P, HAND_Q, 3, 3),
    (random_model(3, 1), random_model(3, 2), 3, 3),
    (random_model(2, 3), random_model(2, 4), 2, 4),
], ids=["hand-K2", "hand-K3", "random-V3-K3", "random-V2-K4"])
def test_the_reference_is_exactly_lossless(P, Q, V, K):
    """Enumerating every draft block: the emitted tokens, completed by the target, are
    distributed exactly as K + 1 tokens of the target (rational arithmetic)."""
    got = completed_distribution(P, Q, V, K)
    for s in itertools.product(range(V), repeat=K + 1):
        assert got.get(s, Fraction(0)) == seq_prob(P, s), s


def test_paper_example_accepts_11_9_against_10_9():
    """The paper's context-free binary example: p = (1/3, 2/3), q = (2/3, 1/3), two drafts."""
    P = table_model({None: [1, 2], 0: [1, 2], 1: [1, 2]}, 2)
    Q = table_model({None: [2, 1], 0: [2, 1], 1: [2, 1]}, 2)
    assert expected_accepted(P, Q, 2, 2, "probabilistic") == Fraction(10, 9)
    assert expected_accepted(P, Q, 2, 2, "block") == Fraction(11, 9)
    # ... and verify_chain gets there: drafts drawn from q, keyed numbers
    N = 60_000
    seeds = torch.arange(N, dtype=torch.int64)
    d = (keyed_uniforms(seeds, torch.zeros(N, dtype=torch.int64), 2, DRAFT) >= 2 / 3).to(torch.int64)  # q(1) = 1/3
    p = torch.tensor([1 / 3, 2 / 3]).expand(N, 3, 2).contiguous()
    q = torch.tensor([2 / 3, 1 / 3]).expand(N, 2, 2).contiguous()
    u = step_uniforms(seeds, torch.zeros(N, dtype=torch.int64), 2, "block")
    mean = verify_chain(p, d, torch.full((N,), 2), q, u, "block").num_accepted.double().mean().item()
    assert abs(mean - 11 / 9) < 0.015, mean  # sd of the mean ~0.0035
    prob = verify_chain(p, d, torch.full((N,), 2), q, u, "probabilistic").num_accepted.double().mean().item()
    assert abs(prob - 10 / 9) < 0.015, prob


@pytest.mark.parametrize("seed", range(4))
def test_block_accepts_at_least_as_many_as_probabilistic(seed):
    """In expectation, exactly, on context-dependent random models (Sun et al.: it is optimal)."""
    P, Q = random_model(3, 10 + seed), random_model(3, 20 + seed)
    block = expected_accepted(P, Q, 3, 3, "block")
    prob = expected_accepted(P, Q, 3, 3, "probabilistic")
    assert block >= prob, (float(block), float(prob))
    assert block > prob  # these models leave room: the block gains


def test_verify_chain_follows_the_exact_outcome_distribution():
    """For every draft block of the hand-made models (K = 2), the empirical (accepted length,
    emitted token) distribution of verify_chain on keyed numbers matches the reference."""
    M, K, V = 20_000, 2, 3
    blocks = [d for d in itertools.product(range(V), repeat=K) if seq_prob(HAND_Q, d) > 0]
    tp, ids, n, dq = (torch.cat(t) for t in zip(*(step_inputs(HAND_P, HAND_Q, d, M) for d in blocks)))
    seeds = torch.arange(len(blocks) * M, dtype=torch.int64) + 991
    u = step_uniforms(seeds, torch.full_like(seeds, 7), K, "block")
    out = verify_chain(tp, ids, n, dq, u, "block")
    emitted = out.output_token_ids.gather(1, out.num_accepted[:, None])[:, 0]
    acc_emp = torch.zeros(K + 1, dtype=torch.float64)
    acc_exact = [Fraction(0)] * (K + 1)
    for b, d in enumerate(blocks):
        rows = slice(b * M, (b + 1) * M)
        for j in range(K):  # what is kept is the drafts
            kept = out.num_accepted[rows] > j
            assert bool((out.output_token_ids[rows, j][kept] == d[j]).all())
        exact = block_outcomes(HAND_P, HAND_Q, d)
        code = out.num_accepted[rows] * V + emitted[rows]
        emp = torch.bincount(code, minlength=(K + 1) * V).double() / M
        want = torch.tensor([float(exact.get((i, y), 0)) for i in range(K + 1) for y in range(V)], dtype=torch.float64)
        tv = 0.5 * (emp - want).abs().sum().item()
        assert tv < 3 * noise_tv(want.tolist(), M) + 1e-3, (d, tv)
        w = float(seq_prob(HAND_Q, d))
        acc_emp += w * torch.bincount(out.num_accepted[rows], minlength=K + 1).double() / M
        for (i, _), pr in exact.items():
            acc_exact[i] += Fraction(w) * pr
    # the accepted-length distribution, drafts weighted by q
    assert torch.allclose(acc_emp, torch.tensor([float(x) for x in acc_exact], dtype=torch.float64), atol=0.01)


def test_emitted_tokens_follow_the_target_joint():
    """Drafts sampled from q != p; the emitted tokens completed by the target's exact
    continuation probabilities have the target's joint distribution over K + 1 tokens."""
    V, K, N = 3, 3, 120_000
    P, Q = random_model(V, 31, zeros=False), random_model(V, 32, zeros=False)
    seeds = torch.arange(N, dtype=torch.int64) + 5
    du = keyed_uniforms(seeds, torch.zeros_like(seeds), K, DRAFT)
    drafts = torch.empty(N, K, dtype=torch.int64)
    tables = {}
    for pre in itertools.chain.from_iterable(itertools.product(range(V), repeat=r) for r in range(K + 1)):
        tables[pre] = (as_tensor(P, [pre])[0], as_tensor(Q, [pre])[0] if len(pre) < K else None)
    tp = torch.empty(N, K + 1, V)
    dq = torch.empty(N, K, V)
    rows = [()] * N
    for j in range(K):
        qj = torch.stack([tables[r][1] for r in rows])
        tp[:, j] = torch.stack([tables[r][0] for r in rows])
        dq[:, j] = qj
        cdf = qj.cumsum(1)
        drafts[:, j] = (du[:, j, None] >= cdf[:, :-1]).sum(1)  # inverse CDF
        rows = [r + (t,) for r, t in zip(rows, drafts[:, j].tolist())]
    tp[:, K] = torch.stack([tables[r][0] for r in rows])
    out = verify_chain(tp, drafts, torch.full((N,), K), dq, step_uniforms(seeds, torch.zeros_like(seeds), K, "block"),
                       "block")
    emp: dict[tuple, float] = {}
    for toks, a in zip(out.output_token_ids.tolist(), out.num_accepted.tolist()):
        key = tuple(toks[: a + 1])
        emp[key] = emp.get(key, 0.0) + 1.0 / N
    completed = {}
    for head, pr in emp.items():
        for tail in itertools.product(range(V), repeat=K + 1 - len(head)):
            s = head + tail
            rest = float(math.prod((P(s[:j])[s[j]] for j in range(len(head), K + 1)), start=Fraction(1)))
            completed[s] = completed.get(s, 0.0) + pr * rest
    target = {s: float(seq_prob(P, s)) for s in itertools.product(range(V), repeat=K + 1)}
    tv = 0.5 * sum(abs(completed.get(s, 0.0) - t) for s, t in target.items())
    assert tv < 3 * noise_tv(list(target.values()), N), tv
    # the drafts alone are far from the target: the test has something to correct
    q_joint = {s: float(seq_prob(Q, s[:K])) * float(P(s[:K])[s[K]]) for s in target}
    assert 0.5 * sum(abs(q_joint[s] - t) for s, t in target.items()) > 0.2


def _greedy_batch(B, K, V, g):
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    p = torch.nn.functional.one_hot(logits.argmax(-1), V).float()  # greedy: one-hot at the argmax
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, dim=-1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    follow = torch.rand(B, K, generator=g) < 0.6  # many drafts are the argmax, so chains get accepted
    drafts = torch.where(follow, logits[:, :K].argmax(-1), drafts)
    n = torch.randint(0, K + 1, (B,), generator=g)
    drafts = torch.where(torch.arange(K)[None, :] < n[:, None], drafts, -1)
    u = RejectionUniforms(accept=torch.rand(B, K, generator=g), sample=torch.rand(B, K + 1, generator=g))
    return logits, p, q, drafts, n, u


def test_greedy_rows_are_exactly_strict():
    g = torch.Generator().manual_seed(3)
    B, K, V = 400, 4, 12
    _, p, q, drafts, n, u = _greedy_batch(B, K, V, g)
    strict = verify_chain(p, drafts, n, None, u, "strict")
    for dq in (q, None):
        block = verify_chain(p, drafts, n, dq, u, "block")
        assert torch.equal(block.output_token_ids, strict.output_token_ids)
        assert torch.equal(block.num_accepted, strict.num_accepted)
    assert 0 < int(strict.num_accepted.sum()) < int(n.sum())  # some accepted, some rejected


def test_verify_step_block_rows_greedy_and_without_q_are_strict():
    """The device sampler's step: greedy rows and rows whose drafts carry no q give strict's
    tokens; sampled rows with q differ from strict somewhere (they are verified as blocks)."""
    g = torch.Generator().manual_seed(4)
    B, K, V = 64, 3, 10
    logits = torch.randn(B * (K + 1), V, generator=g) * 2
    row_index = torch.arange(B * (K + 1)).view(B, K + 1)
    q = torch.softmax(torch.randn(B, K, V, generator=g), dim=-1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    n = torch.full((B,), K)
    temps = [0.0 if b % 4 == 0 else 1.0 for b in range(B)]
    has_q = torch.tensor([b % 4 != 1 for b in range(B)])
    req = RequestTensors.build(temps, [0] * B, [1.0] * B, [0.0] * B, list(range(B)), [3] * B)
    block = verify_step(logits, row_index, drafts, n, req, method="block", draft_probs=q, draft_has_q=has_q)
    strict = verify_step(logits, row_index, drafts, n, req, method="strict")
    plain = torch.tensor([b % 4 in (0, 1) for b in range(B)])  # greedy, or no q
    assert torch.equal(block[plain], strict[plain])
    assert not torch.equal(block[~plain], strict[~plain])
    # without any q every row is strict
    assert torch.equal(verify_step(logits, row_index, drafts, n, req, method="block"), strict)


def test_short_drafts_and_padding():
    """Rows with fewer drafts than K: nothing past n is read or emitted; n = 0 samples p_0 with
    the position's SAMPLE number (the token of plain decoding)."""
    g = torch.Generator().manual_seed(5)
    B, K, V = 300, 3, 8
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    n = torch.arange(B) % (K + 1)
    drafts = torch.where(torch.arange(K)[None, :] < n[:, None], drafts, -1)
    u = RejectionUniforms(accept=torch.rand(B, K, generator=g), sample=torch.rand(B, K + 1, generator=g))
    out = verify_chain(p, drafts, n, q, u, "block")
    assert bool((out.num_accepted <= n).all())
    pos = torch.arange(K + 1)[None, :]
    assert bool((out.output_token_ids[pos > out.num_accepted[:, None]] == -1).all())
    assert bool((out.output_token_ids[pos <= out.num_accepted[:, None]] >= 0).all())
    zero = n == 0
    strict = verify_chain(p, drafts, n, None, u, "strict")
    assert torch.equal(out.output_token_ids[zero], strict.output_token_ids[zero])
    # garbage past n (a q of zeros, other drafts) changes nothing
    q2 = torch.where(pos[:, :K, None] < n[:, None, None], q, torch.zeros_like(q))
    p2 = torch.where(pos[:, :, None] <= n[:, None, None], p, torch.full_like(p, 1.0 / V))
    again = verify_chain(p2, drafts, n, q2, u, "block")
    assert torch.equal(again.output_token_ids, out.output_token_ids)
    # K = 0: plain decoding's token from p_0
    u0 = RejectionUniforms(u.accept[:, :0], u.sample[:, :1])
    none = torch.zeros(B, dtype=torch.int64)
    k0 = verify_chain(p[:, :1], drafts[:, :0], none, None, u0, "block")
    assert torch.equal(k0.output_token_ids, verify_chain(p[:, :1], drafts[:, :0], none, None, u0, "strict").output_token_ids)


def test_block_has_no_kernel():
    g = torch.Generator().manual_seed(6)
    p = torch.softmax(torch.randn(2, 2, 4, generator=g), -1)
    u = RejectionUniforms(torch.rand(2, 1, generator=g), torch.rand(2, 2, generator=g))
    with pytest.raises(ValueError, match="use_kernel"):
        verify_chain(p, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int64), None, u, "block",
                     use_kernel=True)
    with pytest.raises(ValueError, match="target_probs"):
        verify_chain(None, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int64), None, u, "block",
                     target_tokens=torch.zeros(2, 2, dtype=torch.int64))


def test_block_numbers_are_keyed_by_the_step():
    """Block's accept tests: u(seed, step's first position, ACCEPT, lane j + 1), per row
    whatever the batch; its draws stay positional (SAMPLE, as every method's)."""
    seed = torch.tensor([3, -7, 2**40], dtype=torch.int64)
    pos = torch.tensor([0, 5, 6], dtype=torch.int64)
    u = step_uniforms(seed, pos, 4, "block")
    for b in range(3):
        lanes = torch.arange(1, 5)[:, None]
        want = keyed_uniforms(seed[b].repeat(4), pos[b].repeat(4), 1, ACCEPT, lane=lanes)[:, 0]
        assert torch.equal(u.accept[b], want)
        alone = step_uniforms(seed[b : b + 1], pos[b : b + 1], 4, "block")
        assert torch.equal(alone.accept[0], u.accept[b])
    assert torch.equal(u.sample, keyed_uniforms(seed, pos, 5, SAMPLE))
    # none of a step's numbers is a positional number nor another step's
    later = block_uniforms(seed, pos + 1, 4, ACCEPT)
    positional = keyed_uniforms(seed, pos, 5, ACCEPT)
    for b in range(3):
        mine = set(u.accept[b].tolist())
        assert not mine & set(later[b].tolist()) and not mine & set(positional[b].tolist())


def test_sampled_drafts_are_keyed_by_the_round():
    """DraftColumns keys column c of a round at output position P by u(seed, P, DRAFT, lane c + 1)."""
    V = 6
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0)).expand(500, V)
    seqs = [SimpleNamespace(params=SamplingParams(temperature=1.0), seed=i, num_output_tokens=9) for i in range(500)]
    sampler = HeadSampler(True, V, torch.device("cpu"))
    cols = DraftColumns(sampler, 500, list(range(500)), seqs, [2] * 500)
    t0, t1 = cols.draw(logits, list(range(500)), 0), cols.draw(logits, list(range(500)), 1)
    for col, t in ((0, t0), (1, t1)):
        want, _ = sampler.draw(logits, seqs, [9] * 500, [col + 1] * 500)
        assert torch.equal(t, want)
    positional, _ = sampler.draw(logits, seqs, [10] * 500)  # the old key of column 1
    assert not torch.equal(t1, positional)


# ---------------------------------------------------------------------------------------
# Several steps with the engine's keyed numbers.

MARKOV_V, MARKOV_K, MARKOV_L = 2, 3, 4


def _markov_models():
    g = torch.Generator().manual_seed(1)
    V = MARKOV_V
    p = torch.softmax(torch.randn(V + 1, V, generator=g) * 2, -1)  # row V: the first token's context
    base = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    q = 0.2 * torch.softmax(torch.randn(V + 1, V, generator=g) * 2, -1) + 0.8 * base  # nearly context-free
    return p, q


def _decode_markov(N: int, engine_keys: bool) -> float:
    """N seeded requests decoded MARKOV_L tokens by block verification, step after step, the
    drafts sampled from q through the heads' DraftColumns; returns the total variation of
    the L-token joint from the target's.  engine_keys=False: every number keyed by its
    output position (lane 0), as probabilistic verification may."""
    V, K, L = MARKOV_V, MARKOV_K, MARKOV_L
    p, q = _markov_models()
    seeds = torch.arange(N, dtype=torch.int64) * 7919 + 12345
    seqs = [SimpleNamespace(params=SamplingParams(temperature=1.0), seed=int(s), num_output_tokens=0) for s in seeds]
    sampler = HeadSampler(True, V, torch.device("cpu"))
    out = torch.full((N, L + K + 1), -1, dtype=torch.int64)
    length = torch.zeros(N, dtype=torch.int64)
    everyone = list(range(N))
    while bool((length < L).any()):
        P = length.clone()
        for s, n in zip(seqs, P.tolist()):
            s.num_output_tokens = n
        ctx = torch.where(P > 0, out.gather(1, (P - 1).clamp(min=0)[:, None])[:, 0], torch.full_like(P, V))
        cols = DraftColumns(sampler, N, everyone, seqs, [K] * N)
        drafts = torch.empty(N, K, dtype=torch.int64)
        tp, dq = torch.empty(N, K + 1, V), torch.empty(N, K, V)
        for j in range(K):
            tp[:, j] = p[ctx]
            if engine_keys:  # the heads' own drawing
                drafts[:, j] = cols.draw(q[ctx].log(), everyone, j)
                dq[:, j] = cols.probs[:, j]
            else:
                drafts[:, j], dq[:, j] = sampler.draw(q[ctx].log(), seqs, (P + j).tolist())
            ctx = drafts[:, j]
        tp[:, K] = p[ctx]
        u = step_uniforms(seeds, P, K, "block" if engine_keys else "probabilistic")
        r = verify_chain(tp, drafts, torch.full((N,), K), dq, u, "block")
        for j in range(K + 1):
            m = (j <= r.num_accepted) & (length < L)
            idx = (P + j).clamp(max=out.shape[1] - 1)
            out[m, idx[m]] = r.output_token_ids[m, j]
        length = torch.where(length < L, length + r.num_accepted + 1, length)
    code = sum(out[:, i] * V ** (L - 1 - i) for i in range(L))
    emp = torch.bincount(code, minlength=V**L).double() / N
    exact = []
    for s in itertools.product(range(V), repeat=L):
        pr, c = 1.0, V
        for t in s:
            pr, c = pr * float(p[c, t]), t
        exact.append(pr)
    return 0.5 * (emp - torch.tensor(exact, dtype=torch.float64)).abs().sum().item(), noise_tv(exact, N)


def test_many_steps_with_the_engine_keys_are_lossless():
    """Block decides with every draft and test of its step, the ones past the emitted tokens
    too: a later step reading those numbers again would bias its drafts and tests.  The
    engine keys them by the step (lanes), and the joint of 4 tokens decoded over several
    steps follows the target; keyed by position instead, it visibly does not."""
    N = 100_000
    tv, noise = _decode_markov(N, engine_keys=True)
    assert tv < 2 * noise, (tv, noise)
    reused, _ = _decode_markov(N, engine_keys=False)
    assert reused > 5 * noise, (reused, noise)


# ---------------------------------------------------------------------------------------
# The engine: a sampling EAGLE-3 head, block verification, temperature 1.

ENGINE_V = 16
PROMPT = [5, 9, 3, 12, 7]


@pytest.fixture(scope="module")
def eagle_setup(tmp_path_factory):
    from eagle_heads import write_head
    from specserve.executor.loader import load_model
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("block-eagle")
    tdir = make_tiny_model(root / "target", "llama", seed=5, vocab_size=ENGINE_V, num_key_value_heads=4)
    head = write_head(root / "head", "eagle3", seed=3, aux_ids=[0, 1, 1], vocab=ENGINE_V, draft_vocab=12)
    return tdir, head, load_model(str(tdir), "float32", torch.device("cpu"))


def _exact_next(target, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """The target's exact marginals of the next ``steps`` tokens after ``prompt`` (temperature 1)."""
    from specserve.executor.backends.torch_backend import TorchRunner
    from specserve.executor.batch import SeqInput
    from specserve.executor.kv_cache import KVCache
    from specserve.kv_blocks import BlockManager

    a = target.arch
    kv = KVCache(a.num_layers, 64, 4, a.num_kv_heads, a.head_dim, target.dtype, target.device)
    runner, blocks = TorchRunner(target, kv), BlockManager(64, 4)

    def dist(ids):
        table: list[int] = []
        blocks.ensure(table, len(ids))
        try:
            return torch.softmax(runner.forward([SeqInput(ids, 0, table, [len(ids) - 1])]).logits[0].double(), -1)
        finally:
            blocks.free(table)

    marginals = [torch.zeros(ENGINE_V, dtype=torch.float64) for _ in range(steps)]
    frontier = [((), 1.0)]
    for j in range(steps):
        nxt = []
        for pre, pr in frontier:
            d = dist(prompt + list(pre)) * pr
            marginals[j] += d
            nxt += [(pre + (t,), float(d[t])) for t in range(ENGINE_V)] if j + 1 < steps else []
        frontier = nxt
    return marginals


def test_engine_block_verification_keeps_the_target_distribution(eagle_setup):
    from specserve.engine.engine import LLMEngine

    tdir, head, target = eagle_setup
    cfg = tiny_config(tdir, "eagle3", k=2, draft_dir=head, num_blocks=4096, rejection_sample_method="block")
    cfg.engine.max_num_seqs = 512
    eng = LLMEngine(cfg, target=target)
    N = 4000
    outs = eng.generate([PROMPT] * N, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i)
                                      for i in range(N)])
    assert all(len(o.token_ids) == 3 for o in outs)
    drafted = sum(o.spec.num_draft_tokens for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert 0 < accepted < drafted  # drafts were verified, some rejected
    assert eng.blocks.num_free == eng.blocks.num_blocks  # every KV block freed
    exact = _exact_next(target, PROMPT, 3)
    for pos in range(3):
        counts = torch.bincount(torch.tensor([o.token_ids[pos] for o in outs]), minlength=ENGINE_V).double()
        tv = 0.5 * float((counts / N - exact[pos]).abs().sum())
        # sampling noise at N = 4000 on 16 outcomes is about 0.02-0.03
        assert tv < 0.05, (pos, tv)
