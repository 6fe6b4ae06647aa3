"""The chart as a Gateway API Inference Extension InferencePool (inference.networking.k8s.io/v1).

Run by scripts/helm_gate.sh (see conftest.py). Covers: the pool and its endpoint picker (EPP)
render only when inferencePool.enabled AND the cluster serves the API; the pool selects
exactly the server pods on their HTTP port and points at the EPP's Service; the EPP watches
that pool, reads vLLM's metric names from the pods' /metrics and is admitted by the server
NetworkPolicy; an existing EPP can be used instead; the rendered pool satisfies the schema
vendored from the extension's pinned CRD (tests/helm/schemas) for Kubernetes 1.29/1.31/1.33,
and that check rejects broken pools; the values schema rejects bad inferencePool values; the
install notes say what happened; autoscaling reads vLLM's queue metric.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

try:
    import jsonschema
    import yaml
except ImportError:  # only where the whole module is skipped (see conftest)
    jsonschema = yaml = None

POOL = ("inferencepool-values.yaml",)
POOL_API = "inference.networking.k8s.io/v1/InferencePool"
KEDA_API = "keda.sh/v1alpha1/ScaledObject"
VALIDATE_VERSIONS = ["1.29.0", "1.31.0", "1.33.0"]
# What the endpoint picker reads from each pod (specserve exports these: tests/server/test_vllm_metrics.py).
EPP_METRICS = {"queuedRequestsSpec": "vllm:num_requests_waiting", "runningRequestsSpec": "vllm:num_requests_running",
               "kvUsageSpec": "vllm:kv_cache_usage_perc", "loraSpec": "", "cacheInfoSpec": ""}  # fmt: skip


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def named(docs, kind, name):
    (d,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def server_deployment(docs):
    (d,) = [d for d in of_kind(docs, "Deployment")
            if any(c["name"] == "specserve" for c in d["spec"]["template"]["spec"]["containers"])]  # fmt: skip
    return d


def matches(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def validator():
    """scripts/helm/validate.py, the gate's kube-schema step."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "helm" / "validate.py"
    spec = importlib.util.spec_from_file_location("gate_validate", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gate_validate"] = mod
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- rendering


def test_rendered_only_when_enabled_and_served(render):
    assert not of_kind(render(), "InferencePool")  # off by default, API or not
    without_api = render(POOL, api_versions=())
    assert not of_kind(without_api, "InferencePool")
    assert [server_deployment(without_api)] == of_kind(without_api, "Deployment"), "no EPP without its pool"
    docs = render(POOL, api_versions=(POOL_API,))
    (pool,) = of_kind(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert {d["kind"] for d in docs if d["metadata"]["name"] == "specserve-epp"} == {
        "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service"}  # fmt: skip


def test_pool_selects_the_server_pods_on_their_http_port(render):
    docs = render(POOL, api_versions=(POOL_API,))
    (pool,) = of_kind(docs, "InferencePool")
    dep = server_deployment(docs)
    server_labels = dep["spec"]["template"]["metadata"]["labels"]
    sel = pool["spec"]["selector"]["matchLabels"]
    assert sel == named(docs, "Service", "specserve")["spec"]["selector"]
    assert matches(sel, server_labels)
    epp_pod = named(docs, "Deployment", "specserve-epp")["spec"]["template"]["metadata"]["labels"]
    assert not matches(sel, epp_pod), "the pool must not route requests to the endpoint picker"
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "specserve"]
    http = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http}]
    # The server pods' own selectors (Service, PDB, NetworkPolicy) leave the EPP out too.
    assert not matches(named(docs, "PodDisruptionBudget", "specserve")["spec"]["selector"]["matchLabels"], epp_pod)
    assert not matches(named(docs, "NetworkPolicy", "specserve")["spec"]["podSelector"]["matchLabels"], epp_pod)


def test_pool_and_epp_point_at_each_other(render):
    docs = render(POOL, api_versions=(POOL_API,))
    (pool,) = of_kind(docs, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    svc = named(docs, "Service", ref["name"])
    grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc-ext-proc")
    assert ref["port"] == {"number": grpc["port"]}
    assert ref["failureMode"] == "FailOpen"
    dep = named(docs, "Deployment", ref["name"])
    pod = dep["spec"]["template"]
    assert matches(svc["spec"]["selector"], pod["metadata"]["labels"])
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    (c,) = pod["spec"]["containers"]
    target = next(p for p in c["ports"] if p["name"] == grpc["targetPort"])
    assert target["containerPort"] == 9002
    args = c["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    assert args[args.index("--pool-namespace") + 1] == pool["metadata"]["namespace"]
    assert args[args.index("--pool-group") + 1] == "inference.networking.k8s.io"
    assert args[-2:] == ["--v", "2"]  # endpointPicker.flags
    assert c["image"] == "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"
    # It watches the pool and its pods with its own account, namespaced.
    assert pod["spec"]["serviceAccountName"] == ref["name"] and pod["spec"]["automountServiceAccountToken"] is True
    rules = named(docs, "Role", ref["name"])["rules"]
    assert {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
            "verbs": ["get", "watch", "list"]} in rules  # fmt: skip
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "watch", "list"]} in rules
    assert not of_kind(docs, "ClusterRole")
    binding = named(docs, "RoleBinding", ref["name"])
    assert binding["roleRef"]["name"] == ref["name"] and binding["subjects"][0]["name"] == ref["name"]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["capabilities"] == {"drop": ["ALL"]}
    assert c["readinessProbe"]["grpc"] == {"port": 9003, "service": "inference-extension"}


def test_epp_reads_vllm_names_from_the_pods_metrics(render):
    docs = render(POOL, api_versions=(POOL_API,))
    dep = named(docs, "Deployment", "specserve-epp")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    path = c["args"][c["args"].index("--config-file") + 1]
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    cm = named(docs, "ConfigMap", vol["configMap"]["name"])
    cfg = yaml.safe_load(cm["data"][path[len(mount["mountPath"]) + 1:]])
    assert cfg["kind"] == "EndpointPickerConfig" and cfg["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    plugins = {p["type"]: p for p in cfg["plugins"]}
    source = plugins["metrics-data-source"]["parameters"]
    assert source["scheme"] == "http" and source["path"] == "/metrics"
    (vllm,) = plugins["core-metrics-extractor"]["parameters"]["engineConfigs"]
    assert vllm.pop("name") == "vllm" and vllm == EPP_METRICS
    profile = {p["pluginRef"]: p["weight"] for p in cfg["schedulingProfiles"][0]["plugins"]}
    assert profile == {"queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3}
    # Every plugin a profile references is declared.
    assert set(profile) <= set(plugins)


def test_epp_is_admitted_by_a_restricted_server_network_policy(render):
    sets = ("networkPolicy.ingressFrom[0].namespaceSelector.matchLabels.team=llm",)
    docs = render(POOL, sets=sets, api_versions=(POOL_API,))
    np = named(docs, "NetworkPolicy", "specserve")
    epp_labels = named(docs, "Deployment", "specserve-epp")["spec"]["template"]["metadata"]["labels"]
    (rule,) = np["spec"]["ingress"]
    assert any(p.get("podSelector") and matches(p["podSelector"]["matchLabels"], epp_labels) for p in rule["from"])
    (c,) = server_deployment(docs)["spec"]["template"]["spec"]["containers"]
    http = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    assert http in {p["port"] for p in rule["ports"]}


def test_existing_endpoint_picker(render, chart):
    sets = ("inferencePool.endpointPicker.create=false", "inferencePool.endpointPicker.serviceName=shared-epp",
            "inferencePool.endpointPicker.port=9102", "inferencePool.failureMode=FailClose")  # fmt: skip
    docs = render(POOL, sets=sets, api_versions=(POOL_API,))
    (pool,) = of_kind(docs, "InferencePool")
    want = {"name": "shared-epp", "port": {"number": 9102}, "failureMode": "FailClose"}
    assert pool["spec"]["endpointPickerRef"] == want
    assert not [d for d in docs if d["metadata"]["name"].endswith("-epp")]
    # No Service name for it: the render fails, naming the key.
    args = chart.template_args(values=(str(chart.ci_dir / POOL[0]),), sets=sets[:1], api_versions=(POOL_API,))
    out = chart.helm(args, check=False)
    assert out.returncode != 0 and "inferencePool.endpointPicker.serviceName is required" in out.stderr


def test_epp_image_digest(render):
    digest = "sha256:" + "b" * 64
    docs = render(POOL, sets=(f"inferencePool.endpointPicker.image.digest={digest}",), api_versions=(POOL_API,))
    (c,) = named(docs, "Deployment", "specserve-epp")["spec"]["template"]["spec"]["containers"]
    assert c["image"] == f"registry.k8s.io/gateway-api-inference-extension/epp@{digest}"


# ---------------------------------------------------------- the vendored CRD schema


def test_rendered_pool_satisfies_the_pinned_crd_schema(render, chart):
    gate = validator()
    schema = json.loads((chart.root / "tests" / "helm" / "schemas" / gate.VENDORED[
        ("inference.networking.k8s.io/v1", "InferencePool")]).read_text())  # fmt: skip
    jsonschema.Draft7Validator.check_schema(schema)
    assert "v1.5.0" in schema["$comment"]
    for sets in ((), ("inferencePool.endpointPicker.create=false", "inferencePool.endpointPicker.serviceName=x")):
        (pool,) = of_kind(render(POOL, sets=sets, api_versions=(POOL_API,)), "InferencePool")
        assert gate.validate_doc(pool, VALIDATE_VERSIONS, {}) == []


BROKEN_POOLS = {
    "unknown-field": (lambda p: p["spec"].__setitem__("targetPortNumber", 8000), "targetPortNumber"),
    "no-target-ports": (lambda p: p["spec"].pop("targetPorts"), "targetPorts"),
    "duplicate-ports": (lambda p: p["spec"]["targetPorts"].append({"number": 8000}), "port number must be unique"),
    "port-out-of-range": (lambda p: p["spec"]["targetPorts"][0].__setitem__("number", 70000), "70000"),
    "service-without-port": (lambda p: p["spec"]["endpointPickerRef"].pop("port"), "port is required when kind is"),
    "bad-failure-mode": (lambda p: p["spec"]["endpointPickerRef"].__setitem__("failureMode", "Retry"), "Retry"),
    "empty-selector": (lambda p: p["spec"]["selector"].__setitem__("matchLabels", {}), "matchLabels"),
    "bad-label-value": (lambda p: p["spec"]["selector"]["matchLabels"].__setitem__("a", "-x-"), "-x-"),
    "unknown-metadata-field": (lambda p: p["metadata"].__setitem__("labelz", {}), "labelz"),
}


@pytest.mark.parametrize("case", list(BROKEN_POOLS))
def test_the_gate_rejects_a_broken_pool(render, case):
    gate = validator()
    (pool,) = of_kind(render(POOL, api_versions=(POOL_API,)), "InferencePool")
    mutate, needle = BROKEN_POOLS[case]
    mutate(pool)
    errors = gate.validate_doc(pool, VALIDATE_VERSIONS, {})
    assert errors and needle in "\n".join(errors), errors


# ------------------------------------------------------------------ values.schema.json


BAD_VALUES = {
    "failure-mode": ({"inferencePool": {"failureMode": "failopen"}}, "failureMode"),
    "unknown-key": ({"inferencePool": {"modelServers": {}}}, "modelServers"),
    "chart-managed-flag": ({"inferencePool": {"endpointPicker": {"flags": {"pool-name": "other"}}}}, "flags"),
    "negative-weight": ({"inferencePool": {"endpointPicker": {"scorerWeights": {"queue": -1}}}}, "queue"),
    "bad-service-name": ({"inferencePool": {"endpointPicker": {"serviceName": "Shared_EPP"}}}, "serviceName"),
    "port": ({"inferencePool": {"endpointPicker": {"port": 0}}}, "port"),
}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_values_schema_rejects(chart, tmp_path, name):
    bad, field = BAD_VALUES[name]
    planted = tmp_path / f"{name}.yaml"
    planted.write_text(yaml.safe_dump(bad))
    lint = chart.helm(["lint", "--strict", str(chart.path), "-f", chart.image_values, "-f", str(planted)], check=False)
    assert lint.returncode != 0 and field in (lint.stdout + lint.stderr), lint.stdout + lint.stderr
    tmpl = chart.helm(chart.template_args(values=(str(planted),)), check=False)
    assert tmpl.returncode != 0 and "values don't meet the specifications of the schema" in tmpl.stderr


def test_pool_values_file_satisfies_the_schema(chart):
    schema = json.loads((chart.path / "values.schema.json").read_text())
    values = yaml.safe_load((chart.path / "values.yaml").read_text())
    over = yaml.safe_load((chart.ci_dir / POOL[0]).read_text())

    def merge(a, b):
        return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                        for k, v in b.items()}}  # fmt: skip

    def no_nulls(v):
        return {k: no_nulls(x) for k, x in v.items() if x is not None} if isinstance(v, dict) else v

    jsonschema.Draft7Validator(schema).validate(no_nulls(merge(values, over)))


# ------------------------------------------------------------- autoscaling and notes


def test_autoscaling_reads_vllms_queue_metric(render):
    so = of_kind(render(POOL, api_versions=(POOL_API, KEDA_API)), "ScaledObject")[0]
    assert so["spec"]["triggers"][0]["metadata"]["query"].startswith("sum(vllm:num_requests_waiting{")
    (hpa,) = of_kind(render(POOL, api_versions=(POOL_API,)), "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm:num_requests_waiting"
    # Rules written for specserve's own name keep working with one value.
    (hpa,) = of_kind(render(POOL, sets=("autoscaling.metricName=specserve_num_requests_waiting",),
                            api_versions=(POOL_API,)), "HorizontalPodAutoscaler")  # fmt: skip
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "specserve_num_requests_waiting"


NOTES_PROBE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: notes-probe
data:
  notes: {{ tpl (.Files.Get "notes-under-test.txt") . | quote }}
"""


@pytest.mark.parametrize("apis,sets", [((), ()), ((POOL_API,), ()), ((POOL_API,), ("apiKey.secret.name=keys",))])
def test_install_notes(chart, tmp_path, apis, sets):
    copy = tmp_path / "specserve"
    shutil.copytree(chart.path, copy)
    shutil.copy(copy / "templates" / "NOTES.txt", copy / "notes-under-test.txt")
    (copy / "templates" / "zz-notes-probe.yaml").write_text(NOTES_PROBE)
    args = ["template", chart.release, str(copy), "--namespace", chart.namespace, "--kube-version", chart.kube_version,
            "--show-only", "templates/zz-notes-probe.yaml", "-f", chart.image_values, "-f", str(chart.ci_dir / POOL[0])]  # fmt: skip
    for a in apis:
        args += ["--api-versions", a]
    for s in sets:
        args += ["--set", s]
    notes = yaml.safe_load(chart.helm(args).stdout)["data"]["notes"]
    if not apis:
        assert "no pool or endpoint picker was created" in notes
    else:
        assert "kind: InferencePool, name: specserve" in notes and "specserve-epp:9002" in notes
    assert ("WARNING: the server has an API key" in notes) == bool(sets)
