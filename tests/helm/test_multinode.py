"""The chart's multi-node mode: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) instead of
the Deployment when parallelism.multiNode.enabled and the cluster serves the API.

Run by scripts/helm_gate.sh (see conftest.py): GPU count per pod = TP / nodes, the leader
is rank 0 and the only pod the Service, PDB and server NetworkPolicy select, workers run
the same command line (rank from the LWS environment), the rendezvous port is open within
the group only, autoscaling targets the LeaderWorkerSet, and without the API the
single-pod Deployment renders.
"""

from __future__ import annotations

import pytest

try:
    import yaml
except ImportError:  # only where the whole module is skipped (see conftest)
    yaml = None

GPU = "nvidia.com/gpu"
MN = ("multinode-values.yaml",)


def _one(docs, kind, suffix=None):
    found = [d for d in docs if d["kind"] == kind and (suffix is None or d["metadata"]["name"].endswith(suffix))]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _container(pod_template):
    (c,) = [c for c in pod_template["spec"]["containers"] if c["name"] == "specserve"]
    return c


def _args(c):
    return [a for a in c["args"][2:]]  # after --config-dir DIR


def test_leaderworkerset_replaces_the_deployment(render):
    docs = render(MN)
    assert not [d for d in docs if d["kind"] == "Deployment"]
    lws = _one(docs, "LeaderWorkerSet")
    spec = lws["spec"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    lwt = spec["leaderWorkerTemplate"]
    assert lwt["size"] == 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["startupPolicy"] == "LeaderCreated"  # the leader is ready only once the workers joined
    assert "replicas" not in spec  # autoscaling owns the group count
    for role in ("leaderTemplate", "workerTemplate"):
        c = _container(lwt[role])
        res = c["resources"]
        assert res["requests"][GPU] == res["limits"][GPU] == 8  # TP 16 over 2 nodes
        assert "parallelism.tensor_parallel_size=16" in _args(c) and "parallelism.master_port=29500" in _args(c)
        assert "engine.device=cuda" in _args(c)
    # Leader and worker run the same command line: the rank comes from LWS_WORKER_INDEX.
    assert _container(lwt["leaderTemplate"])["args"] == _container(lwt["workerTemplate"])["args"]


def test_leader_serves_and_workers_do_not(render):
    docs = render(MN)
    lwt = _one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    leader, worker = _container(lwt["leaderTemplate"]), _container(lwt["workerTemplate"])
    assert {p["name"] for p in leader["ports"]} == {"grpc", "http", "rendezvous"}
    assert next(p for p in leader["ports"] if p["name"] == "rendezvous")["containerPort"] == 29500
    assert leader["readinessProbe"]["grpc"]["service"] == "specserve.v1.SpecServe"
    assert "ports" not in worker and "readinessProbe" not in worker and "lifecycle" not in worker
    lead_labels = lwt["leaderTemplate"]["metadata"]["labels"]
    work_labels = lwt["workerTemplate"]["metadata"]["labels"]
    assert lead_labels["app.kubernetes.io/component"] == "server"
    assert work_labels["app.kubernetes.io/component"] == "tp-worker"
    svc = _one(docs, "Service")
    sel = svc["spec"]["selector"]
    assert sel.items() <= lead_labels.items() and not sel.items() <= work_labels.items()
    # Both stay non-root with a read-only root filesystem.
    for c in (leader, worker):
        assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["runAsNonRoot"]


def test_group_network_policy_and_pdb_cover_every_rank(render):
    docs = render(MN)
    lwt = _one(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    group = _one(docs, "NetworkPolicy", "-tp-group")
    sel = group["spec"]["podSelector"]["matchLabels"]
    for role in ("leaderTemplate", "workerTemplate"):
        assert sel.items() <= lwt[role]["metadata"]["labels"].items()
    assert group["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": sel}}]}]
    assert {"to": [{"podSelector": {"matchLabels": sel}}]} in group["spec"]["egress"]
    pdb = _one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == sel


def test_autoscaling_targets_the_leaderworkerset(render, chart):
    ref = _one(render(MN), "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert ref == {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": "specserve"}
    keda = render(MN, sets=("autoscaling.keda.enabled=true",))
    assert _one(keda, "ScaledObject")["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"


def test_without_the_api_the_deployment_renders(render, chart):
    docs = render(MN, api_versions=(chart.servicemonitor_api,))
    assert not [d for d in docs if d["kind"] in ("LeaderWorkerSet",)]
    assert not [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-tp-group")]
    dep = _one(docs, "Deployment")
    c = _container(dep["spec"]["template"])
    assert c["resources"]["limits"][GPU] == 16 and "parallelism.master_port=29500" not in _args(c)


@pytest.mark.parametrize("sets, message", [
    (("parallelism.tensorParallelSize=12", "parallelism.multiNode.nodes=5"),
     "parallelism.tensorParallelSize (12) must be a multiple of parallelism.multiNode.nodes (5)"),
    (("parallelism.tensorParallelSize=0",), "parallelism.multiNode.enabled needs GPUs"),
])  # fmt: skip
def test_layouts_the_chart_refuses(chart, sets, message):
    args = chart.template_args(values=(str(chart.ci_dir / MN[0]),), sets=sets)
    out = chart.helm(args, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


@pytest.mark.parametrize("bad, field", [
    ({"parallelism": {"tensorParallelSize": 4, "multiNode": {"enabled": True, "nodes": 1}}}, "nodes"),
    ({"parallelism": {"tensorParallelSize": 4, "multiNode": {"enabled": "yes"}}}, "enabled"),
    ({"parallelism": {"tensorParallelSize": 4, "multiNode": {"masterPort": 80}}}, "masterPort"),
    ({"parallelism": {"tensorParallelSize": 4, "multiNode": {"groupSize": 2}}}, "groupSize"),
    ({"config": {"extraOverrides": ["parallelism.master_port=1234"]}}, "extraOverrides"),
])  # fmt: skip
def test_schema_rejects_bad_multinode_values(chart, tmp_path, bad, field):
    planted = tmp_path / "bad.yaml"
    planted.write_text(yaml.safe_dump(bad))
    lint = chart.helm(["lint", "--strict", str(chart.path), "-f", chart.image_values, "-f", str(planted)], check=False)
    assert lint.returncode != 0 and field in (lint.stdout + lint.stderr), lint.stdout + lint.stderr
