"""Small helpers shared by the server tests."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from specserve.config import ServerConfig


def server_config(**overrides) -> ServerConfig:
    """Loopback, ephemeral ports, no API or metrics key (even if SPECSERVE_API_KEY is set), small caps."""
    base = dict(host="127.0.0.1", grpc_port=0, http_port=0, max_tokens_cap=64, default_max_tokens=8,
                api_key=None, api_key_env="", metrics_key_env="", drain_timeout_s=5.0)  # fmt: skip
    base.update(overrides)
    return ServerConfig(**base)


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    """Poll until ``predicate()`` holds; ``timeout_s`` is only a safety net against a hang, so
    wait for things that must happen, never to show that something does not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def http_call(url: str, body: bytes | dict | None = None, headers: dict | None = None) -> tuple[int, dict | str]:
    """GET (body None) or POST; returns (status, parsed JSON or text) for any status."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


def scrape(http: str, api_key: str | None = None) -> dict[str, dict[tuple, float]]:
    """GET /metrics (with the key, when the server has one) and parse it with prometheus_client's
    parser: {name: {labels: value}}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_call(f"{http}/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
    assert status == 200
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(metrics, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    return sum(v for k, v in metrics.get(name, {}).items() if all((key, val) in k for key, val in labels.items()))


def hold_after_steps(engine, n: int = 1) -> None:
    """Freeze a FakeEngine once it has run ``n`` steps: their outputs reach the clients, then
    running requests make no progress until ``engine.hold.set()``.  A request is then
    mid-stream for as long as the test needs, whatever the machine's speed."""

    class _Counter:
        steps = 0

        def on_step(self, stats) -> None:
            self.steps += 1
            if self.steps == n:  # once: after hold.set() the engine runs freely
                engine.hold.clear()  # checked before the next step, after this one's output

        def on_request_finished(self, stats) -> None:
            pass

    engine.add_stats_listener(_Counter())
