"""Fixtures for the Helm chart tests (helm/specserve), driven by scripts/helm_gate.sh.

The tests shell out to the pinned helm under .tools/bin (installed by the gate). They skip,
with the reason, only when that tools directory is absent AND SPECSERVE_HELM_GATE is unset;
under the gate (SPECSERVE_HELM_GATE=1) a missing tool is a failure, never a skip.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "specserve"
CI_DIR = CHART / "ci"
TOOLS = Path(os.environ.get("SPECSERVE_TOOLS_DIR", ROOT / ".tools"))
HELM = Path(os.environ.get("SPECSERVE_HELM", TOOLS / "bin" / "helm"))
IN_GATE = bool(os.environ.get("SPECSERVE_HELM_GATE"))

# Pinned render settings, the same as the gate's golden renders.
RELEASE = "specserve"
NAMESPACE = "specserve"
KUBE_VERSION = "1.31.0"
SERVICEMONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"
KEDA_API = "keda.sh/v1alpha1/ScaledObject"
LWS_API = "leaderworkerset.x-k8s.io/v1/LeaderWorkerSet"
INFERENCEPOOL_API = "inference.networking.k8s.io/v1/InferencePool"
ALL_CRD_APIS = (SERVICEMONITOR_API, KEDA_API, LWS_API, INFERENCEPOOL_API)
CI_FILES = ("cpu-values.yaml", "gpu-eagle3-values.yaml", "tp-values.yaml")
# The chart refuses to render without image.repository: renders name this stand-in first (a
# values file of the test's own, later, wins), as the gate's golden renders do.
IMAGE_VALUES = str(Path(__file__).resolve().parent / "image-values.yaml")


def pytest_collection_modifyitems(config, items):
    if TOOLS.is_dir() or IN_GATE:
        return
    skip = pytest.mark.skip(
        reason=f"Helm chart tests need the gate's pinned tools in {TOOLS} (absent) and "
        "SPECSERVE_HELM_GATE is unset: run scripts/helm_gate.sh"
    )
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    if not (HELM.is_file() and os.access(HELM, os.X_OK)):
        pytest.fail(f"helm not found at {HELM}: run scripts/helm_gate.sh (or scripts/helm/install_tools.sh)")
    return HELM


class HelmError(Exception):
    def __init__(self, cmd: list[str], rc: int, stderr: str):
        super().__init__(f"{' '.join(cmd)} -> rc={rc}\n{stderr}")
        self.rc, self.stderr = rc, stderr


def run_helm(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        # Keep helm off the user's config/cache: nothing here may touch the network.
        "HELM_CACHE_HOME": str(TOOLS / "helm-home" / "cache"),
        "HELM_CONFIG_HOME": str(TOOLS / "helm-home" / "config"),
        "HELM_DATA_HOME": str(TOOLS / "helm-home" / "data"),
    }
    cmd = [str(HELM), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    if check and proc.returncode != 0:
        raise HelmError(cmd, proc.returncode, proc.stderr)
    return proc


def template_args(
    values: tuple[str, ...] = (),
    sets: tuple[str, ...] = (),
    api_versions: tuple[str, ...] = ALL_CRD_APIS,
    kube_version: str = KUBE_VERSION,
) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version", kube_version]
    for a in api_versions:
        args += ["--api-versions", a]
    for v in (IMAGE_VALUES, *values):
        args += ["-f", v]
    for s in sets:
        args += ["--set", s]
    return args


@functools.lru_cache(maxsize=64)
def _render_cached(values, sets, api_versions, kube_version) -> tuple:
    import yaml

    out = run_helm(template_args(values, sets, api_versions, kube_version)).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


class Chart:
    """What the tests need, handed out as a fixture (tests never import this conftest)."""

    root = ROOT
    path = CHART
    ci_dir = CI_DIR
    tools = TOOLS
    release = RELEASE
    namespace = NAMESPACE
    kube_version = KUBE_VERSION
    servicemonitor_api = SERVICEMONITOR_API
    keda_api = KEDA_API
    inferencepool_api = INFERENCEPOOL_API
    all_crd_apis = ALL_CRD_APIS
    ci_files = CI_FILES
    image_values = IMAGE_VALUES
    HelmError = HelmError

    def __init__(self, render):
        self.render = render

    @staticmethod
    def helm(args: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return run_helm(args, check=check)

    @staticmethod
    def template_args(*a, **kw) -> list[str]:
        return template_args(*a, **kw)


@pytest.fixture(scope="session")
def chart(render) -> Chart:
    return Chart(render)


@pytest.fixture(scope="session")
def render(helm_bin):
    """render(values=("ci/x.yaml",), sets=("a=b",), api_versions=(...)) -> list of objects."""

    def _render(values=(), sets=(), api_versions=ALL_CRD_APIS, kube_version=KUBE_VERSION):
        values = tuple(str(CI_DIR / v) if not os.path.isabs(v) else v for v in values)
        import copy

        return copy.deepcopy(list(_render_cached(values, tuple(sets), tuple(api_versions), kube_version)))

    return _render
