"""A first install as the docs print it: the chart names no image of its own, and fetches
Hugging Face models for the server.

* without image.repository the chart refuses to render (template and lint), naming the key
  and docs/deploy.md; the ci/cpu-values.yaml of the quick start names the README's build;
* model.hubId (+ revision): the server is told ``model.path=<id>@<rev>``, ``model.name=<id>``;
  an init container fetches exactly that id (and method.model when it is an id) into the
  cache the server reads, with the image, the token from the Secret and the volume the
  server uses, and the NetworkPolicy opens 443 for it;
* modelCache.offline: no init container, no 443, and the server's one-line error for a
  missing model names modelCache.offline (SPECSERVE_MODEL_FETCH_HINT).
"""

from __future__ import annotations

import pytest
import yaml

HUB_SETS = ("model.hubId=Qwen/Qwen3-0.6B", "model.revision=" + "c" * 40, "modelCache.offline=false",
            "huggingface.tokenSecret.name=hf-token")  # fmt: skip


def objs(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def server(docs):
    (dep,) = objs(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == "specserve"]
    return pod, c


def env_of(c):
    return {e["name"]: e for e in c.get("env", [])}


def egress_ports(docs):
    (np,) = [d for d in objs(docs, "NetworkPolicy") if d["metadata"]["name"] == "specserve"]
    return {p["port"] for r in np["spec"]["egress"] for p in r.get("ports", [])}


def test_no_image_no_render(chart):
    proc = chart.helm(["template", "specserve", str(chart.path), "--kube-version", chart.kube_version], check=False)
    assert proc.returncode != 0, "helm template accepted the chart without image.repository"
    assert "image.repository is required" in proc.stderr and "docs/deploy.md" in proc.stderr, proc.stderr
    # helm lint never fails on `required` (lint mode), but it says it:
    lint = chart.helm(["lint", "--strict", str(chart.path)], check=False)
    assert "Missing required value: image.repository is required" in lint.stdout + lint.stderr


def test_the_quick_start_values_name_the_readme_build(render, chart):
    cpu = yaml.safe_load((chart.ci_dir / "cpu-values.yaml").read_text())
    assert cpu["image"]["repository"] == "specserve"
    _, c = server(render(("cpu-values.yaml",)))
    assert c["image"] == "specserve:0.1.0-cpu"
    readme = (chart.root / "README.md").read_text()
    assert "docker build -f docker/Dockerfile.cpu -t specserve:0.1.0-cpu ." in readme
    assert "kind load docker-image specserve:0.1.0-cpu" in readme


def test_a_hub_model_is_fetched_by_an_init_container(render):
    docs = render(sets=HUB_SETS)
    pod, c = server(docs)
    rev = "c" * 40
    assert f"model.path='Qwen/Qwen3-0.6B@{rev}'" in c["args"] and "model.name=Qwen/Qwen3-0.6B" in c["args"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["python", "-m", "specserve.hub", "fetch", f"Qwen/Qwen3-0.6B@{rev}"]
    assert init["image"] == c["image"]
    env, server_env = env_of(init), env_of(c)
    assert env["HF_HOME"] == server_env["HF_HOME"]  # fetched where the server looks
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    assert "HF_HUB_OFFLINE" not in env and server_env["HF_HUB_OFFLINE"]["value"] == "1"
    assert "HF_TOKEN" not in server_env and "SPECSERVE_MODEL_FETCH_HINT" not in server_env
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert mounts["model-cache"] == {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["model-cache"]
    sc = init["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["runAsNonRoot"] and sc["capabilities"]["drop"] == ["ALL"]
    assert 443 in egress_ports(docs)


def test_a_draft_head_by_id_is_fetched_too(render):
    pod, c = server(render(("gpu-eagle3-values.yaml",)))
    (init,) = pod["initContainers"]
    assert init["command"][4:] == ["meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"]
    assert "method.model=yuhuili/EAGLE3-LLaMA3.1-Instruct-8B" in c["args"]
    local = render(sets=("method.name=draft_model", "method.model=/cache/models/draft"))
    assert "initContainers" not in server(local)[0]  # a path is not fetched


def test_offline_fetches_nothing_and_the_error_names_the_key(render):
    docs = render(sets=(*HUB_SETS[:2], "modelCache.offline=true"))
    pod, c = server(docs)
    assert "initContainers" not in pod
    hint = env_of(c)["SPECSERVE_MODEL_FETCH_HINT"]["value"]
    assert hint.startswith("modelCache.offline=true: the chart fetches nothing; set modelCache.offline=false")
    assert 443 not in egress_ports(docs)
    plain_pod, plain = server(render())
    assert "initContainers" not in plain_pod and "SPECSERVE_MODEL_FETCH_HINT" not in env_of(plain)


@pytest.mark.parametrize("bad", ["not an id", "/abs/path", "org/name/extra", "org/name@rev"])
def test_the_schema_refuses_what_is_not_a_hub_id(chart, tmp_path, bad):
    planted = tmp_path / "bad.yaml"
    planted.write_text(yaml.safe_dump({"model": {"hubId": bad}}))
    proc = chart.helm(chart.template_args(values=(str(planted),)), check=False)
    assert proc.returncode != 0 and "hubId" in proc.stderr, proc.stderr
