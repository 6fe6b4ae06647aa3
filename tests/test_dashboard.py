"""The chart's Grafana dashboard (helm/specserve/dashboards/specserve.json) against the server.

* It is valid JSON with unique panel ids, a Prometheus datasource variable and a
  ``model_name`` variable.
* Every PromQL expression (panel targets and variable queries) names only metrics the
  server exports: the names are parsed out of the expressions, the exported set is the
  sample names of a ``SpecServeMetrics`` registry rendered in Prometheus text format.
* It uses vLLM's names wherever specserve exports one (``specserve.metrics.VLLM_NAMES``):
  a ``specserve_*`` name appears only for figures vLLM has no name for.
* Its panels cover the queue, KV-cache usage, throughput, TTFT/ITL and acceptance.
* It is what scripts/helm/gen_dashboard.py generates (the JSON is not edited by hand).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "helm" / "specserve" / "dashboards" / "specserve.json"
GENERATOR = ROOT / "scripts" / "helm" / "gen_dashboard.py"

# PromQL words that look like metric names but are not: binary operators and modifiers.
KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "on", "ignoring", "by",
            "without", "inf", "nan", "atan2"}  # fmt: skip
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
IDENT = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana label_values() query) reads."""
    m = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{[^}]*\})?\s*,\s*\w+\s*\)\s*", expr)
    if m:
        return {m.group(1)}
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, $variables)
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors ([5m], [$__rate_interval])
    e = GROUPING.sub("", e)  # label lists of by/without/on/ignoring/group_*
    return {n for n in IDENT.findall(e) if n.lower() not in KEYWORDS}


def exported_names() -> set[str]:
    """Sample names in the exposition of a metrics registry that has seen every kind of event."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from specserve.engine.stats import RequestFinishedStats, RequestStepStats, StepStats
    from specserve.metrics import MetricsIdentity, SpecServeMetrics

    registry = CollectorRegistry()
    m = SpecServeMetrics(registry, MetricsIdentity("m", "ngram", 3))
    m.on_step(StepStats(1, 1, 0.5, 8, 3, [RequestStepStats("a", 3, 3, 2, [True, True, False], 0.05)],
                        num_speculative_tokens=3, prefix_cache_queries=8, prefix_cache_hits=4))  # fmt: skip
    m.on_step(StepStats(1, 0, 0.5, 0, 1, [RequestStepStats("a", 1, 0, 0, [], inter_token_latency_s=0.02)]))
    m.on_request_finished(RequestFinishedStats("a", "stop", 8, 4, 0.3, 1, 3, 2))
    m.on_request_error("queue_full")
    text = generate_latest(registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out += all_panels(p.get("panels", []))
    return out


def expressions(dash: dict) -> list[tuple[str, str]]:
    """(where, expression) for every panel target and every query variable."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in all_panels(dash["panels"]) for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']!r}", q))
    return out


def unknown_names(dash: dict, exported: set[str]) -> list[str]:
    return [f"{where}: {name}" for where, e in expressions(dash) for name in sorted(metric_names(e))
            if name not in exported]  # fmt: skip


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_names()


def test_the_promql_name_parser():
    expr = ('1 + sum by (model_name) (rate(vllm:spec_decode_num_accepted_tokens_total{model_name=~"$m"}[5m])) '
            '/ on (model_name) group_left sum without(position) (rate(foo_bucket{a="b,c"}[$__rate_interval])) '
            'and bool histogram_quantile(0.99, x_sum offset 5m) * 2.5e3')  # fmt: skip
    assert metric_names(expr) == {"vllm:spec_decode_num_accepted_tokens_total", "foo_bucket", "x_sum"}
    assert metric_names("label_values(vllm:generation_tokens_total, model_name)") == {"vllm:generation_tokens_total"}


def test_dashboard_is_valid_json_with_unique_ids_and_variables(dash):
    panels = all_panels(dash["panels"])
    assert panels and len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]), p["title"]
        for t in p.get("targets", []):
            assert t["expr"].strip() and t["refId"], p["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "model_name" in variables


def test_every_expression_names_only_exported_metrics(dash, exported):
    found = set().union(*(metric_names(e) for _, e in expressions(dash)))
    assert len(found) >= 12, found  # the parser saw the dashboard's metrics, not nothing
    assert unknown_names(dash, exported) == []
    # The same check catches a metric the server does not export.
    broken = json.loads(json.dumps(dash))
    broken["panels"][1]["targets"][0]["expr"] = "sum(rate(vllm:num_preemptions_total[5m]))"
    assert unknown_names(broken, exported) == [f"panel {broken['panels'][1]['title']!r}: vllm:num_preemptions_total"]


def test_dashboard_uses_vllm_names_where_they_exist(dash):
    from specserve.metrics import VLLM_NAMES

    ours = set()
    for _, e in expressions(dash):
        ours |= {n for n in metric_names(e) if n.startswith("specserve_")}
    families = {re.sub(r"(_total|_bucket|_sum|_count|_info)$", "", n) for n in ours}
    families |= {n for n in ours if n in VLLM_NAMES}  # histograms whose own name ends in _total
    with_vllm_name = sorted(f for f in families if f in VLLM_NAMES)
    assert with_vllm_name == [], f"use vLLM's names for {with_vllm_name}"
    assert all(n.startswith(("vllm:", "specserve_")) for _, e in expressions(dash) for n in metric_names(e))


COVERAGE = {
    "queue": {"vllm:num_requests_waiting", "vllm:num_requests_running"},
    "KV usage": {"vllm:kv_cache_usage_perc"},
    "throughput": {"vllm:generation_tokens_total", "vllm:prompt_tokens_total"},
    "TTFT": {"vllm:time_to_first_token_seconds_bucket"},
    "ITL": {"vllm:inter_token_latency_seconds_bucket"},
    "acceptance": {"vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total",
                   "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total"},
}  # fmt: skip


@pytest.mark.parametrize("topic", list(COVERAGE))
def test_panels_cover(dash, topic):
    panel_names = {}
    for p in all_panels(dash["panels"]):
        panel_names[p["title"]] = set().union(set(), *(metric_names(t["expr"]) for t in p.get("targets", [])))
    covering = [t for t, names in panel_names.items() if names & COVERAGE[topic]]
    assert covering, f"no panel reads {sorted(COVERAGE[topic])}"
    used = set().union(*panel_names.values())
    assert COVERAGE[topic] <= used, sorted(COVERAGE[topic] - used)


def test_dashboard_is_the_generators_output(dash):
    out = subprocess.run([sys.executable, str(GENERATOR)], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == dash, "regenerate: python3 scripts/helm/gen_dashboard.py > " + str(DASHBOARD)
