"""Optional API-key authentication, shared by the gRPC and HTTP servers.

The key comes from ``server.api_key`` or, when that is unset, from the
environment variable named by ``server.api_key_env`` (default
``SPECSERVE_API_KEY``; a Kubernetes Secret mounts it there).  When neither
yields a non-empty key, authentication is off.

With a key, every call must send ``authorization: Bearer <key>`` (gRPC
metadata or HTTP header) -- except health checks (gRPC ``grpc.health.v1.Health``,
HTTP ``/health``) and HTTP ``/metrics``, which probes and Prometheus scrape
without credentials; neither reveals prompts or outputs.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

from specserve.config import ServerConfig
from specserve.server.errors import UnauthenticatedError

# Reachable without a key.
OPEN_HTTP_PATHS = frozenset({"/health", "/metrics"})
OPEN_GRPC_SERVICES = frozenset({"grpc.health.v1.Health"})


def resolve_api_key(cfg: ServerConfig, environ: Mapping[str, str] | None = None) -> str | None:
    if cfg.api_key:
        return cfg.api_key
    env = os.environ if environ is None else environ
    if cfg.api_key_env:
        value = env.get(cfg.api_key_env, "")
        if value:
            return value
    return None


class ApiKeyChecker:
    def __init__(self, api_key: str | None):
        self._key = api_key.encode() if api_key else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def check(self, authorization: str | bytes | None) -> None:
        """Raise UnauthenticatedError unless ``authorization`` is ``Bearer <key>``.

        Compared as bytes (HTTP passes the raw header; gRPC metadata is text), in
        constant time; a value that is not valid text is simply a wrong key."""
        if self._key is None:
            return
        if not authorization:
            raise UnauthenticatedError("missing API key: send the header 'authorization: Bearer <key>'")
        if isinstance(authorization, str):
            try:
                authorization = authorization.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                raise UnauthenticatedError("invalid API key") from None
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            raise UnauthenticatedError("invalid API key")
