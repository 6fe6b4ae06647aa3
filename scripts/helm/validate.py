"""Strict schema validation of rendered chart objects (run with .tools/venv-validate).

    python scripts/helm/validate.py -k 1.29.0 -k 1.31.0 -k 1.33.0 RENDERED.yaml ...

* Built-in kinds: kubernetes-validate's strict schemas (unknown fields are errors) for
  every Kubernetes version given. A kind with no schema is an error, not a warning.
* CRD kinds (ServiceMonitor, PodMonitor, ScaledObject): the typed cloudcoil models accept
  unknown fields, so each object is round-tripped (model_validate -> model_dump(by_alias,
  exclude_unset, json)) and must come back unchanged: a dropped key is an unknown field.
* LeaderWorkerSet (leaderworkerset.x-k8s.io/v1; no typed model is published): its own
  fields against a strict JSON schema written from the LWS v1 API types (LWS_SCHEMA), and
  each pod template (leaderTemplate, workerTemplate) as a core/v1 PodTemplate with
  kubernetes-validate, strict, for every Kubernetes version given.
* InferencePool (inference.networking.k8s.io/v1, Gateway API Inference Extension): against
  the strict JSON schema vendored from the extension's pinned CRD
  (tests/helm/schemas/inference.networking.k8s.io/inferencepool_v1.json, see the README
  there), and its metadata as ObjectMeta with kubernetes-validate, strict, for every
  Kubernetes version given.
* Before anything else, a canary: a Deployment with one unknown field must be REJECTED,
  and a ServiceMonitor with one unknown field must be caught; otherwise the validator
  itself is broken and the gate fails.

Exit status 0 only if every object in every file passes for every version.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import yaml


def _crd_models() -> dict[tuple[str, str], Any]:
    from cloudcoil.models.keda.v1alpha1 import ScaledObject
    from cloudcoil.models.prometheus_operator.v1 import PodMonitor, ServiceMonitor

    return {
        ("monitoring.coreos.com/v1", "ServiceMonitor"): ServiceMonitor,
        ("monitoring.coreos.com/v1", "PodMonitor"): PodMonitor,
        ("keda.sh/v1alpha1", "ScaledObject"): ScaledObject,
    }


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where b (round trip) differs from a (input)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in b:
                out.append(f"{path}.{k}: unknown field (dropped by the typed model)")
            elif k not in a:
                out.append(f"{path}.{k}: added by the typed model")
            else:
                out += _diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: list length {len(a)} != {len(b)}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += _diff(x, y, f"{path}[{i}]")
        return out
    if a != b or type(a) is not type(b):
        return [f"{path}: {a!r} != {b!r}"]
    return []


LWS_API = ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
_INT_OR_STRING = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[0-9]+%$"}]}
# The LeaderWorkerSet's own fields (v1 API types: LeaderWorkerSetSpec, LeaderWorkerTemplate,
# RolloutStrategy, NetworkConfig, SubGroupPolicy); pod templates are checked separately.
LWS_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": LWS_API[0]},
        "kind": {"const": LWS_API[1]},
        "metadata": {"type": "object"},  # ObjectMeta: checked through a ConfigMap carrier below
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["type"],
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"partition": {"type": "integer", "minimum": 0},
                                           "maxUnavailable": _INT_OR_STRING, "maxSurge": _INT_OR_STRING},
                        },
                    },
                },
                "networkConfig": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}},
                },
                "leaderWorkerTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["workerTemplate"],
                    "properties": {
                        "leaderTemplate": {"type": "object"},
                        "workerTemplate": {"type": "object"},
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart",
                                                   "None"]},
                        "subGroupPolicy": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"subGroupPolicyType": {"enum": ["LeaderWorker", "LeaderExcluded"]},
                                           "subGroupSize": {"type": "integer", "minimum": 1}},
                        },
                        "volumeClaimTemplates": {"type": "array"},
                    },
                },
            },
        },
    },
}


def check_lws(doc: dict, versions: list[str]) -> list[str]:
    import jsonschema

    errors = [f"[LWS schema] {'.'.join(str(p) for p in e.path)}: {e.message}"
              for e in jsonschema.Draft7Validator(LWS_SCHEMA).iter_errors(doc)]
    if errors:
        return errors
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}
    carriers = [("metadata", meta)]
    lwt = doc["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        if key in lwt:
            carriers.append((key, {"apiVersion": "v1", "kind": "PodTemplate",
                                   "metadata": {"name": f"{doc['metadata'].get('name', 'lws')}-{key.lower()}"},
                                   "template": lwt[key]}))
    for where, obj in carriers:
        for v in versions:
            errors += [f"[k8s {v}] {where}: {m}" for m in check_builtin(obj, v)]
    return errors


SCHEMA_DIR = Path(__file__).resolve().parents[2] / "tests" / "helm" / "schemas"
# CRD kinds checked against a vendored JSON schema (kubeconform's file layout).
VENDORED = {("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io/inferencepool_v1.json"}


def check_vendored(doc: dict, schema_file: str, versions: list[str]) -> list[str]:
    import jsonschema

    schema = json.loads((SCHEMA_DIR / schema_file).read_text())
    errors = []
    for e in jsonschema.Draft7Validator(schema).iter_errors(doc):
        rule = e.schema.get("x-kubernetes-validation-message") if isinstance(e.schema, dict) else None
        errors.append(f"[{schema_file}] {'.'.join(str(p) for p in e.path) or '.'}: {rule or e.message}")
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata", {})}
    for v in versions:
        errors += [f"[k8s {v}] metadata: {m}" for m in check_builtin(meta, v)]
    return errors


def check_crd(doc: dict, model: Any) -> list[str]:
    try:
        obj = model.model_validate(doc)
    except Exception as e:  # pydantic.ValidationError
        return [f"model validation: {str(e).splitlines()[0]} ... {e}"]
    back = obj.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return _diff(doc, back)


_CACHED = False


def _cache_schemas() -> None:
    """kubernetes-validate re-reads the (large) definitions file per object: memoise it."""
    global _CACHED
    if not _CACHED:
        import functools

        import kubernetes_validate.utils as kvu

        kvu.schema_contents = functools.lru_cache(maxsize=None)(kvu.schema_contents)
        _CACHED = True


def check_builtin(doc: dict, version: str) -> list[str]:
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError

    _cache_schemas()
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except SchemaNotFoundError as e:
        return [e.message]
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        return [f"{where}: {e.message}"]
    return []


def validate_doc(doc: dict, versions: list[str], crds: dict) -> list[str]:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key == LWS_API:
        return check_lws(doc, versions)
    if key in VENDORED:
        return check_vendored(doc, VENDORED[key], versions)
    if key in crds:
        return [f"[CRD round trip] {m}" for m in check_crd(doc, crds[key])]
    errors = []
    for v in versions:
        errors += [f"[k8s {v}] {m}" for m in check_builtin(doc, v)]
    return errors


def canary(versions: list[str], crds: dict) -> list[str]:
    bad_deploy = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "canary"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "template": {
                "metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c", "image": "i", "notAField": True}]},
            },
        },
    }
    good_deploy = copy.deepcopy(bad_deploy)
    del good_deploy["spec"]["template"]["spec"]["containers"][0]["notAField"]
    bad_sm = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "canary"},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "endpoints": [{"port": "m", "notAField": 1}]},
    }
    bad_lws = {
        "apiVersion": LWS_API[0], "kind": LWS_API[1], "metadata": {"name": "canary"},
        "spec": {"leaderWorkerTemplate": {"size": 2, "workerTemplate": copy.deepcopy(bad_deploy["spec"]["template"])}},
    }
    good_lws = copy.deepcopy(bad_lws)
    good_lws["spec"]["leaderWorkerTemplate"]["workerTemplate"] = copy.deepcopy(good_deploy["spec"]["template"])
    odd_lws = copy.deepcopy(good_lws)
    odd_lws["spec"]["leaderWorkerTemplate"]["groupSize"] = 2
    good_pool = {
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "canary"},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}],
                 "endpointPickerRef": {"name": "canary-epp", "port": {"number": 9002}}},
    }
    odd_pool = copy.deepcopy(good_pool)
    odd_pool["spec"]["targetPortNumber"] = 8000  # the v1alpha2 field
    portless_pool = copy.deepcopy(good_pool)
    del portless_pool["spec"]["endpointPickerRef"]["port"]  # a Service reference needs its port
    problems = []
    if validate_doc(good_pool, versions, crds):
        problems.append(f"canary: a valid InferencePool was rejected: {validate_doc(good_pool, versions, crds)}")
    if not validate_doc(odd_pool, versions, crds):
        problems.append("canary: an unknown InferencePool field was NOT rejected")
    if not validate_doc(portless_pool, versions, crds):
        problems.append("canary: an InferencePool endpointPickerRef to a Service without a port was NOT rejected")
    if validate_doc(good_lws, versions, crds):
        problems.append(f"canary: a valid LeaderWorkerSet was rejected: {validate_doc(good_lws, versions, crds)}")
    if not validate_doc(bad_lws, versions, crds):
        problems.append("canary: an unknown field in a LeaderWorkerSet pod template was NOT rejected")
    if not validate_doc(odd_lws, versions, crds):
        problems.append("canary: an unknown LeaderWorkerSet field was NOT rejected")
    for v in versions:
        if check_builtin(good_deploy, v):
            problems.append(f"canary: a valid Deployment was rejected for {v}: {check_builtin(good_deploy, v)}")
        if not check_builtin(bad_deploy, v):
            problems.append(f"canary: an unknown Deployment field was NOT rejected for {v} (validator not strict)")
    if not validate_doc(bad_sm, versions, crds):
        problems.append("canary: an unknown ServiceMonitor field was NOT caught by the round trip")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", "--kube-version", action="append", required=True)
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    crds = _crd_models()

    problems = canary(args.kube_version, crds)
    for p in problems:
        print(f"FAIL {p}")
    n_objects = 0
    n_bad = 0
    kinds: dict[str, int] = {}
    for f in args.files:
        for doc in yaml.safe_load_all(f.read_text()):
            if not doc:
                continue
            n_objects += 1
            name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            kinds[doc.get("kind", "?")] = kinds.get(doc.get("kind", "?"), 0) + 1
            errs = validate_doc(doc, args.kube_version, crds)
            if errs:
                n_bad += 1
                for e in errs:
                    print(f"FAIL {f.name}: {name}: {e}")
    versions = ", ".join(args.kube_version)
    summary = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
    print(f"validated {n_objects} objects from {len(args.files)} renders against Kubernetes {versions} "
          f"(strict) and CRD models: {n_bad} invalid; kinds: {summary}")
    return 1 if (problems or n_bad or n_objects == 0) else 0


if __name__ == "__main__":
    sys.exit(main())
