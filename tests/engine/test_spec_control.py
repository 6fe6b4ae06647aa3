"""Adaptive speculation: the choice of K follows measured costs and acceptance."""

from __future__ import annotations

import logging

import pytest

from specserve.engine.spec_control import SpecController
from specserve.executor.batch import batch_bucket as bucket_of


def test_fixed_mode_always_k():
    c = SpecController(5, adaptive=False)
    assert [c.choose(b) for b in (1, 8, 64)] == [5, 5, 5]


def test_unmeasured_speculates_first():
    c = SpecController(4, adaptive=True)
    assert c.choose(1) == 4


def test_k_until_enough_drafts_were_verified():
    c = SpecController(4, adaptive=True, warmup_rounds=8)
    c.seed_costs({(1, q): 0.010 * q for q in range(1, 6)})  # speculation would lose
    picks = []
    for _ in range(20):
        picks.append(c.choose(1))
        c.observe_drafts(4, 0)  # every first draft rejected
    first_off = picks.index(0)
    assert set(picks[:first_off]) == {4} and 8 <= first_off <= 10  # 8 rounds (decayed) before trusting them


def test_expected_tokens_is_the_chain_formula():
    c = SpecController(3, adaptive=True)
    c.reached, c.accepted = [10.0, 8.0, 4.0], [8.0, 4.0, 1.0]
    a = [0.8, 0.5, 0.25]
    assert c.expected_tokens(0) == 1.0
    assert c.expected_tokens(3) == pytest.approx(1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2])


def test_cheap_verification_and_good_acceptance_choose_k():
    c = SpecController(4, adaptive=True)
    c.seed_costs({(1, q): 0.010 + 0.0005 * q for q in range(1, 6)})  # memory-bound: q costs little
    c.reached, c.accepted = [100.0] * 4, [80.0] * 4
    assert c.choose(1) == 4


def test_expensive_verification_turns_speculation_off_and_probes_again():
    c = SpecController(4, adaptive=True, probe_every=5)
    c.seed_costs({(32, q): 0.010 * q for q in range(1, 6)})  # compute-bound at batch 32: q costs q x
    c.reached, c.accepted = [100.0] * 4, [30.0, 30.0, 30.0, 30.0]
    picks = [c.choose(32) for _ in range(10)]
    assert picks[:4] == [0, 0, 0, 0]
    assert 4 in picks  # a probe round every probe_every steps keeps the estimates fresh
    assert c.choose(1) == 4  # nothing measured for bucket 1 yet: speculate


def test_probes_back_off_while_speculation_keeps_losing_and_reset_when_it_wins():
    c = SpecController(4, adaptive=True, probe_every=4, probe_max=32)
    c.seed_costs({(1, q): 0.010 * q for q in range(1, 6)})  # verification costs q x: never worth it
    c.reached, c.accepted = [100.0] * 4, [30.0] * 4
    picks = [c.choose(1) for _ in range(200)]
    probes = [i for i, k in enumerate(picks) if k == 4]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 3 and gaps[:3] == [8, 16, 32]  # one step in 4, then 8, 16, 32 (probe_max)
    assert all(g == 32 for g in gaps[2:]) and set(picks) == {0, 4}
    # costs move (the batch got memory-bound): speculation is on again, and once it loses
    # again the probes start over at probe_every
    c.step_cost = {key: type(e)(0.010) for key, e in c.step_cost.items()}
    assert c.choose(1) == 4 and c.choose(1) == 4  # winning: it stays on
    c.step_cost = {key: type(e)(0.010 * key[1]) for key, e in c.step_cost.items()}
    after = [c.choose(1) for _ in range(12)]
    assert after == [0, 0, 0, 4] + [0] * 7 + [4]  # probing starts again at probe_every, then backs off


def test_choice_depends_on_batch_bucket():
    c = SpecController(4, adaptive=True)
    c.seed_costs({(1, q): 0.010 + 0.0002 * q for q in range(1, 6)})
    c.seed_costs({(64, q): 0.010 * q for q in range(1, 6)})
    c.reached, c.accepted = [100.0] * 4, [60.0] * 4
    assert c.choose(1) > 0 and c.choose(64) == 0


def test_online_costs_learned_from_observed_steps():
    c = SpecController(2, adaptive=True, candidates=(2,))
    c.reached, c.accepted = [100.0, 100.0], [10.0, 10.0]  # drafts almost never accepted
    for _ in range(20):
        c.observe_step(4, 1, 0.010, 0.0)
        c.observe_step(4, 3, 0.013, 0.002)
    assert c.choose(4) == 0
    assert bucket_of(3) == 4 and bucket_of(4) == 4 and bucket_of(5) == 8


def test_without_seeded_costs_a_plain_step_is_measured_then_cheaper_k_are_tried():
    """The CPU case (no graph timings): after K steps are measured, one plain step
    measures the base cost; unmeasured k are then assumed to cost what q=1 costs, so
    they get tried, and a weak drafter settles on the k that measures best."""
    c = SpecController(4, adaptive=True)
    c.reached, c.accepted = [100.0] * 4, [40.0, 12.0, 4.0, 1.0]  # acceptance falls off quickly
    assert c.choose(1) == 4
    c.observe_step(1, 5, 0.050, 0.012)  # a K=4 step: verification 50 ms, proposing 12 ms
    assert c.choose(1) == 0  # the base cost is unknown: measure it
    c.observe_step(1, 1, 0.030, 0.003)
    tried = set()
    for _ in range(12):
        k = c.choose(1)
        tried.add(k)
        c.observe_step(1, k + 1, 0.030 + 0.002 * k, 0.003 + 0.002 * k)
    assert tried - {0, 4}  # cheaper k were tried once their cost was only assumed
    rates = {k: c.expected_tokens(k) / (0.030 + 0.002 * k + 0.003 + 0.002 * k) for k in range(5)}
    assert c.choose(1) == max(rates, key=rates.get)


def test_changes_of_k_reach_info_at_most_once_per_interval_and_the_rest_is_debug(caplog):
    now = [100.0]
    c = SpecController(4, adaptive=True, probe_every=4, probe_max=4, log_interval_s=5.0, clock=lambda: now[0])
    c.reached, c.accepted = [100.0] * 4, [30.0] * 4
    winning = {(1, q): 0.010 for q in range(1, 6)}  # verification costs what a decode step costs
    losing = {(1, q): 0.010 * q for q in range(1, 6)}  # verification costs q decode steps

    def steps(costs: dict, n: int, dt: float) -> list[int]:
        c.step_cost = {}
        c.seed_costs(costs)
        picks = []
        for _ in range(n):
            picks.append(c.choose(1))
            now[0] += dt
        return picks

    def info() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]

    caplog.set_level(logging.DEBUG, logger="specserve.engine.spec_control")
    assert steps(losing, 12, 0.01) == [0, 0, 0, 4] * 3  # off, with a probe every 4 steps
    assert info() == ["speculation: 0 drafts per step at batch 1 (was 4)"]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert sum("probing 4 drafts" in m for m in debug) == 3  # probes: DEBUG only
    # The decision flips back and forth many times a second: still that one INFO line ...
    for _ in range(20):
        steps(winning, 1, 0.05)
        steps(losing, 1, 0.05)
    assert len(info()) == 1
    # ... until the interval has passed: then one line with the decision as it is now.
    now[0] += 5.0
    steps(winning, 3, 0.01)
    assert info()[1:] == ["speculation: 4 drafts per step at batch 1 (was 0; 41 changes since the last report)"]
    assert steps(winning, 50, 0.2) == [4] * 50 and len(info()) == 2  # no change: nothing more
    assert all(r.levelno in (logging.DEBUG, logging.INFO) for r in caplog.records)


def test_batch_buckets_and_the_bucket_of_a_batch_are_one_definition():
    from specserve.executor.batch import batch_buckets

    for max_num_seqs in (1, 6, 8, 48):
        buckets = batch_buckets(max_num_seqs)
        for n in range(1, max_num_seqs + 1):
            assert bucket_of(n, max_num_seqs) == min(b for b in buckets if b >= n)


def test_adaptive_k_finds_the_graph_timings_when_max_num_seqs_is_not_a_power_of_two():
    """max_num_seqs=6: graphs are captured for batches 1, 2, 4 and 6.  A batch of 5 runs
    the graph of 6, and its timings are what the choice reads (a power-of-two bucket, 8,
    has none: speculation would be tried blind instead of turned off)."""
    from specserve.executor.batch import batch_buckets

    c = SpecController(4, adaptive=True, max_num_seqs=6, warmup_rounds=0.0)
    assert batch_buckets(6) == [1, 2, 4, 6]
    # compute-bound at 5-6 requests: verifying q tokens costs q steps, so speculation loses
    c.seed_costs({(b, q): 0.010 * (q if b > 4 else 1) for b in batch_buckets(6) for q in range(1, 6)})
    c.reached, c.accepted = [100.0] * 4, [30.0] * 4
    assert c.bucket(5) == 6 and c.bucket(6) == 6 and c.bucket(3) == 4
    assert c.choose(5) == 0 and c.choose(6) == 0  # the seeded timings of the graph of 6 say off
    assert c.choose(4) == 4  # bucket 4 is memory-bound: speculate
    c.observe_step(5, 1, 0.011, 0.0)  # a step of 5 updates the same costs the graph of 6 seeded
    assert set(c.step_cost) == {(b, q) for b in batch_buckets(6) for q in range(1, 6)}


def test_the_engine_buckets_batches_as_its_graphs_are_captured(tiny_llama):
    from engine_utils import tiny_config
    from specserve.engine.engine import LLMEngine

    cfg = tiny_config(tiny_llama, "ngram", k=3, speculation="adaptive")
    cfg.engine.max_num_seqs = 6
    eng = LLMEngine(cfg)
    assert eng.spec_control.adaptive and eng.spec_control.bucket(5) == 6
