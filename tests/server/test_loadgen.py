"""specserve-loadgen against a live fake-engine server: a short mixed run, and the loopback guard.

The runs are made independent of the machine's speed: each client makes a fixed number of
requests (``fixed_load``; its seeded choices then fix the mix), and a request the client
will cancel is held mid-stream until the cancel arrives."""

from __future__ import annotations

import contextvars
import json
import time

import pytest
from fake_engine import FakeEngine, FakeTokenizer, expected_text
from server_testutil import wait_for

from specserve import loadgen

TOK = FakeTokenizer()
CANCEL_TAG = "cancel me: "  # prefixed to the prompts of the requests a client will cancel
_made = contextvars.ContextVar("requests_made_by_this_client", default=0)


class _Clock:
    """loadgen's ``time``: the real one, except that a client's deadline has passed once it
    has made ``per_client`` requests.  Each client is an asyncio task with its own context,
    and its count rises only after a request is done, so no request's timings are skewed."""

    def __init__(self, per_client: int):
        self.per_client = per_client

    def __getattr__(self, name: str):
        return getattr(time, name)

    def perf_counter(self) -> float:
        return time.perf_counter() + (1e9 if _made.get() >= self.per_client else 0.0)


@pytest.fixture
def fixed_load(monkeypatch):
    """Each loadgen client makes exactly ``fixed_load.per_client`` requests (``--duration-s`` is
    only a safety net), and the prompts of those it cancels start with CANCEL_TAG."""
    clock = _Clock(per_client=20)
    monkeypatch.setattr(loadgen, "time", clock)
    for cls in (loadgen.GrpcClient, loadgen.HttpClient):

        async def run(self, prompt, mode, rng, n, _real=cls.run):
            try:
                return await _real(self, CANCEL_TAG + prompt if mode == "cancel" else prompt, mode, rng, n)
            finally:
                _made.set(_made.get() + 1)

        monkeypatch.setattr(cls, "run", run)
    return clock


def hold_until_cancelled(prompt_ids: list[int], step: int) -> bool:
    """A FakeEngine stall: a request to be cancelled stops after 3 steps (the client cancels after
    1 to 3 chunks), so it is still running when the cancel arrives."""
    return step >= 3 and TOK.decode(prompt_ids).startswith(CANCEL_TAG)


def test_short_mixed_run_reports_no_unexpected_errors(make_served, tmp_path, fixed_load):
    engine = FakeEngine(step_delay_s=0.003)
    engine.stall = hold_until_cancelled
    s = make_served(engine)
    reference = {p: expected_text(TOK.encode(p), 12) for p in loadgen.BUILTIN_PROMPTS}
    (tmp_path / "ref.json").write_text(json.dumps(reference))
    out = tmp_path / "report.json"
    rc = loadgen.main([
        "--grpc-target", f"127.0.0.1:{s.handle.grpc_port}", "--http-url", f"http://localhost:{s.handle.http_port}",
        "--clients", "4", "--duration-s", "120", "--cancel-fraction", "0.2", "--bad-fraction", "0.2",
        "--max-tokens", "12", "--reference", str(tmp_path / "ref.json"), "--output", str(out),
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0, report["errors"]
    assert report["errors"]["unexpected"] == {}
    assert set(report["requests"]["by_protocol"]) == {"grpc", "http"}
    assert report["requests"]["ok"] > 0 and report["mismatches"]["checked"] > 0 and report["mismatches"]["count"] == 0
    assert report["requests"]["total"] == 4 * fixed_load.per_client
    # Every cancel reaches the engine as an abort (the request was held until it came).
    cancelled = report["requests"]["cancelled"]
    assert cancelled > 0 and wait_for(lambda: len(engine.aborted) == cancelled), (engine.aborted, cancelled)
    expected = report["errors"]["expected"]
    assert expected.get("grpc:invalid_argument", 0) + expected.get("http:invalid_argument", 0) > 0
    assert report["ttft_s"]["p50"] is not None and report["itl_s"]["p99"] is not None
    assert report["tokens_per_s"] > 0
    assert report["after_run"] == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0}


def test_hostile_requests_complete_and_new_bad_inputs_are_refused(make_served, tmp_path, fixed_load):
    """Valid but adversarial requests (a forced-token stream, control tokens in chat content,
    json_schema with n=2, seeded sampling) complete; the bad inputs (gzip label on a plain
    body, an 8 KB model name, a 1 MB request id, bytes that are not protobuf) are refused."""
    s = make_served(FakeEngine(step_delay_s=0.001))
    out = tmp_path / "r.json"
    rc = loadgen.main([
        "--grpc-target", f"127.0.0.1:{s.handle.grpc_port}", "--http-url", f"http://localhost:{s.handle.http_port}",
        "--clients", "2", "--duration-s", "120", "--cancel-fraction", "0", "--bad-fraction", "0.5",
        "--hostile-fraction", "0.5", "--hostile-token-id", "7", "--max-tokens", "6", "--output", str(out),
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0, report["errors"]
    assert report["lost"]["count"] == 0 and report["requests"]["ok"] > 0
    assert set(report["finish_reasons"]) <= {"stop", "length", "None"}  # None: refused bad input


def test_a_wrong_reference_is_a_mismatch(make_served, tmp_path, fixed_load):
    fixed_load.per_client = 2
    s = make_served(FakeEngine(step_delay_s=0.001))
    (tmp_path / "ref.json").write_text(json.dumps({p: "definitely not this" for p in loadgen.BUILTIN_PROMPTS}))
    rc = loadgen.main(["--grpc-target", f"127.0.0.1:{s.handle.grpc_port}", "--clients", "1", "--duration-s", "120",
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


@pytest.mark.parametrize("extra, words", [
    (["--output", "/nonexistent-dir/report.json"], "--output /nonexistent-dir/report.json: cannot write"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file /nonexistent/prompts.txt: no such file"),
    (["--reference", "/nonexistent/ref.json"], "--reference /nonexistent/ref.json: no such file"),
    (["--ca-file", "/nonexistent/ca.pem"], "--ca-file /nonexistent/ca.pem: no such file"),
    (["--temperature", "-1"], "--temperature must be in [0, 2]"),
    (["--temperature", "nan"], "--temperature must be in [0, 2]"),
    (["--request-timeout-s", "-5"], "--request-timeout-s must be in (0, 86400]"),
])  # fmt: skip
def test_bad_arguments_are_one_line_before_any_load(extra, words, capsys):
    """Each is refused up front (exit 2, one line): a bad --output used to end a finished run
    in a traceback, its results lost."""
    with pytest.raises(SystemExit) as e:
        loadgen.main(["--http-url", "http://127.0.0.1:9", "--duration-s", "1", *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert words in err[-1] and "Traceback" not in "\n".join(err)


def test_unreadable_reference_and_ca_files_are_one_line(tmp_path, capsys):
    bad_json, not_pem = tmp_path / "ref.json", tmp_path / "ca.pem"
    bad_json.write_text("{not json")
    not_pem.write_text("hello")
    for flag, path, words in (("--reference", bad_json, "not valid JSON"), ("--ca-file", not_pem, "not a PEM")):
        with pytest.raises(SystemExit) as e:
            loadgen.main(["--http-url", "http://127.0.0.1:9", "--duration-s", "1", flag, str(path)])
        assert e.value.code == 2 and words in capsys.readouterr().err
