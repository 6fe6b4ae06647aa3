"""Generate helm/specserve/dashboards/specserve.json, the chart's Grafana dashboard.

    python3 scripts/helm/gen_dashboard.py > helm/specserve/dashboards/specserve.json

Queries use vLLM's metric names (vllm:*, labels model_name and engine; docs/metrics.md)
wherever specserve exports one, and specserve's names for what vLLM has no name for (the
acceptance-length histogram, errors, the chosen K, the speculation setup).
Panels: mean acceptance length (1 + accepted/drafts, and the acceptance-length histogram's
p50/p99), draft acceptance rate (accepted/draft_tokens) overall and per draft position
(per_pos/drafts), tokens/s, requests running/waiting/finished/errors, TTFT/ITL/E2E p50/p99
from the histograms, KV-cache usage, prefix-cache hit rate, drafts per step and the method.
Variables: datasource, model_name.
"""
import json
S = 'model_name=~"$model_name"'
RI = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}
panels = []
pid = [0]
def panel(title, targets, unit="short", x=0, y=0, w=12, h=8, kind="timeseries", desc="", extra=None):
    pid[0] += 1
    p = {
        "id": pid[0], "type": kind, "title": title, "description": desc,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}} if kind == "timeseries" else
                   {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "textMode": "auto"},
        "targets": [dict(datasource=DS, refId=chr(65 + i), expr=e, legendFormat=l) for i, (e, l) in enumerate(targets)],
    }
    if extra:
        p["fieldConfig"]["defaults"].update(extra)
    panels.append(p)
def row(title, y):
    pid[0] += 1
    panels.append({"id": pid[0], "type": "row", "title": title, "collapsed": False,
                   "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
def rate(m, by="model_name"):
    return f"sum by ({by}) (rate({m}{{{S}}}[{RI}]))"
acc, drafts, dtok, perpos = ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total",
                             "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total")
row("Speculative decoding", 0)
panel("Mean acceptance length (5m)",
      [(f"1 + sum(rate({acc}{{{S}}}[5m])) / sum(rate({drafts}{{{S}}}[5m]))", "mean acceptance length")],
      unit="none", x=0, y=1, w=6, h=8, kind="stat",
      desc="Tokens emitted per target forward pass: 1 + accepted/drafts. 1.0 = no speedup from drafting.",
      extra={"decimals": 2})
panel("Draft acceptance rate (5m)",
      [(f"sum(rate({acc}{{{S}}}[5m])) / sum(rate({dtok}{{{S}}}[5m]))", "acceptance rate")],
      unit="percentunit", x=6, y=1, w=6, h=8, kind="stat",
      desc="Accepted draft tokens / proposed draft tokens.", extra={"min": 0, "max": 1})
panel("Mean acceptance length",
      [(f"1 + {rate(acc)} / {rate(drafts)}", "{{model_name}}"),
       (f"histogram_quantile(0.5, sum by (le, model_name) (rate(specserve_spec_decode_acceptance_length_bucket{{{S}}}[{RI}])))", "p50 {{model_name}}"),
       (f"histogram_quantile(0.99, sum by (le, model_name) (rate(specserve_spec_decode_acceptance_length_bucket{{{S}}}[{RI}])))", "p99 {{model_name}}")],
      unit="none", x=12, y=1, w=12, h=8,
      desc="1 + rate(accepted)/rate(drafts), and p50/p99 of the per-step acceptance length histogram.")
panel("Acceptance rate per draft position",
      [(f"sum by (model_name, position) (rate({perpos}{{{S}}}[{RI}])) / on (model_name) group_left sum by (model_name) (rate({drafts}{{{S}}}[{RI}]))",
        "{{model_name}} position {{position}}")],
      unit="percentunit", x=0, y=9, w=12, h=8,
      desc="Fraction of drafts whose token at each position was accepted (per_pos / drafts).", extra={"min": 0, "max": 1})
panel("Draft acceptance rate",
      [(f"{rate(acc)} / {rate(dtok)}", "{{model_name}}")],
      unit="percentunit", x=12, y=9, w=12, h=8, desc="accepted / draft tokens.", extra={"min": 0, "max": 1})
row("Throughput and latency", 17)
panel("Tokens/s",
      [(rate("vllm:generation_tokens_total"), "generated {{model_name}}"),
       (rate("vllm:prompt_tokens_total"), "prompt {{model_name}}")],
      unit="short", x=0, y=18, w=12, h=8, desc="Generation and prompt tokens per second.")
panel("Requests",
      [(f'sum by (finished_reason) (rate(vllm:request_success_total{{{S}}}[{RI}]))', "finished {{finished_reason}} /s"),
       (f'sum by (reason) (rate(specserve_request_errors_total{{{S}}}[{RI}]))', "error {{reason}} /s"),
       (f"sum(vllm:num_requests_running{{{S}}})", "running"),
       (f"sum(vllm:num_requests_waiting{{{S}}})", "waiting")],
      unit="short", x=12, y=18, w=12, h=8,
      desc="Finished and refused requests per second, running and waiting (queue depth: the autoscaling and routing signal).")
for i, (name, metric) in enumerate([("Time to first token", "vllm:time_to_first_token_seconds"),
                                     ("Inter-token latency", "vllm:inter_token_latency_seconds"),
                                     ("End-to-end request latency", "vllm:e2e_request_latency_seconds")]):
    panel(f"{name} p50 / p99",
          [(f"histogram_quantile({q}, sum by (le, model_name) (rate({metric}_bucket{{{S}}}[{RI}])))", f"p{int(q*100)} {{{{model_name}}}}")
           for q in (0.5, 0.99)],
          unit="s", x=(i * 8), y=26, w=8, h=8, desc=f"{metric} histogram quantiles.")
row("Memory", 34)
panel("KV cache usage",
      [(f"max by (pod, model_name) (vllm:kv_cache_usage_perc{{{S}}})", "{{pod}}")],
      unit="percentunit", x=0, y=35, w=12, h=8, desc="Fraction of paged KV-cache blocks in use.", extra={"min": 0, "max": 1})
panel("Prefix cache hit rate",
      [(f"{rate('vllm:prefix_cache_hits_total')} / {rate('vllm:prefix_cache_queries_total')}", "{{model_name}}")],
      unit="percentunit", x=12, y=35, w=12, h=8,
      desc="Prompt tokens found in the prefix cache / prompt tokens looked up.", extra={"min": 0, "max": 1})
row("Speculation setup", 43)
panel("Drafts per request per step",
      [(f"max by (pod, model_name) (specserve_spec_decode_num_speculative_tokens{{{S}}})", "{{pod}}")],
      unit="short", x=0, y=44, w=12, h=8,
      desc="K the engine chooses now (adaptive speculation: 0 = switched off at this load; fixed: K).")
panel("Method",
      [(f"max by (model_name, method, num_speculative_tokens, lossless) (specserve_spec_decode_config_info{{{S}}})",
        "{{model_name}}: {{method}} K={{num_speculative_tokens}} lossless={{lossless}}")],
      unit="none", x=12, y=44, w=12, h=8, kind="stat",
      desc="The speculative method and K of each model; lossless=false marks synthetic rejection sampling.")

def var(name, q):
    return {"name": name, "label": name, "type": "query", "datasource": DS,
            "query": {"query": q, "refId": name}, "definition": q,
            "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "refresh": 2, "sort": 1}
dash = {
    "uid": "specserve-overview",
    "title": "specserve: speculative decoding",
    "description": "Acceptance length, acceptance per position, throughput, queue, TTFT/ITL and KV cache of specserve (vLLM metric names).",
    "tags": ["specserve", "llm", "speculative-decoding"],
    "editable": True, "graphTooltip": 1, "refresh": "30s", "schemaVersion": 39, "version": 1,
    "time": {"from": "now-1h", "to": "now"}, "timezone": "",
    "annotations": {"list": []}, "links": [],
    "templating": {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1, "regex": ""},
        var("model_name", "label_values(vllm:generation_tokens_total, model_name)"),
    ]},
    "panels": panels,
}
if __name__ == "__main__":
    print(json.dumps(dash, indent=2))
