"""Optional API-key authentication and tenants, shared by the gRPC and HTTP servers.

The keys come from ``server.api_key`` or, when that is unset, from the
environment variable named by ``server.api_key_env`` (default
``SPECSERVE_API_KEY``; a Kubernetes Secret mounts it there): one key, or several
separated by commas (``"key-a,key-b"``; spaces around each are ignored).  When
neither yields a key, authentication is off.

With keys, every call must send exactly one ``authorization: Bearer <key>``
(gRPC metadata or HTTP header; a second one, even equal, is refused the same
way on both) -- except health checks (gRPC ``grpc.health.v1.Health``, HTTP
``/health`` and ``/ping``), which probes reach without credentials.  HTTP ``/metrics`` needs
a key as well: ``server.metrics_key`` (or the variable named by
``server.metrics_key_env``, default ``SPECSERVE_METRICS_KEY``) when one is set,
and then only that one; otherwise any API key.

Each API key is a *tenant*: the prefix cache and suffix decoding's response
cache are partitioned by tenant (and by the request's ``cache_salt``), so one
key's requests never hit on, draft from or time another key's prompts and
answers.  A tenant is named by a digest of its key, never by the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence

from specserve.config import ServerConfig, split_api_keys
from specserve.server.errors import UnauthenticatedError

# Reachable without a key.
OPEN_HTTP_PATHS = frozenset({"/health", "/ping"})  # probes
METRICS_PATH = "/metrics"
OPEN_GRPC_SERVICES = frozenset({"grpc.health.v1.Health"})


def _from_env(name: str, environ: Mapping[str, str] | None) -> str | None:
    env = os.environ if environ is None else environ
    return (env.get(name, "") or None) if name else None


def resolve_api_key(cfg: ServerConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """The configured key text (one key or a comma-separated list), or None."""
    return cfg.api_key or _from_env(cfg.api_key_env, environ)


def resolve_metrics_key(cfg: ServerConfig, environ: Mapping[str, str] | None = None) -> str | None:
    return cfg.metrics_key or _from_env(cfg.metrics_key_env, environ)


def tenant_of_key(key: bytes) -> str:
    """The tenant a key names: a digest (the key itself must not travel into the engine)."""
    return hashlib.sha256(b"specserve-tenant\0" + key).hexdigest()[:32]


def _encode(authorization: str | bytes) -> bytes:
    if isinstance(authorization, bytes):
        return authorization
    try:
        return authorization.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise UnauthenticatedError("invalid API key") from None


class ApiKeyChecker:
    def __init__(self, api_key: str | None, metrics_key: str | None = None, source: str = "server.api_key"):
        keys = split_api_keys(api_key, source)  # source: where the keys came from, for errors
        self._tenants = [(k.encode(), tenant_of_key(k.encode())) for k in keys]
        self._metrics_key = metrics_key.strip().encode() if metrics_key and metrics_key.strip() else None

    @classmethod
    def from_config(cls, cfg: ServerConfig, environ: Mapping[str, str] | None = None) -> "ApiKeyChecker":
        source = "server.api_key" if cfg.api_key else f"${cfg.api_key_env}"
        return cls(resolve_api_key(cfg, environ), resolve_metrics_key(cfg, environ), source)

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    @property
    def metrics_protected(self) -> bool:
        return self.enabled or self._metrics_key is not None

    def authenticate(self, values: Sequence[str | bytes]) -> str | None:
        """The tenant of a call that sent these ``authorization`` values; None when
        authentication is off.  Raises UnauthenticatedError unless there is exactly one
        value, ``Bearer <one of the keys>``.

        Compared as bytes (HTTP passes the raw header; gRPC metadata is text), in
        constant time against every key; a value that is not valid text is simply a
        wrong key."""
        if not self._tenants:
            return None
        token = self._token(values)
        tenant = None
        for key, name in self._tenants:  # no early exit: the time does not say which key matched
            if hmac.compare_digest(token, key):
                tenant = name
        if tenant is None:
            raise UnauthenticatedError("invalid API key")
        return tenant

    def authenticate_metrics(self, values: Sequence[str | bytes]) -> None:
        """Admit a metrics scrape: the metrics key when one is set, else any API key."""
        if self._metrics_key is None:
            self.authenticate(values)
        elif not hmac.compare_digest(self._token(values), self._metrics_key):
            raise UnauthenticatedError("invalid metrics key")

    @staticmethod
    def _token(values: Sequence[str | bytes]) -> bytes:
        if len(values) > 1:
            raise UnauthenticatedError(f"send one authorization header, got {len(values)}")
        if not values or not values[0]:
            raise UnauthenticatedError("missing API key: send the header 'authorization: Bearer <key>'")
        scheme, _, token = _encode(values[0]).strip().partition(b" ")
        if scheme.lower() != b"bearer":
            raise UnauthenticatedError("invalid API key")
        return token.strip()
