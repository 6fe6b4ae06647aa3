"""Contract check: the chart's rendered command line composes with the real `specserve` CLI.

    PYTHON_WITH_SPECSERVE scripts/helm/cli_compose_check.py RENDERED.yaml ...

For each render: take the Deployment's container args, write the rendered ConfigMap's group
presets to a temporary directory laid out as the pod sees it (<group>/<name>.yaml), point
--config-dir there, and run specserve.cli.compose_config (Hydra compose + OmegaConf schema +
validate_config; no model is loaded). This catches drift between the chart and the CLI
(e.g. `draft=` vs `+draft=`, a renamed key, a preset the schema rejects).

Models by Hugging Face id: the ids the pod's init container fetches (``python -m specserve.hub
fetch ID ...``) are laid out as stub snapshots in a temporary hub cache (HF_HOME), as the pod's
cache holds them once that container has run, so an id the server asks for that the init
container does not fetch fails here (the server would find it missing and exit).

A method whose built-in preset is not shipped yet, or a method/parallelism that this build
does not implement yet (a valid contract value the engine rejects for now), is a WARN (the chart may select every method of the contract); any other
error is a FAIL. Needs a Python where `specserve` and `hydra` import (the project venv).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile
from pathlib import Path

import yaml

PENDING = (
    re.compile(r"Could not find 'method/"),
    re.compile(r"method: unknown preset "),
    re.compile(r"is not implemented in this build yet"),
    re.compile(r"is not available in this build"),
)


def fetched(pod: dict) -> list[str]:
    """The Hugging Face ids the pod's init container fetches (``... specserve.hub fetch ID ...``)."""
    out = []
    for c in pod["spec"].get("initContainers", []):
        cmd = list(c.get("command", [])) + list(c.get("args", []))
        if "specserve.hub" in cmd and "fetch" in cmd:
            out += cmd[cmd.index("fetch") + 1:]
    return out


def stub_snapshot(hub: Path, spec: str) -> None:
    """``org/name[@revision]`` as huggingface_hub lays it out (refs/<rev> -> snapshots/<commit>),
    with a minimal config.json."""
    repo, _, revision = spec.partition("@")
    revision = revision or "main"
    commit = revision if re.fullmatch(r"[0-9a-f]{40}", revision) else "0" * 40
    root = hub / ("models--" + repo.replace("/", "--"))
    (root / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    (root / "snapshots" / commit / "config.json").write_text("{}")
    if commit != revision:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / revision).write_text(commit)


def check(render: Path) -> tuple[str, str]:
    from specserve.cli import compose_config

    docs = [d for d in yaml.safe_load_all(render.read_text()) if d]
    # The server pod: the Deployment's, or (multi-node) the LeaderWorkerSet's leader (rank 0).
    pods = [d["spec"]["template"] for d in docs if d["kind"] == "Deployment"]
    pods += [d["spec"]["leaderWorkerTemplate"]["leaderTemplate"] for d in docs if d["kind"] == "LeaderWorkerSet"]
    pods = [p for p in pods if any(c["name"] == "specserve" for c in p["spec"]["containers"])]  # not the EPP's
    (pod,) = pods
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "specserve"]
    args = list(c["args"])
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config")]
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "config")
    with tempfile.TemporaryDirectory() as tmp:
        for item in vol["configMap"]["items"]:
            p = Path(tmp) / item["path"]
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(cm["data"][item["key"]])
        args[args.index("--config-dir") + 1] = tmp
        env = {e["name"]: e.get("value") for e in c.get("env", []) if "value" in e}
        if "HF_HOME" in env:  # the pod's cache, holding what the init container fetched
            env["HF_HOME"] = str(Path(tmp) / "hf-home")
            env.pop("HF_HUB_CACHE", None)
            for spec in fetched(pod):
                stub_snapshot(Path(env["HF_HOME"]) / "hub", spec)
        old = {k: os.environ.get(k) for k in env}
        os.environ.update({k: v for k, v in env.items() if v is not None})
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                cfg = compose_config(args)
        except Exception as e:  # UsageError / SpecServeError: one line each
            msg = f"{type(e).__name__}: {e}"
            if any(p.search(str(e)) for p in PENDING):
                return "WARN", msg
            return "FAIL", msg
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    tp = cfg.parallelism.tensor_parallel_size
    method = cfg.method.method if cfg.method else None
    k = cfg.method.num_speculative_tokens if cfg.method else None
    return "OK", (f"model={cfg.model.name} method={method} K={k} draft={cfg.draft.name if cfg.draft else None} "
                  f"tp={tp} device={cfg.engine.device} grpc={cfg.server.grpc_port} http={cfg.server.http_port}")


def main(argv: list[str]) -> int:
    try:
        import hydra  # noqa: F401
        import specserve.cli  # noqa: F401
    except ImportError as e:
        print(f"SKIP cli-compose: this Python cannot import specserve/hydra ({e})")
        return 3
    counts = {"OK": 0, "WARN": 0, "FAIL": 0}
    for f in map(Path, argv):
        status, detail = check(f)
        print(f"{status} {f.name}: {detail}")
        counts[status] += 1
    print(f"cli-compose: {counts['OK']} OK, {counts['WARN']} WARN (valid values this build does not serve yet), "
          f"{counts['FAIL']} FAIL")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
