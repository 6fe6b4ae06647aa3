"""scripts/gpu_smoke.sh's dry run (every check on the CPU, tiny sizes, the kernels' torch
twins), so the GPU smoke test cannot rot between the rare runs on a GPU; and the verdicts
that only a GPU run exercises (a failed check, a kernel fallen back to its twin)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
gpu_smoke = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_smoke)


def test_dry_run_writes_one_passing_report(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SMOL", "OUT")}
    env.update(GPU_SMOKE_DRY="1", OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_smoke.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smoke-dry.json", "smoke-dry.log", "smoke-dry.md"]
    r = json.loads((tmp_path / "smoke-dry.json").read_text())
    assert r["dry_run"] is True and r["ok"] is True
    c = r["checks"]
    assert list(c) == ["long_prefill", "draft_graphs", "startup", "kernel_self_check"]

    lp = c["long_prefill"]
    assert (lp["prompt_tokens"], lp["max_tokens"]) == (160, 6)
    assert lp["prefill_chunks"] == [48, 48, 48, 16]  # chunked by engine.max_num_batched_tokens=48
    assert lp["identical"] is True and "first_difference" not in lp

    d = c["draft_graphs"]
    assert d["outputs_equal"] and d["acceptance_equal"]
    off, auto = d["runs"]["off"], d["runs"]["auto"]
    assert off["tokens"] == auto["tokens"] and len(off["tokens"][0]) == 6
    assert off["accepted"] == off["drafted"] == [6]  # drafting for itself: every draft accepted
    assert off["graphs_captured"] == 0
    assert auto["graphs_captured"] == 4 and auto["draft_graphs_captured"] == 2  # buckets 1, 2 x q 1, K+1; drafter q 1

    s = c["startup"]
    budget = s["after_batch"]["budget"]
    assert budget["parts"]["draft weights"] == budget["parts"]["weights"] > 0  # the model drafts for itself
    assert budget["total_bytes"] == sum(budget["parts"].values()) + budget["kv_bytes"]
    assert s["batch_tokens"] == 4 * 5 and s["after_batch"]["max_memory_allocated"] is None  # no CUDA

    k = c["kernel_self_check"]
    assert k["ok"] is True and k["engines"]["startup"]["rejection_backend"] == "torch"

    md = (tmp_path / "smoke-dry.md").read_text()
    assert md.startswith("GPU smoke (dry run on the CPU): all passed")
    assert md.count("| yes |") == 4


def test_a_failing_check_fails_the_run(tmp_path):
    out = tmp_path / "r.json"
    rc = gpu_smoke.main(["--dry-run", "--in-process", "--checks", "no_such_check", "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == 1 and r["ok"] is False
    assert r["checks"]["no_such_check"] == {"ok": False, "error": "KeyError: 'no_such_check'",
                                            "seconds": r["checks"]["no_such_check"]["seconds"]}
    assert "| NO | KeyError" in out.with_suffix(".md").read_text()


def _engines(attention: str, eager: list) -> dict:
    reason = "" if attention == "triton" else "the Triton kernel failed its start-up check"
    sc = {"attention_backend": attention, "rejection_backend": "triton", "available": True,
          "target_attention": {"key": "engine.attention_backend", "requested": "auto", "used": attention,
                               "reason": reason},
          "target_eager_graph_keys": eager}
    return {"startup": {"ok": True, "self_check": sc}}


@pytest.mark.parametrize("attention, eager, ok", [
    ("triton", [], True),
    ("torch", [], False),  # on CUDA a twin means the kernel's check, compile or launch failed
    ("triton", [[256, 17]], False),  # a graph whose capture failed runs eagerly
])
def test_the_kernel_verdict_on_cuda(attention, eager, ok):
    v = gpu_smoke.kernel_verdict(_engines(attention, eager), cuda=True)
    assert v["ok"] is ok and list(v["engines"]) == ["startup"]


def test_the_kernel_verdict_without_a_self_check():
    assert gpu_smoke.kernel_verdict({"startup": {"ok": True, "self_check": {"available": False}}}, cuda=True) == {
        "ok": None, "detail": "not exposed by this engine"}


def test_without_a_gpu_the_real_run_refuses(capsys):
    if gpu_smoke.torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gpu_smoke.main(["--out", "/nonexistent/x.json"]) == 2
    assert "--dry-run" in capsys.readouterr().out


def test_a_difference_is_reported_with_the_references_top2_gap(monkeypatch):
    """A device path that disagrees (here: its step runner always favours token 0) fails
    the check and names the first differing position and the CPU's margin there."""
    real = gpu_smoke.twin_runner

    def favour_token_0(runner, *args, **kwargs):
        twin = real(runner, *args, **kwargs)
        run = twin.static.run

        def biased(batch, device_token_ids=None):
            res = run(batch, device_token_ids)
            res.logits[:, 0] += 1e4
            return res

        twin.static.run = biased
        return twin

    monkeypatch.setattr(gpu_smoke, "twin_runner", favour_token_0)
    monkeypatch.delenv("GPU_SMOKE_DRY", raising=False)
    args = gpu_smoke.parse_args(["--dry-run", "--prompt-tokens", "40", "--chunk", "16", "--max-tokens", "3"])
    res = gpu_smoke.check_long_prefill(args, cuda=False)
    assert res["ok"] is False and res["identical"] is False and res["prefill_chunks"] == [16, 16, 8]
    d = res["first_difference"]
    assert d["position"] == 0 and d["device_token"] == 0
    assert d["cpu_token"] == d["cpu_top2"][0] != 0 and d["cpu_top2_gap"] > 0
