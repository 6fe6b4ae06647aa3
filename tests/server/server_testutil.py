"""Small helpers shared by the server tests."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from specserve.config import ServerConfig


def server_config(**overrides) -> ServerConfig:
    """Loopback, ephemeral ports, no API key (even if SPECSERVE_API_KEY is set), small caps."""
    base = dict(host="127.0.0.1", grpc_port=0, http_port=0, max_tokens_cap=64, default_max_tokens=8,
                api_key=None, api_key_env="", drain_timeout_s=5.0)  # fmt: skip
    base.update(overrides)
    return ServerConfig(**base)


def wait_for(predicate, timeout_s: float = 3.0) -> bool:
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


def scrape(http: str) -> dict[str, dict[tuple, float]]:
    """GET /metrics and parse it with prometheus_client's parser: {name: {labels: value}}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_call(f"{http}/metrics")
    assert status == 200
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(metrics, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    return sum(v for k, v in metrics.get(name, {}).items() if all((key, val) in k for key, val in labels.items()))
