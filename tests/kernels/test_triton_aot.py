"""Every Triton binary the engine launches, compiled ahead of time for sm_80 and sm_90 with
Triton's bundled ptxas, no GPU needed: ``scripts/triton_aot_report.py`` in a subprocess (no
TRITON_INTERPRET, a fresh Triton cache) for the shipped presets -- SmolLM2-135M in bf16, a
Llama-3.1-8B-shaped config in bf16 and fp16, their EAGLE heads' draft graphs and the
rejection kernel -- must compile every binary, spill nowhere in attention, stay within each
GPU's shared memory per block, and keep each (preset, dtype) under 40 attention binaries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from specserve.kernels import aot  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


def test_every_binary_compiles_for_sm80_and_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(REPO / "scripts" / "triton_aot_report.py"), "--out", str(tmp_path),
           "--dtype", "bfloat16", "--dtype", "float16", "--workers", "2"]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=560)
    report = json.loads((tmp_path / "report.json").read_text()) if (tmp_path / "report.json").exists() else None
    assert report is not None, res.stdout[-2000:] + res.stderr[-4000:]
    assert report["violations"] == [], "\n".join(report["violations"])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = report["rows"]
    # every preset and dtype asked for, both GPUs, and every kernel of the data path
    seen = {(r["preset"], r["dtype"], r["arch"], r["group"], r["kernel"]) for r in rows}
    for preset, dtype in (("smollm2-135m", "bfloat16"), ("llama-3.1-8b", "bfloat16"), ("llama-3.1-8b", "float16")):
        for arch in aot.ARCHS:
            for group in ("runner", "head"):
                for kernel in ("attn_kernel", "write_kv_kernel", "reduce_kernel"):
                    assert (preset, dtype, arch, group, kernel) in seen, (preset, dtype, arch, group, kernel)
            assert 5 <= report["attention_binaries"][f"{preset} {dtype} {arch}"] <= aot.MAX_ATTENTION_BINARIES
    rejection = {(r["arch"], r["detail"]) for r in rows if r["kernel"] == "rejection_kernel"}
    assert len(rejection) == 3 * len(aot.ARCHS)  # strict; probabilistic with and without q
    for r in rows:  # the report's figures are ptxas's, not defaults
        assert r["error"] == "" and r["registers"] > 0 and r["shared_bytes"] <= r["shared_limit"]
        if r["kernel"] == "attn_kernel":
            assert r["spill_stores"] == r["spill_loads"] == 0 and r["shared_bytes"] > 0
    assert (tmp_path / "README.md").read_text().count("| llama-3.1-8b | float16 | sm_80 |") >= 3


def test_violations_name_each_limit():
    row = dict(preset="p", dtype="bfloat16", arch="sm_80", group="runner", kernel="attn_kernel", detail="d",
               registers=255, spill_stores=0, spill_loads=0, shared_bytes=1024, shared_limit=163 * 1024, error="",
               binary="a")
    assert aot.violations([row]) == []
    assert "spills 16 B" in aot.violations([dict(row, spill_stores=16)])[0]
    assert "shared memory" in aot.violations([dict(row, shared_bytes=200 * 1024)])[0]
    assert "does not compile" in aot.violations([dict(row, error="PTXASError: boom")])[0]
    assert aot.violations([dict(row, group="rejection", kernel="rejection_kernel", spill_stores=8)]) == []
    many = [dict(row, binary=str(i)) for i in range(aot.MAX_ATTENTION_BINARIES + 1)]
    assert aot.violations(many) == [f"p bfloat16 sm_80: {aot.MAX_ATTENTION_BINARIES + 1} attention binaries > 40"]
