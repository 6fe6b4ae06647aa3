"""Automatic prefix caching: the block manager's cache (hash chain, LRU eviction among free
blocks, shared blocks never released early) and the engine (outputs unchanged, hits counted,
copies of one prompt sharing its blocks), on tiny models in float32."""

from __future__ import annotations

import pytest

from engine_utils import greedy, random_prompts, tiny_config
from specserve.engine.engine import LLMEngine
from specserve.kv_blocks import BlockManager, chain_hashes

pytestmark = pytest.mark.timeout(300)


def test_chain_hashes_name_the_prefix():
    a = chain_hashes([1, 2, 3, 4, 5, 6], 2, 3)
    b = chain_hashes([9, 2, 3, 4, 5, 6], 2, 3)
    assert len(a) == 3 and all(x[0] != y[0] for x, y in zip(a, b))  # a different first block changes all
    assert chain_hashes([1, 2, 3, 4, 5, 6], 2, 3, a[0][0], 1) == a[1:]


def test_the_salt_seeds_the_chain():
    """Equal tokens under different cache partitions share no hash and no key, so no block."""
    toks = [1, 2, 3, 4, 5, 6]
    plain, a, b = (chain_hashes(toks, 2, 3, salt=s) for s in (None, "tenant-a", "tenant-b"))
    assert plain == chain_hashes(toks, 2, 3)
    for x, y in ((plain, a), (a, b), (plain, b)):
        assert all(hx != hy and kx != ky for (hx, kx), (hy, ky) in zip(x, y))
    assert chain_hashes(toks, 2, 3, a[0][0], 1, salt="tenant-a") == a[1:]  # the salt only seeds block 0
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    t: list[int] = []
    bm.ensure(t, 6)
    for blk, (h, key) in zip(t, a):
        bm.register(blk, h, key)
    assert bm.match(a) == t and bm.match(b) == [] and bm.match(plain) == []


def test_register_match_acquire_and_lru_eviction():
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    t: list[int] = []
    assert bm.ensure(t, 6)
    hs = chain_hashes([1, 2, 3, 4, 5, 6], 2, 3)
    for b, (h, k) in zip(t, hs):
        bm.register(b, h, k)
    assert bm.match(hs) == t and bm.num_cached == 3
    u = list(bm.match(hs[:2]))
    bm.acquire(u)  # shared: ref 2
    assert bm.ref_count(u[0]) == 2 and bm.num_free == 1
    bm.free(t)  # the first owner leaves; the shared blocks stay in use, the third is cached-free
    blocks = bm.match(hs)
    assert bm.num_free == 2 and blocks[:2] == u and len(blocks) == 3
    bm.free(u)
    assert bm.num_free == 4 and bm.usage == 0.0 and bm.num_cached == 3
    # allocation takes the never-cached block first, then evicts the least recently freed:
    # the chain's tail (freed first), so its head stays reusable
    v: list[int] = []
    assert bm.ensure(v, 2) and bm.num_cached == 3
    assert bm.ensure(v, 4) and bm.num_cached == 2
    assert bm.match(hs) == blocks[:2]
    bm.free(v)
    assert bm.num_free == 4


def test_colliding_hash_never_hands_out_other_tokens():
    bm = BlockManager(num_blocks=2, block_size=2, enable_caching=True)
    t: list[int] = []
    bm.ensure(t, 2)
    h, key = chain_hashes([1, 2], 2, 1)[0]
    bm.register(t[0], h, key)
    assert bm.match([(h, (None, (7, 7)))]) == []  # same hash, other tokens: no hit


@pytest.fixture(scope="module")
def shared_prompts():
    system = random_prompts(1, seed=21, lo=37, hi=38)[0]
    tails = random_prompts(6, seed=22, lo=2, hi=9)
    return [system + t for t in tails]


def _cfg(model, on: bool, method=None, **kw):
    cfg = tiny_config(model, method, **kw)
    cfg.engine.enable_prefix_caching = on
    return cfg


@pytest.mark.parametrize("method", [None, "ngram", "draft_model"])
def test_outputs_equal_with_and_without_caching(tiny_llama, tiny_draft, shared_prompts, method):
    extra = {"draft_dir": tiny_draft} if method == "draft_model" else {}
    off = LLMEngine(_cfg(tiny_llama, False, method, k=3, **extra))
    on = LLMEngine(_cfg(tiny_llama, True, method, k=3, **extra))
    want = [o.token_ids for o in off.generate(shared_prompts, [greedy(16) for _ in shared_prompts])]
    # one at a time, so later requests find the earlier ones' blocks
    got = [on.generate([p], [greedy(16)])[0].token_ids for p in shared_prompts]
    assert got == want
    bs = on.blocks.block_size
    assert on.blocks.num_hit_tokens >= (len(shared_prompts) - 1) * (37 // bs) * bs
    assert on.blocks.num_free == on.blocks.num_blocks  # cached blocks count as free
    assert off.blocks.num_hit_tokens == 0


def test_copies_of_one_prompt_share_its_blocks(tiny_llama):
    eng = LLMEngine(_cfg(tiny_llama, True, "ngram", k=3))
    prompt = random_prompts(1, seed=5, lo=60, hi=61)[0]
    for i in range(4):
        eng.add_request(f"c{i}", prompt, greedy(8))
    peak = 0
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        peak = max(peak, eng.blocks.num_blocks - eng.blocks.num_free)
    bs = eng.blocks.block_size
    prompt_blocks = len(prompt) // bs
    own = -(-(len(prompt) + 8 + 3) // bs) - prompt_blocks  # tail + output + drafts per copy, at most
    assert peak <= prompt_blocks + 4 * (own + 1) < 4 * prompt_blocks  # the prompt's blocks once, not 4 times
    assert len(set(map(tuple, outs.values()))) == 1
    assert eng.blocks.num_hit_tokens == 3 * ((len(prompt) - 1) // bs * bs)


def test_eviction_under_pressure_and_preemption_stay_lossless(tiny_llama, shared_prompts):
    off = LLMEngine(_cfg(tiny_llama, False, "ngram", k=3))
    want = [o.token_ids for o in off.generate(shared_prompts, [greedy(20) for _ in shared_prompts])]
    tight = LLMEngine(_cfg(tiny_llama, True, "ngram", k=3, num_blocks=30))
    got = [o.token_ids for o in tight.generate(shared_prompts, [greedy(20) for _ in shared_prompts])]
    assert got == want
    got2 = [o.token_ids for o in tight.generate(shared_prompts[::-1], [greedy(20) for _ in shared_prompts])]
    assert got2 == want[::-1]
    assert tight.blocks.num_free == tight.blocks.num_blocks


def test_prefix_cache_metrics(tiny_llama, shared_prompts):
    from prometheus_client import CollectorRegistry

    from specserve.metrics import MetricsIdentity, SpecServeMetrics

    eng = LLMEngine(_cfg(tiny_llama, True))
    m = SpecServeMetrics(CollectorRegistry(), MetricsIdentity("tiny", "none", 0))
    eng.listeners.append(m)
    for p in shared_prompts[:3]:
        eng.generate([p], [greedy(4)])
    reg = m.registry
    q = reg.get_sample_value("specserve_prefix_cache_queries_total", {"model_name": "tiny", "method": "none"})
    h = reg.get_sample_value("specserve_prefix_cache_hits_total", {"model_name": "tiny", "method": "none"})
    assert q == sum(len(p) for p in shared_prompts[:3])
    assert h == eng.blocks.num_hit_tokens > 0


def test_another_tenants_prompt_gives_no_prefix_cache_hits(tiny_llama):
    """The reported attack: tenant A's prompt holds a PIN; tenant B sends the prompt with
    guesses of it and reads the prefix-cache hit counter.  B's hits must be exactly what
    they are on an engine that never saw A's prompt (0 for its first request), right guess
    or wrong; A itself still hits its own blocks."""
    from prometheus_client import CollectorRegistry

    from specserve.metrics import MetricsIdentity, SpecServeMetrics

    prefix = random_prompts(1, seed=31, lo=16, hi=17)[0]  # 4 blocks of 4
    tail = random_prompts(1, seed=32, lo=12, hi=13)[0]
    secret = prefix + [7, 7, 7, 7] + tail

    def engine():
        eng = LLMEngine(_cfg(tiny_llama, True))
        m = SpecServeMetrics(CollectorRegistry(), MetricsIdentity("tiny", "none", 0))
        eng.listeners.append(m)
        return eng, m

    def hits(served, prompt, salt) -> float:
        eng, m = served
        labels = {"model_name": "tiny", "method": "none"}
        before = m.registry.get_sample_value("specserve_prefix_cache_hits_total", labels)
        eng.generate([prompt], [greedy(2, cache_salt=salt)])
        return m.registry.get_sample_value("specserve_prefix_cache_hits_total", labels) - before

    victim, control = engine(), engine()
    assert hits(victim, secret, "tenant-a") == 0
    guesses = [prefix + [8, 8, 8, 8] + tail, secret, prefix + [9, 9, 9, 9] + tail, secret]
    seen = [hits(victim, g, "tenant-b") for g in guesses]
    assert seen == [hits(control, g, "tenant-b") for g in guesses]
    assert seen[0] == 0 and seen[1] == seen[2] == 16  # B's own prefix blocks only, whatever the guess
    assert hits(victim, secret, None) == 0  # nor do requests without a partition see A's blocks
    assert hits(victim, secret, "tenant-a") == (len(secret) - 1) // 4 * 4  # A shares with itself
