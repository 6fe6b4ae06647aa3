"""A server that says what it is doing, on loopback around the FakeEngine:

* the start-up line names the method, K, dtype, device, the kernels' backends and both ports;
* every ``server.log_stats_interval_s`` (shortened here) one stats line in vLLM's words, whose
  acceptance figures, summed over lines, equal what ``/metrics`` says;
* ``/metrics`` has no ``*_created`` series; ``server.metric_names`` picks both/vllm/specserve;
* ``server.log_requests=false`` (``--disable-log-requests``) leaves no access line;
* an unknown request field is logged once per name and named in a response header, or
  refused (400 naming it, with the closest field) under ``server.strict_fields``;
* the model's generation_config.json fills the fields a request leaves out;
* ``server.max_logprobs`` (``--max-logprobs``) caps top log-probabilities.
"""

from __future__ import annotations

import logging
import re
import threading

import pytest
from fake_engine import FakeEngine, ModelInfo
from server_testutil import http_call, scrape, wait_for

from specserve.metrics import VLLM_NAMES

pytestmark = pytest.mark.timeout(60)


class Lines(logging.Handler):
    """Every record of one logger, as text (thread-safe)."""

    def __init__(self, name: str, level: int = logging.DEBUG):
        super().__init__(level)
        self.records: list[logging.LogRecord] = []
        self._lock2 = threading.Lock()
        self.logger = logging.getLogger(name)
        self._old = self.logger.level

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock2:
            self.records.append(record)

    def texts(self, level: int = logging.DEBUG) -> list[str]:
        with self._lock2:
            return [r.getMessage() for r in self.records if r.levelno >= level]

    def __enter__(self) -> "Lines":
        self.logger.addHandler(self)
        self.logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._old)


def complete(served, prompt: str = "hello there", **kw):
    return served.openai().completions.create(model="fake-model", prompt=prompt, **{"max_tokens": 12, **kw})


# --------------------------------------------------------------------------- start-up and stats


def test_the_start_up_line_names_method_k_dtype_backends_and_ports(make_served):
    with Lines("specserve.server") as lines:
        s = make_served(FakeEngine(ModelInfo(method="eagle3", num_speculative_tokens=4, dtype="bfloat16")))
    line = next(t for t in lines.texts(logging.INFO) if t.startswith("serving fake-model:"))
    assert "method eagle3, K=4" in line and "dtype bfloat16 on cpu" in line
    assert f"gRPC on 127.0.0.1:{s.handle.grpc_port}" in line and f"HTTP on http://127.0.0.1:{s.handle.http_port}" in line
    assert "API key off" in line


def test_the_start_up_line_of_a_real_engines_info_names_its_backends():
    from specserve.engine.engine import ModelInfo as RealInfo
    from specserve.server.stats_log import startup_line

    info = RealInfo(model_name="m", method="ngram", num_speculative_tokens=3, max_model_len=64, dtype="float32",
                    device="cpu", lossless=True, attention_backend="torch", rejection_backend="triton",
                    sampling_defaults={"temperature": 0.6, "top_k": 20})  # fmt: skip
    line = startup_line(info, "0.0.0.0", 50051, 8000, False, True)
    assert line == ("serving m: method ngram, K=3, request defaults from generation_config.json: temperature=0.6, "
                    "top_k=20, dtype float32 on cpu, attention torch, rejection triton, tensor parallel 1; "
                    "gRPC on 0.0.0.0:50051, HTTP on http://0.0.0.0:8000, API key required")


STATS = re.compile(r"Accepted: (\d+) tokens, Drafted: (\d+) tokens, Drafts: (\d+), "
                   r"Per-position acceptance rate: ([0-9., ]+), Avg Draft")


def test_stats_lines_come_every_interval_and_add_up_to_the_metrics(make_served):
    engine = FakeEngine(ModelInfo(num_speculative_tokens=3), accept_pattern=(2, 0, 3, 1))
    with Lines("specserve.stats") as lines:
        s = make_served(engine, log_stats_interval_s=0.2)
        for prompt in ("abc", "hello world", "x"):
            complete(s, prompt, max_tokens=20)
        m = scrape(s.http)
        done = len(lines.texts())
        # The lines after the last request: the counts are all in by then (two intervals at most).
        assert wait_for(lambda: len(lines.texts()) >= done + 2)
        texts = lines.texts()
    assert all(t.startswith("Avg prompt throughput: ") and "Running: " in t and "KV cache usage: " in t for t in texts)
    spec = [STATS.search(t) for t in texts if "SpecDecoding metrics" in t]
    assert spec and all(spec)
    accepted = sum(int(g.group(1)) for g in spec)
    drafted = sum(int(g.group(2)) for g in spec)
    drafts = sum(int(g.group(3)) for g in spec)
    labels = {"model_name": "fake-model", "method": "ngram"}

    def metric(name, **extra):
        return sum(v for k, v in m[name].items() if all((a, b) in k for a, b in {**labels, **extra}.items()))

    assert accepted == metric("specserve_spec_decode_num_accepted_tokens_total")
    assert drafted == metric("specserve_spec_decode_num_draft_tokens_total")
    assert drafts == metric("specserve_spec_decode_num_drafts_total") > 0
    # per position: rate x drafts of each line, summed, is the per-position counter
    per_pos = [0.0] * 3
    for g in spec:
        for p, rate in enumerate(g.group(4).split(", ")):
            per_pos[p] += float(rate) * int(g.group(3))
    for p in range(3):
        assert round(per_pos[p]) == metric("specserve_spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
    # the mean acceptance length each line prints is 1 + its accepted / its drafts
    for t, g in zip([t for t in texts if "SpecDecoding" in t], spec):
        assert f"Mean acceptance length: {1 + int(g.group(1)) / int(g.group(3)):.2f}," in t


def test_idle_intervals_drop_to_debug_and_zero_turns_the_line_off(make_served):
    with Lines("specserve.stats") as lines:
        make_served(FakeEngine(), log_stats_interval_s=0.05)
        assert wait_for(lambda: len(lines.texts()) >= 3)
        assert len(lines.texts(logging.INFO)) == 1  # the first; then idle after idle is DEBUG
    off = make_served(FakeEngine(), log_stats_interval_s=0)
    assert off.handle.servers.stats_log is None and off.handle.servers._stats_task is None


# --------------------------------------------------------------------------- /metrics names


def test_metrics_have_no_created_series_and_names_follow_metric_names(make_served):
    both = make_served(FakeEngine())
    complete(both)
    status, text = http_call(f"{both.http}/metrics")
    assert status == 200 and "_created" not in text
    m = scrape(both.http)
    assert "specserve_generation_tokens_total" in m and "vllm:generation_tokens_total" in m

    only_vllm = make_served(FakeEngine(), metric_names="vllm")
    complete(only_vllm)
    m = scrape(only_vllm.http)
    assert "vllm:generation_tokens_total" in m and "specserve_generation_tokens_total" not in m
    assert "vllm:spec_decode_num_drafts_total" in m and "specserve_spec_decode_num_drafts_total" not in m
    assert "specserve_spec_decode_acceptance_length_bucket" in m  # no vLLM name: kept
    twinned = [n for n in m if n.startswith("specserve_") and re.sub(r"_(total|bucket|sum|count)$", "", n) in VLLM_NAMES]
    assert twinned == []

    only_ours = make_served(FakeEngine(), metric_names="specserve")
    complete(only_ours)
    m = scrape(only_ours.http)
    assert not [n for n in m if n.startswith("vllm:")] and "specserve_generation_tokens_total" in m
    lines = http_call(f"{only_ours.http}/metrics")[1].count("\n")
    assert lines < http_call(f"{both.http}/metrics")[1].count("\n")


# --------------------------------------------------------------------------- request logging


def test_disable_log_requests_leaves_no_access_line(make_served):
    with Lines("specserve.server.access") as lines:
        on = make_served(FakeEngine())
        complete(on)
        assert wait_for(lambda: any("POST /v1/completions" in t for t in lines.texts()))
        before = len(lines.texts())
        off = make_served(FakeEngine(), log_requests=False)
        complete(off)
        http_call(f"{off.http}/health?from-the-quiet-server")
        http_call(f"{on.http}/health?from-the-logging-server")
        assert wait_for(lambda: any("from-the-logging-server" in t for t in lines.texts()))
    assert len(lines.texts()) == before + 1 and not any("quiet" in t for t in lines.texts())


# --------------------------------------------------------------------------- unknown fields


def test_an_unknown_field_is_logged_once_and_named_in_a_header(make_served):
    s = make_served(FakeEngine())
    client = s.openai()
    with Lines("specserve.server.http") as lines:
        for _ in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                extra_body={"tempreture": 0, "top_kk": 3})  # fmt: skip
            assert raw.headers["x-specserve-ignored-fields"] == "tempreture, top_kk"
            assert raw.parse().choices[0].finish_reason == "length"
        known = client.completions.with_raw_response.create(model="fake-model", prompt="x", max_tokens=2,
                                                             extra_body={"top_k": 5})  # fmt: skip
        assert "x-specserve-ignored-fields" not in known.headers
        streamed = client.completions.with_raw_response.create(model="fake-model", prompt="x", max_tokens=2,
                                                                stream=True, extra_body={"tempreture": 1})  # fmt: skip
        assert streamed.headers["x-specserve-ignored-fields"] == "tempreture"
        list(streamed.parse())
    warned = [t for t in lines.texts(logging.WARNING) if "was ignored" in t]
    assert len(warned) == 2, warned  # once per name, across endpoints and requests
    assert any("'tempreture'" in t and "did you mean temperature?" in t for t in warned)


def test_strict_fields_refuses_an_unknown_field_naming_it(make_served):
    s = make_served(FakeEngine(), strict_fields=True)
    status, body = http_call(f"{s.http}/v1/chat/completions", {
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "tempreture": 0})  # fmt: skip
    assert status == 400 and body["error"]["param"] == "tempreture"
    assert "did you mean temperature?" in body["error"]["message"]
    status, _ = http_call(f"{s.http}/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": 2,
                                                       "top_k": 3, "speculation": {"num_speculative_tokens": 1}})
    assert status == 200


# --------------------------------------------------------------------------- request defaults


def test_generation_config_defaults_fill_what_a_request_leaves_out(make_served):
    engine = FakeEngine()
    engine.info.sampling_defaults = {"temperature": 0.25, "top_p": 0.5, "top_k": 7, "repetition_penalty": 1.1,
                                     "max_tokens": 5}
    s = make_served(engine, default_max_tokens=None)
    s.openai().chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "a"}])
    s.openai().chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "b"}],
                                       temperature=0.9, top_p=1.0, max_tokens=3)  # fmt: skip
    first, second = (r.params for r in engine.requests.values())
    assert (first.temperature, first.top_p, first.top_k, first.repetition_penalty, first.max_tokens) == (
        0.25, 0.5, 7, 1.1, 5)
    assert (second.temperature, second.top_p, second.top_k, second.max_tokens) == (0.9, 1.0, 7, 3)


def test_max_logprobs_caps_top_logprobs(make_served):
    s = make_served(FakeEngine(), max_logprobs=2)
    status, body = http_call(f"{s.http}/v1/chat/completions", {
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
        "top_logprobs": 3})  # fmt: skip
    assert status == 400 and "at most 2 (server.max_logprobs)" in body["error"]["message"]
