"""Assertions over `helm template` output of helm/specserve (no cluster needed).

Run by scripts/helm_gate.sh with the pinned helm in .tools/bin; see conftest.py for when
these skip. Covers: GPU count == tensor-parallel size (0 = CPU mode), numeric gRPC probe
ports, CRD-gated objects present only with their API, the security context, the Hydra
selection reaching the container args, the ConfigMap mounted at the --config-dir path,
and values.schema.json rejecting bad values (helm lint --strict AND helm template fail).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specserve.methods import method_names  # the method registry (no torch, no Hydra: the gate's tools venv imports it)

try:
    import jsonschema
    import yaml
except ImportError:  # only tolerated where the whole module is skipped (see conftest)
    _tools = Path(os.environ.get("SPECSERVE_TOOLS_DIR", Path(__file__).resolve().parents[2] / ".tools"))
    if os.environ.get("SPECSERVE_HELM_GATE") or _tools.is_dir():
        raise
    jsonschema = yaml = None

CI_FILES = ("cpu-values.yaml", "gpu-eagle3-values.yaml", "tp-values.yaml")
# (values file or None for the defaults, tensor-parallel size)
CASES = [(None, 0), ("cpu-values.yaml", 0), ("gpu-eagle3-values.yaml", 1), ("tp-values.yaml", 2)]
METHODS = list(method_names())
GPU = "nvidia.com/gpu"


# ----------------------------------------------------------------------------- helpers


def objs(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind, name_suffix=None):
    found = [d for d in objs(docs, kind) if name_suffix is None or d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind}{' *' + name_suffix if name_suffix else ''}, got {len(found)}"
    return found[0]


def server(docs):
    dep = one(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "specserve"]
    return dep, pod, c


def overrides(container):
    """The Hydra overrides: container args after the --config-dir/--config-name options."""
    args = list(container["args"])
    out, i = [], 0
    while i < len(args):
        if args[i] in ("--config-dir", "--config-name"):
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def values_of(case):
    return () if case is None else (case,)


def deep_merge(base, over):
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def strip_nulls(v):
    """Helm drops null-valued keys when it coalesces values; mirror that for jsonschema."""
    if isinstance(v, dict):
        return {k: strip_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [strip_nulls(x) for x in v]
    return v


# ------------------------------------------------------------------------- the renders


@pytest.mark.parametrize("case,tp", CASES)
def test_gpu_count_equals_tensor_parallel_size(render, case, tp):
    docs = render(values_of(case))
    _, pod, c = server(docs)
    res = c["resources"]
    ov = overrides(c)
    if tp == 0:
        # CPU mode: no GPU resources, no GPU toleration, engine on the CPU, TP 1.
        assert GPU not in res.get("requests", {}) and GPU not in res.get("limits", {})
        assert not any(t.get("key") == GPU for t in pod.get("tolerations", []))
        assert "runtimeClassName" not in pod
        assert "engine.device=cpu" in ov
        assert "parallelism.tensor_parallel_size=1" in ov
        assert c["image"].endswith("-cpu")
    else:
        assert res["requests"][GPU] == tp and res["limits"][GPU] == tp
        assert isinstance(res["limits"][GPU], int)
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["runtimeClassName"] == "nvidia"
        assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
        assert "engine.device=cuda" in ov
        assert f"parallelism.tensor_parallel_size={tp}" in ov
        assert c["image"].endswith("-cuda")
        # A surge pod would need spare GPUs: GPU rollouts replace in place.
        assert server(docs)[0]["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


@pytest.mark.parametrize("tp", [0, 1, 2, 4, 8])
def test_gpu_count_follows_any_tp(render, tp):
    _, pod, c = server(render(sets=(f"parallelism.tensorParallelSize={tp}",)))
    if tp:
        assert c["resources"]["requests"][GPU] == c["resources"]["limits"][GPU] == tp
        assert f"parallelism.tensor_parallel_size={tp}" in overrides(c)
    else:
        assert GPU not in c["resources"]["limits"]


@pytest.mark.parametrize("case,tp", CASES)
def test_native_grpc_probes_on_numeric_port(render, case, tp):
    _, _, c = server(render(values_of(case)))
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    assert f"server.grpc_port={grpc_port}" in overrides(c)
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c[kind]
        assert set(probe) & {"httpGet", "tcpSocket", "exec"} == set(), kind
        port = probe["grpc"]["port"]
        assert isinstance(port, int) and not isinstance(port, bool), f"{kind} port must be a number: {port!r}"
        assert port == grpc_port
    assert c["readinessProbe"]["grpc"]["service"] == "specserve.v1.SpecServe"
    assert c["livenessProbe"]["grpc"]["service"] == ""
    s = c["startupProbe"]
    assert s["periodSeconds"] * s["failureThreshold"] >= 600, "model loading needs a generous startup budget"


@pytest.mark.parametrize("case,tp", CASES)
def test_security_context(render, case, tp):
    docs = render(values_of(case))
    _, pod, c = server(docs)
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    test_pod = one(docs, "Pod")
    for sc in (c["securityContext"], test_pod["spec"]["containers"][0]["securityContext"]):
        assert sc["runAsNonRoot"] is True
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"]["runAsUser"] != 0
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in vols[mounts["/tmp"]], "/tmp must be a writable emptyDir (read-only root)"
    shm = vols[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]


@pytest.mark.parametrize("case,tp", CASES)
def test_configmap_mounted_at_config_dir(render, case, tp):
    docs = render(values_of(case))
    _, pod, c = server(docs)
    args = c["args"]
    config_dir = args[args.index("--config-dir") + 1]
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == config_dir)
    assert mount.get("readOnly") is True
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = one(docs, "ConfigMap", "-config")
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    # Every item is a real key, and group presets land at <group>/<name>.yaml.
    for item in vol["configMap"]["items"]:
        assert item["key"] in cm["data"]
        if item["key"] != "overrides.yaml":
            group, name = item["key"][: -len(".yaml")].split("--", 1)
            assert item["path"] == f"{group}/{name}.yaml"
            assert yaml.safe_load(cm["data"][item["key"]])["path"]
    # The config checksum rolls the pods when the ConfigMap changes.
    assert len(server(docs)[0]["spec"]["template"]["metadata"]["annotations"]["checksum/config"]) == 64


EXPECTED_ARGS = {
    None: [
        "--config-dir", "/etc/specserve/conf",
        "model=smollm2-135m",
        "parallelism.tensor_parallel_size=1", "engine.device=cpu",
        "server.grpc_port=50051", "server.http_port=8000", "server.drain_timeout_s=30",
    ],
    "cpu-values.yaml": [
        "--config-dir", "/etc/specserve/conf",
        "model=smollm2-135m", "model.dtype=float32",
        "+method=draft_model", "method.num_speculative_tokens=4", "draft=smollm2-135m",
        "parallelism.tensor_parallel_size=1", "engine.device=cpu",
        "server.grpc_port=50051", "server.http_port=8000", "server.drain_timeout_s=30",
        "engine.max_num_seqs=8",
    ],
    "gpu-eagle3-values.yaml": [
        "--config-dir", "/etc/specserve/conf",
        "model=llama-3.1-8b-instruct", "model.path=meta-llama/Llama-3.1-8B-Instruct",
        "model.name=meta-llama/Llama-3.1-8B-Instruct", "model.dtype=bfloat16",
        "+method=eagle3", "method.num_speculative_tokens=3", "method.model=yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "parallelism.tensor_parallel_size=1", "engine.device=cuda",
        "server.grpc_port=50051", "server.http_port=8000", "server.drain_timeout_s=30",
        "engine.kv_cache_memory_gib=40", "engine.max_num_seqs=64",
    ],
    "tp-values.yaml": [
        "--config-dir", "/etc/specserve/conf",
        "model=qwen3-32b", "model.dtype=bfloat16",
        "+method=draft_model", "method.num_speculative_tokens=4", "draft=qwen3-0.6b",
        "parallelism.tensor_parallel_size=2", "engine.device=cuda",
        "server.grpc_port=50051", "server.http_port=8000", "server.drain_timeout_s=60",
        "engine.kv_cache_memory_gib=60",
    ],
}


@pytest.mark.parametrize("case", list(EXPECTED_ARGS))
def test_hydra_selection_reaches_container_args(render, case):
    docs = render(values_of(case))
    _, _, c = server(docs)
    assert c["command"] == ["specserve"]
    assert c["args"] == EXPECTED_ARGS[case]
    # The ConfigMap's overrides.yaml documents exactly the same list.
    cm = one(docs, "ConfigMap", "-config")
    assert yaml.safe_load(cm["data"]["overrides.yaml"])["overrides"] == overrides(c)


def test_each_value_maps_to_its_override(render):
    sets = (
        "model.name=qwen3-0.6b", "model.dtype=bfloat16", "method.name=ngram",
        "method.numSpeculativeTokens=7", "method.model=/cache/models/head", "draft.name=qwen3-tiny",
        "parallelism.tensorParallelSize=4", "server.grpcPort=6000", "server.httpPort=9000",
        "server.drainTimeoutSeconds=45", "config.name=deploy", "config.dir=/etc/ss",
        "config.extraOverrides[0]=engine.max_num_seqs=3", "config.extraOverrides[1]=+engine.seed=7",
    )
    docs = render(sets=sets)
    _, pod, c = server(docs)
    assert c["args"] == [
        "--config-dir", "/etc/ss", "--config-name", "deploy",
        "model=qwen3-0.6b", "model.dtype=bfloat16",
        "+method=ngram", "method.num_speculative_tokens=7", "method.model=/cache/models/head",
        "draft=qwen3-tiny",
        "parallelism.tensor_parallel_size=4", "engine.device=cuda",
        "server.grpc_port=6000", "server.http_port=9000", "server.drain_timeout_s=45",
        "engine.max_num_seqs=3", "+engine.seed=7",
    ]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 6000, "http": 9000}
    assert all(c[p]["grpc"]["port"] == 6000 for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert any(m["mountPath"] == "/etc/ss" for m in c["volumeMounts"])
    # Grace period covers preStop sleep + drain.
    assert pod["terminationGracePeriodSeconds"] >= 45 + 5
    np = one(docs, "NetworkPolicy", "specserve")
    assert {p["port"] for p in np["spec"]["ingress"][0]["ports"]} == {6000, 9000}


def test_method_null_means_plain_decoding(render):
    _, _, c = server(render())
    ov = overrides(c)
    assert not [o for o in ov if "method" in o or "draft" in o]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_renders(render, method):
    _, _, c = server(render(sets=(f"method.name={method}",)))
    assert f"+method={method}" in overrides(c)
    assert "method.num_speculative_tokens=3" in overrides(c)


@pytest.mark.parametrize("case,tp", CASES)
def test_service_ports(render, case, tp):
    docs = render(values_of(case))
    _, _, c = server(docs)
    svc = one(docs, "Service")
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert set(ports) == {"grpc", "http", "metrics"}
    container_ports = {p["name"] for p in c["ports"]}
    assert {p["targetPort"] for p in ports.values()} <= container_ports
    assert ports["metrics"]["targetPort"] == "http"  # /metrics is on the HTTP port


@pytest.mark.parametrize("case,tp", CASES)
def test_graceful_shutdown(render, case, tp):
    docs = render(values_of(case))
    _, pod, c = server(docs)
    drain = next(int(o.split("=")[1]) for o in overrides(c) if o.startswith("server.drain_timeout_s="))
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > drain + sleep
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["selector"]["matchLabels"] == server(docs)[0]["spec"]["selector"]["matchLabels"]


def test_environment_and_cache(render):
    docs = render(("gpu-eagle3-values.yaml",))
    _, pod, c = server(docs)
    env = env_of(c)
    cache = next(m for m in c["volumeMounts"] if m["name"] == "model-cache")["mountPath"]
    assert env["SPECSERVE_CACHE_DIR"]["value"] == cache
    assert env["HF_HOME"]["value"].startswith(cache)
    assert env["SPECSERVE_MODELS_DIR"]["value"].startswith(cache)
    assert "HF_TOKEN" not in env  # the server never downloads; the init container fetches, with the token
    assert env["HF_HUB_OFFLINE"]["value"] == "1"
    (init,) = pod["initContainers"]
    assert env_of(init)["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    pvc = one(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    claim = next(v for v in pod["volumes"] if v["name"] == "model-cache")["persistentVolumeClaim"]["claimName"]
    assert claim == pvc["metadata"]["name"]

    docs = render(("cpu-values.yaml",))
    _, pod, c = server(docs)
    env = env_of(c)
    assert env["HF_HUB_OFFLINE"]["value"] == "1"
    assert env["SPECSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "specserve-api-key"
    assert "HF_TOKEN" not in env
    assert not objs(docs, "PersistentVolumeClaim")
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == "model-cache")


def test_triton_cache_persists_on_the_model_cache(render):
    """TRITON_CACHE_DIR lies on the model-cache volume (a PVC in this profile: the kernels the
    engine compiles at start-up survive a restart), or in /tmp with tritonCache.location=tmp;
    both are writable volumes under the read-only root filesystem."""
    _, pod, c = server(render(("gpu-eagle3-values.yaml",)))
    cache = next(m for m in c["volumeMounts"] if m["name"] == "model-cache")["mountPath"]
    assert env_of(c)["TRITON_CACHE_DIR"]["value"] == f"{cache}/triton"
    assert "persistentVolumeClaim" in next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    _, _, c = server(render(("gpu-eagle3-values.yaml",), sets=("tritonCache.location=tmp",)))
    assert env_of(c)["TRITON_CACHE_DIR"]["value"] == "/tmp/triton"
    assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])


def test_existing_claim_is_used_not_created(render):
    docs = render(("tp-values.yaml",))
    _, pod, _ = server(docs)
    assert not objs(docs, "PersistentVolumeClaim")
    vol = next(v for v in pod["volumes"] if v["name"] == "model-cache")
    assert vol["persistentVolumeClaim"]["claimName"] == "specserve-models"


def test_image_tag_and_digest(render):
    _, _, c = server(render())
    assert c["image"] == "registry.example.com/specserve:0.1.0-cpu"  # tests/helm/image-values.yaml
    digest = "sha256:" + "a" * 64
    _, _, c = server(render(sets=(f"image.digest={digest}",)))
    assert c["image"] == f"registry.example.com/specserve@{digest}"
    _, _, c = server(render(sets=("image.tag=dev",)))
    assert c["image"].endswith(":dev")


# ----------------------------------------------------------------- CRD-gated objects


@pytest.mark.parametrize("case,tp", CASES)
def test_servicemonitor_only_with_its_api(render, chart, case, tp):
    without = render(values_of(case), api_versions=())
    assert not objs(without, "ServiceMonitor")
    with_api = render(values_of(case), api_versions=(chart.servicemonitor_api,))
    sm = one(with_api, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    svc = one(with_api, "Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


def test_servicemonitor_scrapes_with_the_key_the_server_needs(render, chart):
    """/metrics needs a key whenever the server has one: the ServiceMonitor sends the metrics
    key's Secret when set, else the API key's; the pod reads the metrics key from the same Secret."""
    api = (chart.servicemonitor_api,)
    open_sm = one(render(api_versions=api), "ServiceMonitor")
    assert "authorization" not in open_sm["spec"]["endpoints"][0]
    keyed = one(render(("cpu-values.yaml",), api_versions=api), "ServiceMonitor")
    assert keyed["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer", "credentials": {"name": "specserve-api-key", "key": "api-key"}}  # fmt: skip
    assert "SPECSERVE_METRICS_KEY" not in env_of(server(render(("cpu-values.yaml",)))[2])
    sets = ("apiKey.metricsSecret.name=specserve-metrics-key",)
    docs = render(("cpu-values.yaml",), sets=sets, api_versions=api)
    want = {"name": "specserve-metrics-key", "key": "metrics-key"}
    assert one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["authorization"]["credentials"] == want
    env = env_of(server(docs)[2])
    assert env["SPECSERVE_METRICS_KEY"]["valueFrom"]["secretKeyRef"] == want
    assert env["SPECSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "specserve-api-key"


def test_keda_scaledobject_only_with_its_api(render, chart):
    with_api = render(("tp-values.yaml",), api_versions=(chart.keda_api,))
    so = one(with_api, "ScaledObject")
    assert not objs(with_api, "HorizontalPodAutoscaler"), "KEDA owns the HPA"
    trig = so["spec"]["triggers"][0]
    assert trig["type"] == "prometheus"
    assert trig["metadata"]["query"] == 'sum(vllm:num_requests_waiting{namespace="specserve",service="specserve"})'
    assert so["spec"]["scaleTargetRef"]["name"] == server(with_api)[0]["metadata"]["name"]
    assert "replicas" not in server(with_api)[0]["spec"]
    # Without the API: no ScaledObject; the HPA on the same metric takes over.
    without = render(("tp-values.yaml",), api_versions=())
    assert not objs(without, "ScaledObject")
    assert one(without, "HorizontalPodAutoscaler")


def test_hpa_scales_on_waiting_requests(render):
    docs = render(("gpu-eagle3-values.yaml",))
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    (m,) = hpa["spec"]["metrics"]
    assert m["type"] == "Pods"
    assert m["pods"]["metric"]["name"] == "vllm:num_requests_waiting"  # vLLM's name: rules written for vLLM work
    assert m["pods"]["target"] == {"type": "AverageValue", "averageValue": "8"}
    assert "replicas" not in server(docs)[0]["spec"]
    assert not objs(render(), "HorizontalPodAutoscaler")


# --------------------------------------------------- network policy, test hook, dashboard


def test_network_policy(render):
    docs = render()
    np = one(docs, "NetworkPolicy", "specserve")
    assert set(np["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert np["spec"]["podSelector"]["matchLabels"] == server(docs)[0]["spec"]["selector"]["matchLabels"]
    # Offline by default: DNS only, no 443.
    egress_ports = {p["port"] for r in np["spec"]["egress"] for p in r.get("ports", [])}
    assert egress_ports == {53}
    docs = render(("gpu-eagle3-values.yaml",))
    np = one(docs, "NetworkPolicy", "specserve")
    assert 443 in {p["port"] for r in np["spec"]["egress"] for p in r.get("ports", [])}
    # Restricted ingress keeps the helm test pod's label allowed.
    docs = render(sets=("networkPolicy.ingressFrom[0].namespaceSelector.matchLabels.team=llm",))
    np = one(docs, "NetworkPolicy", "specserve")
    peers = np["spec"]["ingress"][0]["from"]
    test_labels = one(docs, "Pod")["metadata"]["labels"]
    assert any(p.get("podSelector", {}).get("matchLabels", {}).items() <= test_labels.items()
               and p.get("podSelector") for p in peers)


def test_helm_test_hook_checks_grpc_health(render):
    docs = render()
    pod = one(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    cmd = "\n".join(pod["spec"]["containers"][0]["command"])
    assert "grpc_health.v1" in cmd and "specserve.v1.SpecServe" in cmd
    svc = one(docs, "Service")
    assert f"{svc['metadata']['name']}:50051" in cmd
    # The test pod is not a server pod (not behind the Service/PDB/NetworkPolicy selector).
    sel = server(docs)[0]["spec"]["selector"]["matchLabels"]
    assert not sel.items() <= pod["metadata"]["labels"].items()


def test_grafana_dashboard(render):
    docs = render()
    cm = one(docs, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    (body,) = cm["data"].values()
    dash = json.loads(body)
    exprs = "\n".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for needle in (  # vLLM's names (docs/metrics.md); tests/test_dashboard.py checks them against the server
        "1 + sum(rate(vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_requests_waiting",
        "histogram_quantile(0.5, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket",
        "histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket",
        "histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:inter_token_latency_seconds_bucket",
        "vllm:kv_cache_usage_perc",
    ):
        assert needle in exprs, needle
    for t in ("acceptance length", "per draft position", "tokens/s", "time to first token", "inter-token", "kv cache"):
        assert t in titles, t
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    assert not objs(render(sets=("metrics.dashboard.enabled=false",)), "ConfigMap")[1:]


# ------------------------------------------------------------- values.schema.json


def _walk_objects(schema, path="#"):
    if isinstance(schema, dict):
        if schema.get("type") == "object" and "properties" in schema:
            yield path, schema
        for k, v in schema.items():
            yield from _walk_objects(v, f"{path}/{k}")
    elif isinstance(schema, list):
        for i, v in enumerate(schema):
            yield from _walk_objects(v, f"{path}/{i}")


def test_values_schema_is_strict_draft07(chart):
    schema = json.loads((chart.path / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    for path, sub in _walk_objects(schema):
        assert sub.get("additionalProperties") is False, f"{path}: additionalProperties must be false"
    refs = [v for _, v in _iter_refs(schema)]
    assert refs and all(r.startswith("#/") for r in refs), "keep $refs local"
    props = schema["properties"]
    assert props["method"]["properties"]["name"]["enum"] == METHODS + [None]
    assert props["method"]["properties"]["numSpeculativeTokens"]["minimum"] == 1
    tp = props["parallelism"]["properties"]["tensorParallelSize"]
    assert tp["type"] == "integer" and tp["minimum"] == 0


def _iter_refs(schema):
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k == "$ref":
                yield k, v
            else:
                yield from _iter_refs(v)
    elif isinstance(schema, list):
        for v in schema:
            yield from _iter_refs(v)


@pytest.mark.parametrize("case", [None, *CI_FILES])
def test_values_files_satisfy_the_schema(chart, case):
    schema = json.loads((chart.path / "values.schema.json").read_text())
    values = yaml.safe_load((chart.path / "values.yaml").read_text())
    if case:
        values = deep_merge(values, yaml.safe_load((chart.ci_dir / case).read_text()))
    jsonschema.Draft7Validator(schema).validate(strip_nulls(values))


def test_ci_values_files_exist(chart):
    present = {p.name for p in chart.ci_dir.glob("*-values.yaml")}
    assert set(CI_FILES) <= present


BAD_VALUES = {
    "k-zero": ({"method": {"name": "eagle3", "numSpeculativeTokens": 0}}, "numSpeculativeTokens"),
    "k-negative": ({"method": {"name": "ngram", "numSpeculativeTokens": -2}}, "numSpeculativeTokens"),
    "k-too-big": ({"method": {"name": "ngram", "numSpeculativeTokens": 129}}, "numSpeculativeTokens"),
    "k-not-integer": ({"method": {"name": "ngram", "numSpeculativeTokens": 2.5}}, "numSpeculativeTokens"),
    "unknown-method": ({"method": {"name": "lookahead"}}, "method"),
    "negative-gpu-count": ({"parallelism": {"tensorParallelSize": -1}}, "tensorParallelSize"),
    "fractional-gpu-count": ({"parallelism": {"tensorParallelSize": 1.5}}, "tensorParallelSize"),
    "string-gpu-count": ({"parallelism": {"tensorParallelSize": "2"}}, "tensorParallelSize"),
    "unknown-top-level-field": ({"replicas": 3}, "replicas"),
    "unknown-nested-field": ({"server": {"grpcPortt": 50052}}, "grpcPortt"),
    "unknown-preset-field": ({"config": {"presets": {"model": {"m": {"path": "/m", "dtpye": "bf16"}}}}}, "dtpye"),
    "bad-dtype": ({"model": {"dtype": "fp8"}}, "dtype"),
    "port-out-of-range": ({"server": {"httpPort": 70000}}, "httpPort"),
    "chart-managed-override": ({"config": {"extraOverrides": ["engine.device=cpu"]}}, "extraOverrides"),
    "gpu-in-resources": ({"resources": {"limits": {"nvidia.com/gpu": 1}}}, "nvidia.com/gpu"),
    "root-user": ({"podSecurityContext": {"runAsUser": 0, "runAsGroup": 0}}, "runAsUser"),
    "unknown-triton-cache": ({"tritonCache": {"location": "hostPath"}}, "location"),
}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_schema_rejects_bad_values(chart, tmp_path, name):
    bad, field = BAD_VALUES[name]
    planted = tmp_path / f"{name}.yaml"
    planted.write_text(yaml.safe_dump(bad))
    lint = chart.helm(["lint", "--strict", str(chart.path), "-f", chart.image_values, "-f", str(planted)], check=False)
    assert lint.returncode != 0, f"helm lint --strict accepted {bad}"
    assert field in (lint.stdout + lint.stderr), lint.stdout + lint.stderr
    tmpl = chart.helm(chart.template_args(values=(str(planted),)), check=False)
    assert tmpl.returncode != 0, f"helm template accepted {bad}"
    assert "values don't meet the specifications of the schema" in tmpl.stderr, tmpl.stderr


def test_good_values_lint_clean(chart, tmp_path):
    """The negative tests above mean something only if the same path accepts good values."""
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"method": {"name": "eagle3", "numSpeculativeTokens": 1},
                                    "parallelism": {"tensorParallelSize": 0}}))
    lint = chart.helm(["lint", "--strict", str(chart.path), "-f", chart.image_values, "-f", str(good)], check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr


# ------------------------------------------------------------------------ NOTES.txt


NOTES_PROBE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: notes-probe
data:
  notes: {{ tpl (.Files.Get "notes-under-test.txt") . | quote }}
"""


@pytest.mark.parametrize("case,apis", [(None, ()), ("cpu-values.yaml", ()), ("gpu-eagle3-values.yaml", ()),
                                       ("tp-values.yaml", ()), ("tp-values.yaml", ("keda.sh/v1alpha1/ScaledObject",))])
def test_install_notes_render(chart, tmp_path, case, apis):
    """`helm template` skips NOTES.txt and `helm install --dry-run` needs a cluster (helm 3):
    render it through tpl in a scratch copy of the chart so a broken NOTES cannot ship."""
    import shutil

    copy = tmp_path / "specserve"
    shutil.copytree(chart.path, copy)
    shutil.copy(copy / "templates" / "NOTES.txt", copy / "notes-under-test.txt")
    (copy / "templates" / "zz-notes-probe.yaml").write_text(NOTES_PROBE)
    args = ["template", chart.release, str(copy), "--namespace", chart.namespace,
            "--kube-version", chart.kube_version, "--show-only", "templates/zz-notes-probe.yaml",
            "-f", chart.image_values]
    for a in apis:
        args += ["--api-versions", a]
    if case:
        args += ["-f", str(chart.ci_dir / case)]
    notes = yaml.safe_load(chart.helm(args).stdout)["data"]["notes"]
    _, _, c = server(chart.render(values_of(case), api_versions=apis))
    assert "specserve " + " ".join(c["args"]) in notes
    assert "1 + rate(specserve_spec_decode_num_accepted_tokens_total[5m])" in notes
    assert "helm test specserve" in notes
    assert ("no ServiceMonitor was created" in notes) == (not apis or "monitoring" not in apis[0])
    scrape = next(line for line in notes.splitlines() if "curl" in line and "/metrics" in line)
    assert ("Authorization: Bearer $API_KEY" in scrape) == (case == "cpu-values.yaml")  # its API key opens /metrics
    if case == "tp-values.yaml":
        assert ("HorizontalPodAutoscaler" in notes) == (not apis)
