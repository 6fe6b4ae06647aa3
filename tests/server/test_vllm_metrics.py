"""vLLM's metric names on a running server, parsed from /metrics with prometheus_client's parser.

Every specserve family with a vLLM counterpart is also exported under vLLM v1's name, with
the same type and values and vLLM's labels (``model_name``, ``engine="0"``, no ``method``):

* around the fake engine (the wiring): after requests over HTTP and gRPC, and while one
  request is held running and another waits, each pair of families holds the same samples,
  and the vLLM spec-decode counters equal the per-response ``spec_decode`` figures;
* around the real engine (tiny llama, n-gram speculation): the same after real requests;
* docs/metrics.md has a row for every pair, and every vLLM name the chart hands to the
  endpoint picker, the HPA and KEDA is on /metrics.

The expected names are written out here (not read from specserve.metrics): they are the
contract with dashboards, autoscalers and the Gateway API Inference Extension's endpoint picker.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from server_testutil import http_call, wait_for

from specserve.v1 import specserve_pb2 as pb

# specserve family -> vLLM family (family names as prometheus_client's parser reports them:
# counters without "_total").
PAIRS = {
    "specserve_num_requests_running": "vllm:num_requests_running",
    "specserve_num_requests_waiting": "vllm:num_requests_waiting",
    "specserve_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "specserve_prompt_tokens": "vllm:prompt_tokens",
    "specserve_generation_tokens": "vllm:generation_tokens",
    "specserve_request_success": "vllm:request_success",
    "specserve_prefix_cache_queries": "vllm:prefix_cache_queries",
    "specserve_prefix_cache_hits": "vllm:prefix_cache_hits",
    "specserve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "specserve_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "specserve_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "specserve_request_prompt_tokens": "vllm:request_prompt_tokens",
    "specserve_request_generation_tokens": "vllm:request_generation_tokens",
    "specserve_iteration_tokens_total": "vllm:iteration_tokens_total",
    "specserve_spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "specserve_spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "specserve_spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "specserve_spec_decode_num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
# Names older vLLM releases used for the same series (their dashboards, and the endpoint
# picker's default KV metric before its v1.3).
LEGACY = {
    "specserve_kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    "specserve_inter_token_latency_seconds": "vllm:time_per_output_token_seconds",
}
SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def families(http: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_call(f"{http}/metrics")
    assert status == 200, body
    return {f.name: f for f in text_string_to_metric_families(body)}


def as_vllm(family, prefix: str) -> tuple[str, dict]:
    """A family's samples keyed as vLLM's would be: (suffix, labels without method + engine="0")."""
    out = {}
    for s in family.samples:
        suffix = s.name[len(prefix):]
        if suffix == "_created":  # creation timestamps: the two families are created a moment apart
            continue
        labels = {k: v for k, v in s.labels.items() if k != "method"}
        labels["engine"] = "0"
        out[(suffix, tuple(sorted(labels.items())))] = s.value
    return family.type, out


def assert_twins_agree(fams: dict, model: str) -> None:
    for ours, theirs in [*PAIRS.items(), *LEGACY.items()]:
        assert ours in fams, f"{ours} missing from /metrics"
        assert theirs in fams, f"{theirs} (vLLM's name of {ours}) missing from /metrics"
        t_ours, s_ours = as_vllm(fams[ours], ours)
        t_theirs = fams[theirs].type
        s_theirs = {(s.name[len(theirs):], tuple(sorted(s.labels.items()))): s.value
                    for s in fams[theirs].samples if not s.name.endswith("_created")}  # fmt: skip
        assert t_theirs == t_ours, f"{theirs} is a {t_theirs}, {ours} a {t_ours}"
        assert s_theirs == s_ours, f"{theirs} != {ours}"
        assert s_theirs, f"{theirs} has no samples"
        for _, labels in s_theirs:
            assert dict(labels)["model_name"] == model and "method" not in dict(labels)


def vllm_value(fams: dict, family: str, sample: str | None = None, **labels) -> float:
    """The sum of a vLLM family's samples named ``sample`` (default: the family's own value
    sample) whose labels include ``labels``."""
    f = fams[family]
    name = sample or (family + "_total" if f.type == "counter" else family)
    return sum(s.value for s in f.samples if s.name == name and labels.items() <= s.labels.items())


# ------------------------------------------------------------------------------ fake engine


def test_vllm_names_agree_with_specserve_names_on_a_running_server(make_served):
    engine = FakeEngine(max_running=1)
    s = make_served(engine)
    client = s.openai()
    seen = dict.fromkeys(SPEC_KEYS, 0)
    finished = {"length": 0, "stop": 0}
    generated = 0
    for i in range(3):
        r = client.completions.create(model="fake-model", prompt=f"prompt {i}", max_tokens=9)
        generated += r.usage.completion_tokens
        finished[r.choices[0].finish_reason] += 1
        for key in seen:
            seen[key] += r.model_extra["spec_decode"][key]
    r = s.stub.Generate(pb.GenerateRequest(prompt="via grpc", sampling_params=pb.SamplingParams(max_tokens=7)))
    generated += len(r.token_ids)
    finished["length"] += 1
    for key in seen:
        seen[key] += getattr(r.spec_decode, key)
    assert seen["num_drafts"] > 0 and seen["num_accepted_tokens"] > 0, seen

    fams = families(s.http)
    assert_twins_agree(fams, "fake-model")
    for key in SPEC_KEYS:  # the per-response figures, under vLLM's names
        assert vllm_value(fams, f"vllm:spec_decode_{key}") == seen[key], key
    assert vllm_value(fams, "vllm:spec_decode_num_accepted_tokens_per_pos") == seen["num_accepted_tokens"]
    assert vllm_value(fams, "vllm:generation_tokens") == generated
    assert vllm_value(fams, "vllm:request_success", finished_reason="length") == finished["length"]
    assert vllm_value(fams, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 4
    assert vllm_value(fams, "vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == generated
    assert vllm_value(fams, "vllm:num_requests_running") == 0

    # Queue state, as the endpoint picker and an autoscaler read it: one request held
    # running (before its first step), one waiting behind it (max_running=1).
    engine.hold.clear()
    results: list = []

    def complete(prompt: str) -> None:
        results.append(client.completions.create(model="fake-model", prompt=prompt, max_tokens=5))

    threads = [threading.Thread(target=complete, args=(p,)) for p in ("held a", "held b")]
    for t in threads:
        t.start()
    try:
        assert wait_for(lambda: engine.num_running == 1 and engine.num_waiting == 1)
        fams = families(s.http)
        assert_twins_agree(fams, "fake-model")
        assert vllm_value(fams, "vllm:num_requests_running") == 1
        assert vllm_value(fams, "vllm:num_requests_waiting") == 1
        assert 0 < vllm_value(fams, "vllm:kv_cache_usage_perc") == engine.kv_cache_usage
    finally:
        engine.hold.set()
        for t in threads:
            t.join(30)
    assert len(results) == 2
    fams = families(s.http)
    assert_twins_agree(fams, "fake-model")
    assert vllm_value(fams, "vllm:request_success", finished_reason="length") == finished["length"] + 2
    assert vllm_value(fams, "vllm:num_requests_waiting") == 0


# ------------------------------------------------------------------------------ real engine

PROMPTS = ["w10 w11 w12 w10 w11 w12 w10", "w7 w8 w9 w7 w8", "w30 w31 w30 w31 w30 w31"]


@pytest.mark.timeout(120)
def test_vllm_names_on_the_real_engine(tiny_llama):
    import openai
    from engine_utils import tiny_config

    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.engine import LLMEngine
    from specserve.server import start_servers

    from server_testutil import server_config

    llm = LLMEngine(tiny_config(tiny_llama, "ngram", k=3, num_blocks=128, block_size=4))
    engine = AsyncEngine(llm, max_queue=16)
    handle = start_servers(server_config(max_tokens_cap=64, default_max_tokens=16), engine)
    http = f"http://127.0.0.1:{handle.http_port}"
    client = openai.OpenAI(base_url=f"{http}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        seen = dict.fromkeys(SPEC_KEYS, 0)
        for p in PROMPTS:
            r = client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
            for key in seen:
                seen[key] += r.model_extra["spec_decode"][key]
        assert seen["num_drafts"] > 0, seen
        fams = families(http)
        assert_twins_agree(fams, "tiny")
        for key in SPEC_KEYS:
            assert vllm_value(fams, f"vllm:spec_decode_{key}") == seen[key], key
        assert vllm_value(fams, "vllm:request_success") == len(PROMPTS)
        assert vllm_value(fams, "vllm:prompt_tokens") > 0
        assert vllm_value(fams, "vllm:num_requests_running") == 0
    finally:
        client.close()
        handle.stop()


# ------------------------------------------------------------------------------ docs and chart

ROOT = Path(__file__).resolve().parents[2]


def test_docs_table_lists_every_pair():
    text = (ROOT / "docs" / "metrics.md").read_text()
    rows = {tuple(re.findall(r"`([^`]+)`", line)[:2]) for line in text.splitlines() if line.startswith("| `")}

    # Counters are listed as exposed, with "_total".
    counters = {"specserve_prompt_tokens", "specserve_generation_tokens", "specserve_request_success",
                "specserve_prefix_cache_queries", "specserve_prefix_cache_hits"} | {
                k for k in PAIRS if k.startswith("specserve_spec_decode_")}  # fmt: skip
    for ours, theirs in [*PAIRS.items(), *LEGACY.items()]:
        suffix = "_total" if ours in counters else ""
        assert (ours + suffix, theirs + suffix) in rows, f"docs/metrics.md: no row for {ours} / {theirs}"


def test_chart_reads_only_names_the_server_exports(served):
    """The vLLM names the chart hands to the endpoint picker, the HPA and KEDA exist on /metrics."""
    sources = [ROOT / "helm" / "specserve" / "values.yaml", *(ROOT / "helm" / "specserve" / "templates").glob("*.yaml")]
    used = {n for f in sources for n in re.findall(r'(?:"|\()(vllm:[a-z_:]+)', f.read_text())}
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= used, used
    exported = {s.name for f in families(served.http).values() for s in f.samples}
    assert used <= exported, sorted(used - exported)
