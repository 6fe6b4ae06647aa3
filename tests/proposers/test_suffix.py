"""Suffix decoding: the index against brute-force counts, the speculation rules
(depth, max_spec_factor, min_token_prob, local vs global, FIFO eviction), and
the proposer's finish-vs-preemption handling."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.config import SpeculativeConfig
from specserve.engine.sequence import Sequence, Status
from specserve.proposers.base import DraftRequest
from specserve.proposers.suffix import SuffixCache, SuffixIndex, SuffixProposer, _Node
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


def test_closed_sequence_cannot_be_extended():
    ix = SuffixIndex(4)
    ix.extend(0, [1, 2])
    ix.extend(1, [3])
    with pytest.raises(ValueError):
        ix.extend(0, [4])


def test_incremental_updates_cost_bounded_work():
    """Appending to a long sequence touches at most max_depth suffixes per token."""
    import time

    rng = random.Random(1)
    seq = [rng.randrange(50) for _ in range(4000)]
    ix = SuffixIndex(24)
    t = time.perf_counter()
    for i in range(0, len(seq), 4):
        ix.extend(0, seq[i : i + 4])
        ix.speculate(ix.tokens(0), 8, 1.0, 0.1, own=True)
    per_step_ms = (time.perf_counter() - t) / (len(seq) / 4) * 1e3
    assert per_step_ms < 5.0  # generous: ~0.1 ms here; a per-step rebuild would grow with the length


# ------------------------------------------------------------------ the proposer glue


def _spec(**kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="suffix", num_speculative_tokens=kw.pop("k", 4), **kw)


def _seq(rid: str, prompt: list[int], out: list[int]) -> Sequence:
    s = Sequence(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=50))
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
