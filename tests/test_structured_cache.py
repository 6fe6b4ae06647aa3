"""The compiled-grammar cache (``specserve.structured.GrammarCache``) with a stand-in compiler:
one compile per distinct grammar however many wait for it, compiles nobody waits for any
more are dropped (not started) or discarded (running), refusals are remembered, the LRU
bound holds, and an async wait past its budget is an InvalidRequestError naming the field.
Every slow compile blocks on an event the test controls."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specserve.errors import InvalidRequestError
from specserve.structured import GrammarBackend, GrammarCache, GrammarRejected

SAFETY_S = 30  # waits that return at once unless something is broken


def _until(predicate) -> bool:
    deadline = time.monotonic() + SAFETY_S
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


class Compiler:
    """Counts compiles per text; texts in ``held`` block until ``release``; "bad*" is refused."""

    def __init__(self, *held: str):
        self.calls: list[str] = []
        self.held = set(held)
        self.started = {t: threading.Event() for t in held}
        self.gate = threading.Event()

    def __call__(self, text: str):
        self.calls.append(text)
        if text in self.held:
            self.started[text].set()
            assert self.gate.wait(SAFETY_S)
        if text.startswith("bad"):
            raise GrammarRejected(f"cannot be compiled: {text} is bad")
        return object()  # stands for a CompiledGrammar

    def release(self) -> None:
        self.gate.set()


def test_concurrent_requests_for_one_grammar_share_one_compile():
    compiler = Compiler("g")
    cache = GrammarCache(compiler)
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(cache.get("g"))) for _ in range(8)]
    threads[0].start()
    assert compiler.started["g"].wait(SAFETY_S)
    for t in threads[1:]:
        t.start()
    # Every later request joins the compile in flight (waiters are counted under the lock).
    assert _until(lambda: cache._running[(None, "g")].waiters == 8)
    compiler.release()
    for t in threads:
        t.join(SAFETY_S)
    assert compiler.calls == ["g"] and cache.num_compiles == 1
    assert len(results) == 8 and len({id(r) for r in results}) == 1
    assert cache.get("g") is results[0] and compiler.calls == ["g"]  # now from the cache


def test_a_compile_nobody_waits_for_before_it_starts_is_dropped():
    compiler = Compiler("a")
    cache = GrammarCache(compiler)
    with ThreadPoolExecutor(1) as pool:
        a = cache.join("a", pool)
        assert compiler.started["a"].wait(SAFETY_S)
        b = cache.join("b", pool)  # queued behind "a" on the only thread
        cache.leave(b)  # its request went away (client gone, deadline)
        assert b.future.cancelled()
        compiler.release()
        assert a.future.result(SAFETY_S) is not None
        cache.leave(a)
    assert compiler.calls == ["a"]  # "b" never compiled
    assert len(cache) == 1


def test_the_result_of_a_running_compile_everyone_left_is_discarded():
    compiler = Compiler("a")
    cache = GrammarCache(compiler)
    with ThreadPoolExecutor(1) as pool:
        a = cache.join("a", pool)
        assert compiler.started["a"].wait(SAFETY_S)
        cache.leave(a)  # running: it cannot be stopped, but nobody will use it
        assert not a.future.cancelled()
        compiler.release()
        a.future.result(SAFETY_S)
    assert len(cache) == 0 and not cache._running
    cache.get("a")  # asked again: compiled again
    assert compiler.calls == ["a", "a"]


def test_refusals_are_remembered_and_raised_to_every_request():
    compiler = Compiler()
    cache = GrammarCache(compiler)
    for _ in range(3):
        with pytest.raises(GrammarRejected, match="bad1 is bad"):
            cache.get("bad1")
    assert compiler.calls == ["bad1"]


def test_the_cache_keeps_at_most_max_entries_least_recently_used_first_out():
    compiler = Compiler()
    cache = GrammarCache(compiler, max_entries=2)
    cache.get("x")
    cache.get("y")
    cache.get("x")  # x is now the most recent
    cache.get("z")  # evicts y
    assert len(cache) == 2
    cache.get("x")
    cache.get("y")
    assert compiler.calls == ["x", "y", "z", "y"]


def _backend(compiler: Compiler) -> GrammarBackend:
    backend = GrammarBackend(hf_tokenizer=None, vocab_size=64, eos_token_ids=(2,))
    backend.cache = GrammarCache(compiler)
    return backend


def test_an_async_wait_past_its_budget_is_invalid_naming_the_field_and_leaves_the_compile():
    compiler = Compiler("slow")
    backend = _backend(compiler)

    async def main():
        with ThreadPoolExecutor(1) as pool:
            with pytest.raises(InvalidRequestError) as e:
                # held until after the wait: the budget always runs out first
                await backend.compile_async("slow", "regex", pool, 0.05)
            assert e.value.field == "regex" and "grammar_compile_timeout_s" in str(e.value)
            assert backend.cache._running[(None, "slow")].waiters == 0
            compiler.release()
        return len(backend.cache)

    assert asyncio.run(main()) == 0  # finished after its waiter left: discarded


def test_an_async_refusal_names_the_requests_field():
    backend = _backend(Compiler())

    async def main(field: str):
        with ThreadPoolExecutor(1) as pool:
            with pytest.raises(InvalidRequestError) as e:
                await backend.compile_async("bad2", field, pool, SAFETY_S)
        return e.value

    for field in ("response_format", "grammar"):  # one grammar text, asked for under two fields
        err = asyncio.run(main(field))
        assert err.field == field and str(err).startswith(f"{field}: cannot be compiled")


def test_a_cancelled_async_wait_drops_a_compile_that_has_not_started():
    compiler = Compiler("first")
    backend = _backend(compiler)

    async def main():
        with ThreadPoolExecutor(1) as pool:
            first = backend.cache.join("first", pool)
            assert await asyncio.to_thread(compiler.started["first"].wait, SAFETY_S)
            waiting = asyncio.create_task(backend.compile_async("second", "regex", pool, SAFETY_S))
            while (None, "second") not in backend.cache._running:
                await asyncio.sleep(0.001)
            waiting.cancel()  # the request is aborted while its compile waits for a thread
            with pytest.raises(asyncio.CancelledError):
                await waiting
            compiler.release()
            first.future.result(SAFETY_S)
            backend.cache.leave(first)

    asyncio.run(main())
    assert compiler.calls == ["first"]


@pytest.mark.parametrize("override", ["server.grammar_compile_timeout_s=0", "server.grammar_compile_threads=0",
                                      "server.grammar_cache_entries=0", "server.grammar_max_chars=0"])
def test_bad_grammar_server_keys_are_refused_naming_the_key(override):
    from specserve.cli import compose_config
    from specserve.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        compose_config([override])
    assert str(e.value).startswith(override.split("=")[0] + ":")


def test_partitions_never_share_a_compile_or_a_cached_grammar():
    """The cache is keyed by the request's partition (tenant + cache_salt) as the prefix
    cache is: another partition's identical grammar is compiled again (a hit would answer
    in a fraction of a fresh compile's time and tell one tenant what another sent); the same
    partition's repeat is a hit; an in-flight compile is shared only within its partition."""
    compiler = Compiler("g")
    cache = GrammarCache(compiler)
    with ThreadPoolExecutor(max_workers=4) as pool:
        a1 = cache.join("g", pool, "tenant-a")
        assert compiler.started["g"].wait(SAFETY_S)
        a2 = cache.join("g", pool, "tenant-a")  # waits on a1's compile
        b = cache.join("g", pool, "tenant-b")  # its own compile
        assert a2 is a1 and b is not a1
        compiler.release()
        results = [j.future.result(SAFETY_S) for j in (a1, a2, b)]
        for j in (a1, a2, b):
            cache.leave(j)
    assert results[0] is results[1] and results[2] is not results[0]
    assert compiler.calls == ["g", "g"]
    assert cache.get("g", "tenant-a") is results[0] and cache.get("g", "tenant-b") is results[2]
    assert compiler.calls == ["g", "g"]  # each partition's repeat hits its own entry
    cache.get("g")  # the common partition (no key, no salt) is a partition of its own
    assert compiler.calls == ["g", "g", "g"]
