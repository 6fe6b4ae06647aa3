"""specserve.metrics on its own: injected registry, names, buckets, the lossless marker, PromQL docs."""

from __future__ import annotations

from pathlib import Path

import prometheus_client
from prometheus_client import CollectorRegistry

import specserve.metrics as metrics_module
from specserve.engine.stats import RequestFinishedStats, RequestStepStats, StepStats
from specserve.metrics import MetricsIdentity, SpecServeMetrics

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def value(registry, name, **labels):
    return registry.get_sample_value(name, {"model_name": "m", "method": "ngram", **labels})


def test_counts_raw_events_on_the_injected_registry():
    before = set(prometheus_client.REGISTRY._names_to_collectors)
    registry = CollectorRegistry()
    m = SpecServeMetrics(registry, MetricsIdentity("m", "ngram", 4))
    assert set(prometheus_client.REGISTRY._names_to_collectors) == before  # nothing global
    m.on_step(StepStats(2, 1, 0.25, 10, 4, [
        RequestStepStats("a", 3, 4, 2, [True, True, False, False], time_to_first_token_s=0.05),
        RequestStepStats("b", 1, 0, 0, [], inter_token_latency_s=0.02),  # no draft round this step
    ]))  # fmt: skip
    m.on_request_finished(RequestFinishedStats("a", "stop", 10, 3, 0.5, 1, 4, 2))
    m.on_request_error("queue_full")

    assert value(registry, "specserve_spec_decode_num_drafts_total") == 1
    assert value(registry, "specserve_spec_decode_num_draft_tokens_total") == 4
    assert value(registry, "specserve_spec_decode_num_accepted_tokens_total") == 2
    name = "specserve_spec_decode_num_accepted_tokens_per_pos_total"
    per_pos = [value(registry, name, position=str(p)) for p in range(4)]
    assert per_pos == [1, 1, 0, 0]
    assert value(registry, "specserve_spec_decode_acceptance_length_bucket", le="2.0") == 0
    assert value(registry, "specserve_spec_decode_acceptance_length_bucket", le="3.0") == 1
    assert value(registry, "specserve_spec_decode_acceptance_length_bucket", le="5.0") == 1  # K + 1
    assert value(registry, "specserve_spec_decode_acceptance_length_bucket", le="6.0") is None
    assert value(registry, "specserve_num_requests_running") == 2
    assert value(registry, "specserve_num_requests_waiting") == 1
    assert value(registry, "specserve_kv_cache_usage_perc") == 0.25
    assert value(registry, "specserve_prompt_tokens_total") == 10
    assert value(registry, "specserve_generation_tokens_total") == 4
    assert value(registry, "specserve_iteration_tokens_total_sum") == 14
    assert value(registry, "specserve_request_success_total", finished_reason="stop") == 1
    assert value(registry, "specserve_request_success_total", finished_reason="abort") == 0
    assert value(registry, "specserve_request_errors_total", reason="queue_full") == 1
    assert value(registry, "specserve_time_to_first_token_seconds_count") == 1
    assert value(registry, "specserve_time_to_first_token_seconds_bucket", le="0.001") == 0
    assert value(registry, "specserve_time_to_first_token_seconds_bucket", le="2560.0") == 1
    assert value(registry, "specserve_inter_token_latency_seconds_bucket", le="0.01") == 0
    assert value(registry, "specserve_inter_token_latency_seconds_bucket", le="80.0") == 1
    assert value(registry, "specserve_e2e_request_latency_seconds_count") == 1


def test_two_servers_in_one_process_do_not_collide():
    SpecServeMetrics(CollectorRegistry(), MetricsIdentity("m", "ngram", 2))
    SpecServeMetrics(CollectorRegistry(), MetricsIdentity("m", "ngram", 2))


def test_synthetic_rejection_is_marked_not_lossless():
    registry = CollectorRegistry()
    SpecServeMetrics(registry, MetricsIdentity("m", "ngram", 3, lossless=False))
    assert value(registry, "specserve_spec_decode_config_info", lossless="false", num_speculative_tokens="3") == 1
    lossless = CollectorRegistry()
    SpecServeMetrics(lossless, MetricsIdentity("m", "ngram", 3))
    assert value(lossless, "specserve_spec_decode_config_info", lossless="true", num_speculative_tokens="3") == 1


def test_promql_is_documented_beside_the_counters_and_in_docs():
    for text in (metrics_module.__doc__, DOC.read_text()):
        assert "1 + rate(specserve_spec_decode_num_accepted_tokens_total" in text
        assert "/ rate(specserve_spec_decode_num_drafts_total" in text
        assert "/ rate(specserve_spec_decode_num_draft_tokens_total" in text
        assert "rate(specserve_spec_decode_num_accepted_tokens_per_pos_total" in text
        assert 'lossless="true"' in text
