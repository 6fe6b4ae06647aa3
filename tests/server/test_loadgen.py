"""specserve-loadgen against a live fake-engine server: a short mixed run, and the loopback guard."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine, FakeTokenizer, expected_text

from specserve import loadgen


def test_short_mixed_run_reports_no_unexpected_errors(make_served, tmp_path):
    engine = FakeEngine(step_delay_s=0.003)
    s = make_served(engine)
    tok = FakeTokenizer()
    reference = {p: expected_text(tok.encode(p), 12) for p in loadgen.BUILTIN_PROMPTS}
    (tmp_path / "ref.json").write_text(json.dumps(reference))
    out = tmp_path / "report.json"
    rc = loadgen.main([
        "--grpc-target", f"127.0.0.1:{s.handle.grpc_port}", "--http-url", f"http://localhost:{s.handle.http_port}",
        "--clients", "4", "--duration-s", "1.5", "--cancel-fraction", "0.2", "--bad-fraction", "0.2",
        "--max-tokens", "12", "--reference", str(tmp_path / "ref.json"), "--output", str(out),
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0, report["errors"]
    assert report["errors"]["unexpected"] == {}
    assert set(report["requests"]["by_protocol"]) == {"grpc", "http"}
    assert report["requests"]["ok"] > 0 and report["mismatches"]["checked"] > 0 and report["mismatches"]["count"] == 0
    # A cancel can race the last step, so the engine may see a few less aborts than cancels.
    assert report["requests"]["cancelled"] > 0 and 0 < len(engine.aborted) <= report["requests"]["cancelled"]
    expected = report["errors"]["expected"]
    assert expected.get("grpc:invalid_argument", 0) + expected.get("http:invalid_argument", 0) > 0
    assert report["ttft_s"]["p50"] is not None and report["itl_s"]["p99"] is not None
    assert report["tokens_per_s"] > 0
    assert report["after_run"] == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0}


def test_a_wrong_reference_is_a_mismatch(make_served, tmp_path):
    s = make_served(FakeEngine(step_delay_s=0.001))
    (tmp_path / "ref.json").write_text(json.dumps({p: "definitely not this" for p in loadgen.BUILTIN_PROMPTS}))
    rc = loadgen.main(["--grpc-target", f"127.0.0.1:{s.handle.grpc_port}", "--clients", "1", "--duration-s", "0.3",
                       "--cancel-fraction", "0", "--bad-fraction", "0", "--reference", str(tmp_path / "ref.json"),
                       "--output", str(tmp_path / "r.json")])  # fmt: skip
    assert rc == 1
    assert json.loads((tmp_path / "r.json").read_text())["mismatches"]["count"] > 0


@pytest.mark.parametrize("flag,target", [("--grpc-target", "8.8.8.8:50051"), ("--http-url", "http://10.1.2.3:8000")])
def test_refuses_non_loopback_targets(flag, target, capsys):
    with pytest.raises(SystemExit) as exc:
        loadgen.main([flag, target, "--duration-s", "1"])
    assert exc.value.code == 2
    assert "loopback" in capsys.readouterr().err
