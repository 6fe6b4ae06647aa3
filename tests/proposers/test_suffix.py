"""Suffix decoding: the index against brute-force counts, the speculation rules
(depth, max_spec_factor, min_token_prob, local vs global, FIFO eviction), and
the proposer's finish-vs-preemption handling."""

from __future__ import annotations

import random
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.config import SpeculativeConfig
from specserve.engine.sequence import Sequence, Status
from specserve.methods import method_options
from specserve.methods.suffix import SuffixOptions
from specserve.proposers.base import DraftRequest
from specserve.proposers.suffix import (
    SuffixCache, SuffixIndex, SuffixProposer, _granule, _int_bytes, _Node, _subtree_bytes,
)  # fmt: skip
from specserve.request import SamplingParams

# ------------------------------------------------------------------ brute-force reference


def ref_counts(seqs: list[list[int]], depth: int) -> Counter:
    """Occurrences of every substring of length 1..depth."""
    c: Counter = Counter()
    for s in seqs:
        for j in range(len(s)):
            for n in range(1, min(depth, len(s) - j) + 1):
                c[tuple(s[j : j + n])] += 1
    return c


def tree_counts(ix: SuffixIndex) -> Counter:
    """Every (path, count) the index represents, tails expanded."""
    out: Counter = Counter()

    def walk(node: _Node, path: tuple) -> None:
        for tok, child in node.children.items():
            p = path + (tok,)
            if type(child) is tuple:
                seq, pos = child
                assert seq[pos] == tok
                q = p
                out[q] += 1
                while len(q) < ix.max_depth and pos + 1 < len(seq):
                    pos += 1
                    q = q + (seq[pos],)
                    out[q] += 1
            else:
                assert child.count > 0
                out[p] += child.count
                walk(child, p)

    walk(ix.root, ())
    return out


def ref_speculate(counts: Counter, context: list[int], depth: int, max_tokens: int, factor: float,
                  min_prob: float, to_beat: tuple[float, int] = (0.0, 0)) -> tuple[list[int], float, int]:
    """The rules of the module docstring, on brute-force counts: the best (score, match length)."""
    best: tuple[list[int], float, int] = ([], 0.0, 0)
    for m in range(min(len(context), depth - 1), 0, -1):
        path = tuple(context[-m:])
        if counts[path] == 0:
            continue
        budget = min(max_tokens, int(m * factor + 1e-9), depth - m)
        toks: list[int] = []
        prob, score = 1.0, 0.0
        while len(toks) < budget:
            nxt = {k[-1]: v for k, v in counts.items() if len(k) == len(path) + 1 and k[:-1] == path}
            total = sum(nxt.values())
            if total == 0:
                break
            tok = min(nxt, key=lambda t: (-nxt[t], t))
            p = prob * nxt[tok] / total
            if p < min_prob:
                break
            prob = p
            toks.append(tok)
            score += prob
            path = path + (tok,)
        if toks and (score, m) > to_beat:
            to_beat = (score, m)
            best = (toks, score, m)
    return best


seqs_st = st.lists(st.integers(0, 3), min_size=0, max_size=40)


# ------------------------------------------------------------------ the index


@settings(max_examples=150, deadline=None)
@given(st.lists(seqs_st, min_size=1, max_size=4), st.integers(1, 7), st.data())
def test_index_counts_equal_brute_force_under_appends_and_removals(seqs, depth, data):
    ix = SuffixIndex(depth)
    for i, s in enumerate(seqs):
        # Appended in random chunks: the index must not depend on how tokens arrive.
        pos = 0
        while pos < len(s):
            n = data.draw(st.integers(1, 5))
            ix.extend(i, s[pos : pos + n])
            pos += n
        ix.close()
    assert tree_counts(ix) == ref_counts([s for s in seqs if s], depth)
    assert ix.root.count == sum(len(s) for s in seqs)
    kept = list(range(len(seqs)))
    for i in data.draw(st.permutations(range(len(seqs)))):
        if i not in ix:
            continue  # an empty sequence was never created
        ix.remove(i)
        kept.remove(i)
        assert tree_counts(ix) == ref_counts([seqs[k] for k in kept], depth)
    assert not ix.root.children and ix.root.count == 0


@settings(max_examples=150, deadline=None)
@given(seqs_st, st.integers(2, 8), st.integers(1, 8), st.sampled_from([0.5, 1.0, 2.0]),
       st.sampled_from([0.0, 0.1, 0.3, 0.6]))
def test_own_speculation_equals_brute_force_at_every_length(seq, depth, k, factor, min_prob):
    ix = SuffixIndex(depth)
    for n in range(len(seq)):
        ix.extend("r", seq[n : n + 1])
        ctx = seq[: n + 1]
        d = ix.speculate(ctx, k, factor, min_prob, own=True)
        # The request's own last occurrence has no continuation: brute force on the same sequence.
        toks, score, m = ref_speculate(ref_counts([ctx], depth), ctx, depth, k, factor, min_prob)
        assert (d.token_ids, d.match_len) == (toks, m)
        assert d.score == pytest.approx(score)


@settings(max_examples=150, deadline=None)
@given(st.lists(seqs_st, min_size=1, max_size=4), seqs_st, st.integers(2, 8), st.integers(1, 8),
       st.sampled_from([0.5, 1.0, 3.0]), st.sampled_from([0.0, 0.1, 0.4]))
def test_global_speculation_equals_brute_force(responses, context, depth, k, factor, min_prob):
    ix = SuffixIndex(depth)
    for i, s in enumerate(responses):
        ix.extend(i, s)
        ix.close()
    d = ix.speculate(context, k, factor, min_prob)
    toks, score, m = ref_speculate(ref_counts(responses, depth), context, depth, k, factor, min_prob)
    assert (d.token_ids, d.match_len) == (toks, m)
    assert d.score == pytest.approx(score)


def test_counts_and_most_frequent_continuation():
    ix = SuffixIndex(8)
    ix.extend(0, [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2])
    assert ix.count([1, 2]) == 4 and ix.count([1, 2, 3]) == 2 and ix.count([1, 2, 4]) == 1
    assert ix.count([7]) == 0
    d = ix.speculate(ix.tokens(0), 8, 1.0, 0.1, own=True)
    # "9 1 2" went on with 3 and 4 once each (its last occurrence is ours, nothing after it
    # yet): P(3) = 1/2 (tie -> smaller id), then "9 1" for certain; 3 tokens (factor 1.0 x 3).
    # "1 2" gives 3 with 2/3 but only 2 tokens: 4/3 < 1.5.
    assert d.token_ids == [3, 9, 1] and d.match_len == 3 and d.score == pytest.approx(1.5)


def test_depth_bound_limits_match_plus_draft():
    seq = list(range(10)) * 3  # the period repeats: long matches everywhere
    for depth in (3, 5, 12):
        ix = SuffixIndex(depth)
        ix.extend(0, seq)
        assert all(len(p) <= depth for p in tree_counts(ix))
        d = ix.speculate(ix.tokens(0), 100, 100.0, 0.0, own=True)
        assert d.match_len + len(d.token_ids) <= depth
        # Every continuation is certain, so the 1-token match with depth - 1 drafts scores best.
        assert d.match_len + len(d.token_ids) == depth and d.match_len == 1
        assert d.token_ids == [(seq[-1] + 1 + i) % 10 for i in range(depth - 1)]


def test_max_spec_factor_caps_draft_by_match_length():
    resp = list(range(100, 140))
    for factor, ctx_len, want in [(1.0, 3, 3), (0.5, 4, 2), (2.0, 3, 6), (0.4, 2, 0)]:
        ix = SuffixIndex(24)
        ix.extend(0, resp)
        ix.close()
        ctx = [7] + resp[:ctx_len]  # matches exactly ctx_len tokens
        d = ix.speculate(ctx, 16, factor, 0.1)
        assert d.token_ids == resp[ctx_len : ctx_len + want]
        assert d.match_len == (ctx_len if want else 0)


def test_min_token_prob_stops_at_uncertain_branches():
    # After "1 2": 3 in three responses, 4 in one -> P(3) = 0.75; then each branch is certain.
    ix = SuffixIndex(10)
    for i, r in enumerate([[1, 2, 3, 5, 6], [1, 2, 3, 5, 6], [1, 2, 3, 5, 6], [1, 2, 4, 7, 8]]):
        ix.extend(i, r)
        ix.close()
    assert ix.speculate([1, 2], 8, 4.0, 0.7).token_ids == [3, 5, 6]
    assert ix.speculate([1, 2], 8, 4.0, 0.8).token_ids == []
    # The running product: 0.75 x P(5 | 1 2 3) = 0.75 x 1 stays above 0.7.
    d = ix.speculate([1, 2], 8, 4.0, 0.1)
    assert d.token_ids == [3, 5, 6] and d.score == pytest.approx(0.75 * 3)


def test_local_and_global_best_score_wins():
    c = SuffixCache(max_depth=24, max_cached_requests=10)
    c.stop("old", [50, 51, 52, 53, 54, 55, 56, 57])
    c.extend("r", [1, 2, 3, 50, 51, 52])  # the global response continues it, the request has no repeat
    d = c.speculate("r", 8, 1.0, 0.1)
    assert d.source == "global" and d.token_ids == [53, 54, 55]
    c.extend("r", [9, 1, 2, 3, 50, 51, 52])  # now the request itself has a longer match
    d = c.speculate("r", 8, 1.0, 0.1)
    assert d.source == "request" and d.token_ids == [9, 1, 2, 3, 50, 51] and d.match_len == 6


def test_fifo_eviction_and_disabled_global_cache():
    c = SuffixCache(max_depth=8, max_cached_requests=2)
    for i in range(4):
        c.stop(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4])
    assert c.num_cached_responses == 2
    assert tree_counts(c.global_index) == ref_counts([[21, 22, 23, 24], [31, 32, 33, 34]], 8)
    c.extend("q", [11, 12])
    assert c.speculate("q", 4, 1.0, 0.1).token_ids == []  # the first responses were evicted
    c.extend("q", [31, 32])
    assert c.speculate("q", 4, 1.0, 0.1).token_ids == [33, 34]
    off = SuffixCache(max_depth=8, max_cached_requests=0)
    off.stop("a", [1, 2, 3])
    assert off.num_cached_responses == 0
    off.extend("b", [1, 2])
    assert off.speculate("b", 4, 1.0, 0.1).token_ids == []


def test_random_fifo_matches_brute_force():
    rng = random.Random(0)
    c = SuffixCache(max_depth=6, max_cached_requests=5)
    cached: list[list[int]] = []
    for i in range(60):
        resp = [rng.randrange(4) for _ in range(rng.randrange(0, 25))]
        c.stop(f"r{i}", resp)
        if resp:
            cached = (cached + [resp])[-5:]
        assert tree_counts(c.global_index) == ref_counts(cached, 6)
        ctx = [rng.randrange(4) for _ in range(rng.randrange(1, 10))]
        c.extend(f"q{i}", ctx)
        want = ref_speculate(ref_counts([ctx], 6), ctx, 6, 5, 1.0, 0.1)
        want_g = ref_speculate(ref_counts(cached, 6), ctx, 6, 5, 1.0, 0.1, to_beat=(want[1], want[2]))
        d = c.speculate(f"q{i}", 5, 1.0, 0.1)
        assert d.token_ids == (want_g[0] if want_g[0] else want[0])
        c.stop(f"q{i}")
    assert not c.requests


# ------------------------------------------------------------------ memory bound and tenants


def recount_bytes(ix: SuffixIndex) -> int:
    """An index's memory estimate computed from scratch: what its incremental num_bytes must equal."""
    total = _subtree_bytes(ix.root) + sys.getsizeof(ix._seqs)
    for seq in ix._seqs.values():
        total += _granule(sys.getsizeof(seq)) + sum(_int_bytes(t) for t in seq)
    return total


def fresh_ints(tokens: list[int]) -> list[int]:
    """The same ids as new int objects, as the engine makes them (each token id is its own object)."""
    return [int(str(t)) for t in tokens]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.sampled_from([1, 2, 300, 301, 40000]), max_size=40), min_size=1, max_size=5),
       st.integers(1, 7), st.data())
def test_byte_estimate_follows_appends_and_removals(seqs, depth, data):
    ix = SuffixIndex(depth)
    for i, s in enumerate(seqs):
        pos = 0
        while pos < len(s):
            n = data.draw(st.integers(1, 5))
            ix.extend(i, s[pos : pos + n])
            pos += n
            assert ix.num_bytes == recount_bytes(ix)
        ix.close()
    for i in data.draw(st.permutations(range(len(seqs)))):
        if i in ix:
            ix.remove(i)
            assert ix.num_bytes == recount_bytes(ix)


def test_byte_estimate_is_what_cpython_allocates():
    """Long sequences (tail positions past the shared small ints) of large token ids: the
    estimate agrees with tracemalloc's count of what the index allocated."""
    import tracemalloc

    rng = random.Random(5)
    vocab = [1000 + 37 * i for i in range(400)]
    weights = [1.0 / (i + 1) for i in range(len(vocab))]  # Zipf-like, as text is
    responses = [rng.choices(vocab, weights, k=rng.randrange(50, 600)) for _ in range(60)]
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        ix = SuffixIndex(24)
        for i, r in enumerate(responses):
            ix.extend(i, fresh_ints(r))
            ix.close()
        traced = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    assert ix.num_bytes == recount_bytes(ix)
    assert 0.9 * traced <= ix.num_bytes <= 1.15 * traced, (ix.num_bytes, traced)


def test_global_cache_is_bounded_by_bytes_oldest_first():
    rng = random.Random(2)
    # Each response from its own token range: what a context matches says which response is kept.
    responses = [[rng.randrange(1000 + 100 * i, 1050 + 100 * i) for _ in range(60)] for i in range(40)]
    one = SuffixCache(max_depth=8, max_cached_bytes=1 << 40)
    one.stop("probe", responses[0])
    cap = 6 * one.num_bytes  # room for a handful of responses, not for 40
    c = SuffixCache(max_depth=8, max_cached_requests=1000, max_cached_bytes=cap)
    for i, r in enumerate(responses):
        c.stop(f"r{i}", r)
        assert c.num_bytes <= cap
        assert c.num_bytes == sum(recount_bytes(ix) for ix in c.global_indexes.values())
        # What is kept is always the newest responses, in order.
        kept = responses[i + 1 - c.num_cached_responses : i + 1]
        assert tree_counts(c.global_index) == ref_counts(kept, 8)
    assert 1 < c.num_cached_responses < 10  # over the cap many times: the oldest went first
    c.extend("q", responses[0][:5])
    assert c.speculate("q", 4, 1.0, 0.1).token_ids == []  # the first response is gone
    c.extend("q2", responses[-1][:5])
    assert c.speculate("q2", 4, 1.0, 0.1).token_ids == responses[-1][5:9]
    off = SuffixCache(max_depth=8, max_cached_bytes=0)
    off.stop("a", [1, 2, 3])
    assert off.num_cached_responses == 0 and off.num_bytes == 0


def test_a_response_larger_than_the_byte_cap_is_not_kept():
    c = SuffixCache(max_depth=8, max_cached_bytes=2000)
    c.stop("small", [5, 6])
    c.stop("big", list(range(1000, 1400)))
    assert c.num_cached_responses == 0 and c.num_bytes == 0 and not c.global_indexes


def test_tenants_draft_only_from_their_own_responses():
    c = SuffixCache(max_depth=24, max_cached_requests=10)
    secret = [70, 71, 72, 73, 74, 75, 76, 77]
    c.stop("a", secret, tenant="alice")
    for tenant in ("bob", None):
        c.extend(f"guess-{tenant}", [70, 71, 72, 73])
        assert c.speculate(f"guess-{tenant}", 8, 1.0, 0.1, tenant).token_ids == []
    c.extend("alice-again", [70, 71, 72, 73])
    assert c.speculate("alice-again", 8, 1.0, 0.1, "alice").token_ids == [74, 75, 76, 77]


def test_caps_apply_to_all_tenants_together_oldest_first():
    c = SuffixCache(max_depth=8, max_cached_requests=3)
    for i, tenant in enumerate(["a", "b", "a", "c", "b"]):
        c.stop(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], tenant=tenant)
    assert c.num_cached_responses == 3
    assert set(c.global_indexes) == {"a", "b", "c"}  # r0 (a) and r1 (b) went; r2 keeps a's index
    assert [c.global_indexes[t].tokens(i) for t, i in (("a", 2), ("c", 3), ("b", 4))] == [
        [21, 22, 23], [31, 32, 33], [41, 42, 43]]  # fmt: skip
    c.stop("r5", [51, 52], tenant="d")
    c.stop("r6", [61, 62], tenant="d")
    assert "a" not in c.global_indexes  # its last response was evicted: the whole index went
    assert c.num_bytes == sum(recount_bytes(ix) for ix in c.global_indexes.values())


def test_proposer_partitions_by_the_sequences_cache_salt():
    p = SuffixProposer(_spec(k=4))
    a = _seq("a", [1, 2, 3], [40, 41, 42, 43, 44, 45], salt="tenant-a")
    p.propose([DraftRequest(a, 4)])
    a.status = Status.FINISHED
    p.remove("a")
    assert p.cache_usage() == (p.cache.num_bytes, 1) and p.cache.num_bytes > 0
    other = _seq("b", [9], [40, 41, 42], salt="tenant-b")
    same = _seq("c", [9], [40, 41, 42], salt="tenant-a")
    unsalted = _seq("d", [9], [40, 41, 42])
    assert p.propose([DraftRequest(other, 4), DraftRequest(same, 4), DraftRequest(unsalted, 4)]).token_ids == [
        [], [43, 44, 45], []]  # fmt: skip


def test_closed_sequence_cannot_be_extended():
    ix = SuffixIndex(4)
    ix.extend(0, [1, 2])
    ix.extend(1, [3])
    with pytest.raises(ValueError):
        ix.extend(0, [4])


class _CountingChildren(dict):
    """A trie node's children that count every access (a measure of work, not of time)."""

    ops = 0

    def get(self, *a):
        _CountingChildren.ops += 1
        return super().get(*a)

    def __getitem__(self, k):
        _CountingChildren.ops += 1
        return super().__getitem__(k)

    def __setitem__(self, k, v):
        _CountingChildren.ops += 1
        super().__setitem__(k, v)

    def items(self):
        _CountingChildren.ops += len(self)
        return super().items()


class _CountingNode(_Node):
    __slots__ = ()

    def __init__(self, count: int):
        super().__init__(count)
        self.children = _CountingChildren()


def test_incremental_updates_cost_bounded_work(monkeypatch):
    """Appending to a long sequence touches at most max_depth suffixes per token, and a
    draft walks at most max_depth nodes: the work per step does not grow with the length
    (counted as trie accesses, so the machine's speed does not matter)."""
    import specserve.proposers.suffix as suffix

    monkeypatch.setattr(suffix, "_Node", _CountingNode)
    rng = random.Random(1)
    seq = [rng.randrange(50) for _ in range(4000)]
    ix = SuffixIndex(24)
    per_step = []
    for i in range(0, len(seq), 4):
        before = _CountingChildren.ops
        ix.extend(0, seq[i : i + 4])
        ix.speculate(ix.tokens(0), 8, 1.0, 0.1, own=True)
        per_step.append(_CountingChildren.ops - before)
    assert min(per_step) > 0  # the counting trie is the one in use
    # Appending: <= 4 tokens x 24 suffixes (+ a node per split); a draft: <= 23 loci x 8 steps
    # over at most 50 children each.  A rebuild per step would cost ~24 x the length.
    bound = 4 * 24 * 2 + 23 * 8 * 50
    assert max(per_step) <= bound, max(per_step)
    late, early = per_step[-100:], per_step[100:200]
    assert max(late) <= 2 * max(early), (max(early), max(late))  # no growth with the length


# ------------------------------------------------------------------ the proposer glue


def _spec(**kw) -> SuffixOptions:
    return method_options("suffix", num_speculative_tokens=kw.pop("k", 4), **kw)


def _seq(rid: str, prompt: list[int], out: list[int], salt: str | None = None) -> Sequence:
    params = SamplingParams(max_tokens=50, **({"cache_salt": salt} if salt is not None else {}))
    s = Sequence(request_id=rid, prompt_token_ids=prompt, params=params)
    s.token_ids = prompt + out
    s.status = Status.RUNNING
    return s


def test_proposer_caches_finished_outputs_not_preempted_ones():
    p = SuffixProposer(_spec(k=4))
    a = _seq("a", [1, 2, 3], [40, 41, 42, 43, 44, 45])
    p.propose([DraftRequest(a, 4)])
    a.status = Status.WAITING  # preempted: the engine calls remove, then recomputes later
    p.remove("a")
    assert p.cache.num_cached_responses == 0 and "a" not in p.cache.requests
    assert p.propose([DraftRequest(a, 4)]).token_ids == [[]]  # rebuilt from the sequence's tokens
    a.token_ids += [46, 47]
    a.status = Status.FINISHED
    p.remove("a")
    assert p.cache.num_cached_responses == 1
    assert p.cache.global_index.tokens(0) == [40, 41, 42, 43, 44, 45, 46, 47]  # output only, not the prompt
    b = _seq("b", [9, 9], [40, 41, 42])
    assert p.propose([DraftRequest(b, 4)]).token_ids == [[43, 44, 45]]  # 3-token match: factor 1.0
    assert p.propose([DraftRequest(b, 2)]).token_ids == [[43, 44]]  # max_drafts bounds it
    p.remove("b")  # never finished (status RUNNING): e.g. an engine that drops it


def test_proposer_index_follows_the_sequence_incrementally():
    p = SuffixProposer(_spec(k=8, suffix_decoding_max_cached_requests=0))
    s = _seq("r", [5, 6, 7, 8, 1, 2], [5, 6])
    assert p.propose([DraftRequest(s, 8)]).token_ids == [[7, 8]]
    s.token_ids += [7, 8, 1]
    assert p.propose([DraftRequest(s, 8)]).token_ids == [[2, 5, 6, 7, 8]]
    assert p.cache.requests["r"].tokens("r") == s.token_ids


# ------------------------------------------------------------------ the engine (tiny random model, float32)


def al(outs) -> float:
    """Mean acceptance length over drafting rounds."""
    return 1 + sum(o.spec.num_accepted_tokens for o in outs) / max(1, sum(o.spec.num_drafts for o in outs))


def rate(outs) -> float:
    return sum(o.spec.num_accepted_tokens for o in outs) / max(1, sum(o.spec.num_draft_tokens for o in outs))


@pytest.fixture(scope="module")
def prompts():
    from engine_utils import random_prompts

    return random_prompts(10, seed=3)


@pytest.fixture(scope="module")
def vanilla_outputs(tiny_llama, prompts):
    from engine_utils import greedy, run, tiny_config
    from specserve.engine.engine import LLMEngine

    return run(LLMEngine(tiny_config(tiny_llama)), prompts, [greedy(24) for _ in prompts])


@pytest.mark.parametrize("k", [2, 5])
def test_engine_greedy_equals_plain_decoding(tiny_llama, prompts, vanilla_outputs, k):
    from engine_utils import greedy, tiny_config
    from specserve.engine.engine import LLMEngine

    eng = LLMEngine(tiny_config(tiny_llama, "suffix", k=k))
    outs = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == vanilla_outputs
    drafts = sum(o.spec.num_draft_tokens for o in outs)
    accepted = sum(o.spec.num_accepted_tokens for o in outs)
    assert drafts > 0 and 0 < accepted < drafts  # both acceptance and rejection were exercised
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.proposer.cache.num_cached_responses == len(prompts) and not eng.proposer.cache.requests
    # A second pass of the same prompts: the global tree holds the first answers.
    again = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in again] == vanilla_outputs
    # Drafts are short early in each answer (max_spec_factor x a short match), so AL < K + 1,
    # but nearly every drafted token is right.
    assert al(again) > al(outs) and rate(again) > 0.9
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_engine_preemption_is_lossless_and_caches_each_response_once(tiny_llama, prompts, vanilla_outputs):
    from engine_utils import greedy, tiny_config
    from specserve.engine.engine import LLMEngine

    eng = LLMEngine(tiny_config(tiny_llama, "suffix", k=4, num_blocks=24, block_size=4))
    removed: list[str] = []
    remove = eng.proposer.remove
    eng.proposer.remove = lambda rid: (removed.append(rid), remove(rid))[1]
    outs = eng.generate(prompts, [greedy(24) for _ in prompts])
    assert [o.token_ids for o in outs] == vanilla_outputs
    assert len(removed) > len(prompts)  # some requests were preempted (remove called before finishing)
    assert eng.proposer.cache.num_cached_responses == len(prompts)
    cached = sorted(tuple(eng.proposer.cache.global_index.tokens(i)) for i in range(len(prompts)))
    assert cached == sorted(tuple(o) for o in vanilla_outputs)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_engine_sampling_aborts_and_eviction_leave_nothing_behind(tiny_llama):
    from engine_utils import random_prompts, tiny_config
    from specserve.engine.engine import LLMEngine

    eng = LLMEngine(tiny_config(tiny_llama, "suffix", k=3, num_blocks=64, suffix_decoding_max_cached_requests=4))
    for i, p in enumerate(random_prompts(16, seed=11)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0 if i % 2 else 0.9, max_tokens=5 + i % 13, seed=i))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps % 4 == 0:
            for rid in list(eng.requests)[:1]:
                eng.abort_request(rid)
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert not eng.proposer.cache.requests and not eng.proposer.seqs
    assert eng.proposer.cache.num_cached_responses == 4


def test_another_tenants_answer_leaves_acceptance_counts_unchanged(tiny_llama):
    """The reported attack: tenant B sends A's prompt followed by ever longer guesses of A's
    answer and reads spec_decode.num_accepted_tokens.  Through a shared global tree the
    count grew as the guess approached the answer; per tenant, B's counts are exactly those
    of an engine that never saw A.  A itself still drafts from its own answer."""
    from engine_utils import greedy, random_prompts, tiny_config
    from specserve.engine.engine import LLMEngine

    victim = LLMEngine(tiny_config(tiny_llama, "suffix", k=8))
    control = LLMEngine(tiny_config(tiny_llama, "suffix", k=8))
    prompt = random_prompts(1, seed=41, lo=12, hi=13)[0]
    answer = victim.generate([prompt], [greedy(32, cache_salt="tenant-a")])[0].token_ids

    def accepted(eng, extra: int, salt: str) -> int:
        out = eng.generate([prompt + answer[:extra]], [greedy(16, cache_salt=salt)])[0]
        return out.spec.num_accepted_tokens

    guesses = [0, 2, 4, 8]
    seen = [accepted(victim, n, "tenant-b") for n in guesses]
    assert seen == [accepted(control, n, "tenant-b") for n in guesses]
    fresh = LLMEngine(tiny_config(tiny_llama, "suffix", k=8))
    own = [accepted(victim, n, "tenant-a") for n in guesses]
    assert own != [accepted(fresh, n, "tenant-a") for n in guesses]  # within a tenant the cache is used


def test_engine_byte_cap_and_suffix_cache_metrics(tiny_llama):
    """Responses over the byte cap: the oldest go first, the size stays under the cap, and the
    gauges report the size and count the engine holds."""
    from prometheus_client import CollectorRegistry

    from engine_utils import greedy, random_prompts, tiny_config
    from specserve.engine.engine import LLMEngine
    from specserve.metrics import MetricsIdentity, SpecServeMetrics

    prompts = random_prompts(10, seed=12)
    probe = LLMEngine(tiny_config(tiny_llama, "suffix", k=3))
    probe.generate(prompts[:1], [greedy(24)])
    cap = 3 * probe.proposer.cache.num_bytes  # a few responses' worth
    eng = LLMEngine(tiny_config(tiny_llama, "suffix", k=3, suffix_decoding_max_cached_bytes=cap))
    m = SpecServeMetrics(CollectorRegistry(), MetricsIdentity("tiny", "suffix", 3))
    eng.listeners.append(m)
    labels = {"model_name": "tiny", "method": "suffix"}
    outputs = []
    for p in prompts:  # one at a time: they finish in this order
        outputs.append(eng.generate([p], [greedy(24)])[0].token_ids)
        cache = eng.proposer.cache
        assert cache.num_bytes <= cap
        assert m.registry.get_sample_value("specserve_suffix_cache_bytes", labels) == cache.num_bytes
        assert m.registry.get_sample_value("specserve_suffix_cache_responses", labels) == cache.num_cached_responses
    kept = eng.proposer.cache.global_index
    n = eng.proposer.cache.num_cached_responses
    assert 1 <= n < len(prompts)
    assert sorted(kept.tokens(i) for i in kept._seqs) == sorted(outputs[-n:])  # the newest ones


@pytest.mark.slow
def test_embedded_smollm2_greedy_equals_plain_decoding():
    """The real embedded model in float32: a prompt that invites copying, then the same prompt again."""
    import torch

    from specserve.config import Config, ModelConfig, validate_config
    from specserve.engine.engine import LLMEngine
    from specserve.executor.loader import load_model

    target = load_model("embedded:smollm2-135m-instruct", "float32", torch.device("cpu"))

    def engine(method):
        cfg = Config(model=ModelConfig(dtype="float32"))
        cfg.engine.num_kv_blocks = 64
        if method:
            cfg.method = SpeculativeConfig(method=method, num_speculative_tokens=8)
        return LLMEngine(validate_config(cfg), target=target)

    plain = engine(None)
    tok = plain.tokenizer
    texts = ["Repeat this sentence twice, word for word: The committee will meet on Tuesday at noon in room 12.",
             "List the days of the week, then list them again in the same order."]
    ids = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = [SamplingParams(temperature=0.0, max_tokens=40) for _ in ids]
    ref = [o.token_ids for o in plain.generate(ids, params)]
    eng = engine("suffix")
    first = eng.generate(ids, params)
    second = eng.generate(ids, params)  # the global tree now holds the first answers
    assert [o.token_ids for o in first] == ref and [o.token_ids for o in second] == ref
    assert al(first) > 1.2 and al(second) > al(first)
    assert eng.blocks.num_free == eng.blocks.num_blocks
