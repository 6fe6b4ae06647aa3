"""The docs' install lines, checked as printed: every ```bash block marked
``<!-- helm-gate: ... -->`` in the given Markdown files is read line by line, and

* each ``helm install RELEASE CHART ARGS`` is rendered with exactly those ARGS
  (``helm template RELEASE CHART ARGS --kube-version K``) and written to --out for the
  gate's schema validation and CLI-compose steps;
* every image the render pulls was built in the same block (``docker build -t``) and
  loaded into kind or pushed (``kind load docker-image`` / ``docker push``): one name end
  to end;
* every Secret the render reads (``secretKeyRef``) is created in the block, in the
  release's namespace, with that key (``kubectl create secret generic NAME
  --from-literal=KEY=...``), and the namespace exists (``kubectl create namespace`` or
  ``--create-namespace``);
* ``VAR=value`` lines define variables used later as ``$VAR`` / ``${VAR}``.

And the chart without an image (its defaults) must refuse to render, naming
image.repository and docs/deploy.md.

    python scripts/helm/quickstart_check.py --helm HELM --out DIR --kube-version 1.31.0 README.md docs/deploy.md
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

BLOCK = re.compile(r"<!-- helm-gate: ([^>]*?) -->\s*\n```bash\n(.*?)```", re.DOTALL)
VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def commands(text: str) -> list[list[str]]:
    """The block's commands as argv lists: continuation lines joined, comments dropped,
    ``VAR=value`` assignments applied to later lines."""
    joined = re.sub(r"\\\n\s*", " ", text)
    env: dict[str, str] = {}
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if len(words) == 1 and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            name, value = words[0].split("=", 1)
            env[name] = value
            continue
        out.append([VAR.sub(lambda m: env.get(m.group(1), m.group(0)), w) for w in words])
    return out


def option(argv: list[str], *names: str) -> str | None:
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def pod_specs(docs: list[dict]) -> list[dict]:
    specs = []
    for d in docs:
        spec = d.get("spec") or {}
        if d.get("kind") in ("Deployment", "StatefulSet", "DaemonSet"):
            specs.append(spec["template"]["spec"])
        elif d.get("kind") == "Pod":
            specs.append(spec)
    return specs


def check_block(where: str, text: str, helm: str, kube_version: str, out: Path, root: Path) -> list[str]:
    problems: list[str] = []
    built, shipped, namespaces = set(), set(), set()
    secrets: dict[tuple[str, str], set[str]] = {}
    installs = 0
    for argv in commands(text):
        if argv[:2] == ["docker", "build"]:
            tag = option(argv, "-t", "--tag")
            if tag:
                built.add(tag)
        elif argv[:3] == ["kind", "load", "docker-image"]:
            shipped.update(a for a in argv[3:] if not a.startswith("-") and a != option(argv, "--name"))
        elif argv[:2] == ["docker", "push"]:
            shipped.add(argv[2])
        elif argv[0] == "kubectl" and "create" in argv:
            ns = option(argv, "-n", "--namespace") or "default"
            rest = argv[argv.index("create") + 1:]
            if rest[:1] == ["namespace"]:
                namespaces.add(rest[1])
            elif rest[:2] == ["secret", "generic"]:
                keys = {a.split("=", 2)[1] for a in rest if a.startswith("--from-literal=")}
                keys |= {rest[i + 1].split("=", 1)[0] for i, a in enumerate(rest) if a == "--from-literal"}
                secrets.setdefault((ns, rest[2]), set()).update(keys)
        elif argv[:2] == ["helm", "install"]:
            installs += 1
            release, chart, args = argv[2], argv[3], argv[4:]
            ns = option(args, "-n", "--namespace") or "default"
            if ns != "default" and ns not in namespaces and "--create-namespace" not in args:
                problems.append(f"{where}: namespace {ns} is neither created before `helm install` nor --create-namespace")
            namespaces.add(ns)
            cmd = [helm, "template", release, chart, *args, "--kube-version", kube_version]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
            if proc.returncode != 0:
                problems.append(f"{where}: `{shlex.join(argv)}` does not render: {proc.stderr.strip()[:600]}")
                continue
            name = re.sub(r"[^A-Za-z0-9]+", "-", f"{where}-{installs}").strip("-").lower()
            (out / f"quickstart-{name}.yaml").write_text(proc.stdout)
            docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
            for spec in pod_specs(docs):
                for c in spec.get("initContainers", []) + spec.get("containers", []):
                    image = c["image"]
                    if image not in built:
                        problems.append(f"{where}: the render pulls {image}, which no `docker build -t` line of the "
                                        f"block makes (built: {', '.join(sorted(built)) or 'none'})")
                    elif image not in shipped:
                        problems.append(f"{where}: {image} is built but neither loaded into kind nor pushed")
                    for env in c.get("env", []):
                        ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                        if ref and not ref.get("optional"):
                            have = secrets.get((ns, ref["name"]))
                            if have is None or ref["key"] not in have:
                                problems.append(f"{where}: the pod reads Secret {ns}/{ref['name']} key {ref['key']}, "
                                                "which the block does not create before `helm install`")
            print(f"OK {where}: `{shlex.join(argv)}` renders {len(docs)} objects; images "
                  f"{sorted({c['image'] for s in pod_specs(docs) for c in s.get('containers', [])})}")
    if not installs:
        problems.append(f"{where}: the block has no `helm install` line")
    return problems


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--helm", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kube-version", default="1.31.0")
    ap.add_argument("--chart", default="helm/specserve")
    ap.add_argument("docs", nargs="+")
    a = ap.parse_args(argv)
    root = Path.cwd()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    blocks = 0
    for doc in a.docs:
        for m in BLOCK.finditer(Path(doc).read_text()):
            blocks += 1
            problems += check_block(f"{doc} ({m.group(1).strip()})", m.group(2), a.helm, a.kube_version, out, root)
    if blocks == 0:
        problems.append(f"no <!-- helm-gate: ... --> block in {', '.join(a.docs)}")
    # The placeholder image: the chart's defaults must not render.
    proc = subprocess.run([a.helm, "template", "specserve", a.chart, "--kube-version", a.kube_version],
                          capture_output=True, text=True, cwd=root, env={**os.environ})  # fmt: skip
    if proc.returncode == 0 or "image.repository is required" not in proc.stderr or "docs/deploy.md" not in proc.stderr:
        problems.append(f"the chart renders without image.repository (rc={proc.returncode}): it must refuse, "
                        f"naming image.repository and docs/deploy.md; stderr: {proc.stderr.strip()[:300]}")
    else:
        said = next(line for line in proc.stderr.splitlines() if "image.repository is required" in line)
        print(f"OK the chart without image.repository refuses to render: {said.strip()[:200]}")
    for p in problems:
        print(f"FAIL {p}")
    print(f"quickstart: {blocks} block(s), {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
