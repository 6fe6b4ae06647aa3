"""Start, drain and stop both servers around one engine.

``run_server`` is the process entry (blocks until SIGTERM/SIGINT, drains,
returns 0).  ``start_servers`` runs the same servers on a background event
loop and returns a ``ServerHandle`` (bound ports, ``drain()``, ``stop()``) for
tests and embedding.

Drain order on SIGTERM: health turns NOT_SERVING (gRPC health and HTTP
``/health``); new requests get UNAVAILABLE / 503 while the listeners stay up;
``engine.drain(server.drain_timeout_s)`` lets in-flight requests finish and
aborts what remains at the timeout (finish_reason ``abort``); the handlers
send their final messages; the listeners close; the engine shuts down.

A second SIGTERM/SIGINT cuts the wait short: every in-flight request is
aborted at once and ends as a drain timeout ends it (a final message with
finish_reason ``abort``, ``data: [DONE]`` for SSE streams), and the process
exits as soon as those final messages are out -- the listeners stay open
until then (at the latest until the drain deadline), so no response is lost.

``exit_process`` ends the ``specserve`` process once ``run_server`` has
returned: the exit hooks run and the output is flushed, but the interpreter's
own teardown, which would garbage-collect every object of torch, transformers
and the model for seconds after the drain, is skipped.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import ssl
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry

from specserve.config import Config, ServerConfig
from specserve.errors import ConfigError
from specserve.metrics import MetricsIdentity, SpecServeMetrics
from specserve.server.auth import ApiKeyChecker
from specserve.server.frontend import Frontend, HealthState
from specserve.server.grpc_service import GrpcHealth, start_grpc_server
from specserve.server.http_app import build_http_app
from specserve.server.stats_log import StatsLog, startup_line

log = logging.getLogger("specserve.server")
stats_logger = logging.getLogger("specserve.stats")

HEALTH_POLL_S = 0.2  # how often engine.healthy is re-read for gRPC health watchers
HANDLER_GRACE_S = 5.0  # after engine.drain: time for handlers to send their final messages
ENGINE_DEAD_GRACE_S = 2.0  # after the engine fails: time it has to fail in-flight requests itself


def _read_tls(cfg: ServerConfig) -> tuple[bytes, bytes] | None:
    if not cfg.tls_cert_file and not cfg.tls_key_file:
        return None
    if not (cfg.tls_cert_file and cfg.tls_key_file):
        raise ConfigError("server.tls_cert_file", "TLS needs both server.tls_cert_file and server.tls_key_file")
    out = []
    for key, path in (("server.tls_cert_file", cfg.tls_cert_file), ("server.tls_key_file", cfg.tls_key_file)):
        try:
            with open(path, "rb") as f:
                out.append(f.read())
        except OSError as exc:
            raise ConfigError(key, f"cannot read {path}: {exc.strerror or exc}") from None
    return out[0], out[1]


def _ssl_context(cfg: ServerConfig) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("server.tls_cert_file", f"cannot load the certificate/key pair: {exc}") from None
    return ctx


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError("server.http_port", f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def check_ports(cfg: ServerConfig) -> None:
    """Fail fast, before the model loads: each fixed port (0 = any free port) must be free
    on ``server.host`` now, and the two must differ.  ConfigError naming the key (the
    servers bind for real once the engine is up; this only spares a long load that would
    end in "address in use")."""
    fixed = [(key, getattr(cfg, key)) for key in ("http_port", "grpc_port") if getattr(cfg, key)]
    if len(fixed) == 2 and fixed[0][1] == fixed[1][1]:
        raise ConfigError("server.grpc_port", f"is {cfg.grpc_port}, the same as server.http_port; give them different ports")
    for key, port in fixed:
        try:
            _bind(cfg.host, port).close()
        except ConfigError as exc:
            raise ConfigError(f"server.{key}", str(exc).split(": ", 1)[1] + f" (set server.{key} to a free port, "
                                               "or 0 for any)") from None


def metrics_identity(engine: Any) -> MetricsIdentity:
    info = engine.info
    return MetricsIdentity(
        model_name=info.model_name,
        method=info.method or "none",
        num_speculative_tokens=int(info.num_speculative_tokens or 0),
        lossless=bool(info.lossless),
        attention_backend=str(getattr(info, "attention_backend", "unknown")),
        rejection_backend=str(getattr(info, "rejection_backend", "unknown")),
    )


class SpecServeServers:
    """The gRPC and HTTP servers on the running event loop, sharing one Frontend."""

    def __init__(self, cfg: ServerConfig, engine: Any, registry: CollectorRegistry | None = None):
        self.cfg = cfg
        self.engine = engine
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = SpecServeMetrics(self.registry, metrics_identity(engine), getattr(cfg, "metric_names", "both"))
        engine.add_stats_listener(self.metrics)
        # server.log_stats_interval_s: the periodic stats line (stats_log), fed like the metrics
        self.stats_interval_s = float(getattr(cfg, "log_stats_interval_s", 0) or 0)
        self.stats_log: StatsLog | None = None
        if self.stats_interval_s > 0:
            self.stats_log = StatsLog(time.monotonic())
            engine.add_stats_listener(self.stats_log)
        self._stats_task: asyncio.Task | None = None
        self.health = HealthState(engine)
        self.grpc_port = 0
        self.http_port = 0
        self.frontend: Frontend | None = None
        self._grpc: grpc.aio.Server | None = None
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task] = set()
        self._watchdog: asyncio.Task | None = None
        self._stopped = False
        self._hurry = asyncio.Event()  # set by abort_inflight(): a drain stops waiting
        self.engine_dead_grace_s = ENGINE_DEAD_GRACE_S

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> None:
        cfg = self.cfg
        tls = _read_tls(cfg)
        checker = ApiKeyChecker.from_config(cfg)
        self.frontend = Frontend(self.engine, cfg, self.metrics, self.health)
        grpc_health = GrpcHealth()
        await grpc_health.set(self.health.refresh())
        self.health.watch(lambda serving: self._spawn(grpc_health.set(serving)))
        try:
            self._grpc, self.grpc_port = await start_grpc_server(
                self.frontend, grpc_health, checker, cfg.host, cfg.grpc_port, tls, cfg.idle_timeout_s
            )
            sock = _bind(cfg.host, cfg.http_port)
            self.http_port = sock.getsockname()[1]
            self._runner = web.AppRunner(
                build_http_app(self.frontend, checker),
                handler_cancellation=True,  # a disconnect cancels the handler -> abort
                shutdown_timeout=HANDLER_GRACE_S,
                # aiohttp arms this timer at connect and after each response: it closes
                # idle keep-alive connections and ones that never finish a request head.
                keepalive_timeout=cfg.idle_timeout_s,
                access_log=logging.getLogger("specserve.server.access") if getattr(cfg, "log_requests", True) else None,
            )
            await self._runner.setup()
            await web.SockSite(self._runner, sock, ssl_context=_ssl_context(cfg) if tls else None).start()
        except BaseException:
            await self.stop(grace_s=0)
            raise
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_engine())
        if self.stats_log is not None:
            self._stats_task = asyncio.get_running_loop().create_task(self._log_stats())
        log.info("%s", startup_line(self.engine.info, cfg.host, self.grpc_port, self.http_port, bool(tls), checker.enabled))

    async def _log_stats(self) -> None:
        """Every server.log_stats_interval_s: one line of what the interval did (stats_log)."""
        assert self.stats_log is not None
        while True:
            await asyncio.sleep(self.stats_interval_s)
            engine = self.engine
            text, info = self.stats_log.line(time.monotonic(), engine.num_running, engine.num_waiting,
                                             engine.kv_cache_usage)  # fmt: skip
            stats_logger.log(logging.INFO if info else logging.DEBUG, "%s", text)

    async def _watch_engine(self) -> None:
        """Publish health changes; once the engine has failed, fail requests it leaves hanging."""
        failed_at: float | None = None
        loop = asyncio.get_running_loop()
        while True:
            self.health.refresh()
            if not self.engine.healthy:
                failed_at = loop.time() if failed_at is None else failed_at
                if loop.time() - failed_at >= self.engine_dead_grace_s and self.frontend is not None:
                    if self.frontend.num_inflight and self.frontend.fail_stuck_requests():
                        log.error("the engine failed and left requests unanswered; ended them with INTERNAL")
            await asyncio.sleep(HEALTH_POLL_S)

    def abort_inflight(self) -> None:
        """Make a drain (running or still to come) abort in-flight requests now instead of
        waiting for them; the handlers still send their final messages before the stop."""
        self._hurry.set()

    async def drain(self, timeout_s: float | None = None) -> None:
        """NOT_SERVING, refuse new work, finish or abort in-flight requests, then stop."""
        timeout_s = self.cfg.drain_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self.health.mark_draining()
        await asyncio.sleep(0)  # let the health watchers publish NOT_SERVING first
        inflight = self.frontend.num_inflight if self.frontend else 0
        log.info("draining: %d request(s) in flight, up to %.1f s", inflight, timeout_s)
        if not await self._unless_hurried(self.engine.drain(timeout_s)):
            inflight = self.frontend.num_inflight if self.frontend else 0
            log.warning("draining: aborting %d in-flight request(s) now", inflight)
            await self.engine.drain(0)
        # The aborted requests' final messages go out before the listeners close: the
        # handlers get what is left of the drain time (at least HANDLER_GRACE_S).
        grace = max(deadline - loop.time(), HANDLER_GRACE_S)
        if self.frontend is not None and not await self.frontend.wait_idle(grace):
            log.warning("draining: %d handler(s) still running after the engine drained", self.frontend.num_inflight)
        await self.stop()

    async def _unless_hurried(self, coro: Any) -> bool:
        """Await ``coro``; False when ``abort_inflight`` came first (``coro`` is then cancelled)."""
        task = asyncio.ensure_future(coro)
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            await asyncio.wait([task, hurry], return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurry.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if task.cancelled():
            return False
        task.result()  # the drain's own errors propagate
        return True

    async def stop(self, grace_s: float = 1.0) -> None:
        """Close both listeners; RPCs still running after ``grace_s`` are cancelled (and so aborted)."""
        if self._stopped:
            return
        self._stopped = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        if self._runner is not None:
            await self._runner.cleanup()
        if self.frontend is not None:
            self.frontend.close()
        for task in list(self._tasks):
            task.cancel()
        log.info("servers stopped")


def _server_config(cfg: Config | ServerConfig) -> ServerConfig:
    return cfg.server if isinstance(cfg, Config) else cfg


@dataclass
class ServerHandle:
    """Servers running on a background event loop (tests, embedding)."""

    servers: SpecServeServers
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    shutdown_engine: bool = True

    @property
    def grpc_port(self) -> int:
        return self.servers.grpc_port

    @property
    def http_port(self) -> int:
        return self.servers.http_port

    @property
    def metrics(self) -> SpecServeMetrics:
        return self.servers.metrics

    def begin_drain(self, timeout_s: float | None = None) -> concurrent.futures.Future:
        """Start a drain (as SIGTERM does) without waiting for it."""
        return asyncio.run_coroutine_threadsafe(self.servers.drain(timeout_s), self.loop)

    def drain(self, timeout_s: float | None = None) -> None:
        self.begin_drain(timeout_s).result()
        self._finish()

    def abort_inflight(self) -> None:
        """What a second SIGTERM does: a drain aborts in-flight requests now."""
        self.loop.call_soon_threadsafe(self.servers.abort_inflight)

    def stop(self) -> None:
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.servers.stop(), self.loop).result()
        self._finish()

    def _finish(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
        if self.shutdown_engine:
            self.shutdown_engine = False
            self.servers.engine.shutdown()

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_servers(
    cfg: Config | ServerConfig,
    engine: Any,
    *,
    registry: CollectorRegistry | None = None,
    start_engine: bool = True,
) -> ServerHandle:
    """Start both servers on a new background event loop; return once they listen.

    Port 0 in the config binds an ephemeral port; read it back from the handle.
    The handle owns the engine's lifecycle: ``stop()``/``drain()`` shut it down.
    """
    server_cfg = _server_config(cfg)
    loop = asyncio.new_event_loop()

    def run_loop() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run_loop, name="specserve-server", daemon=True)
    thread.start()

    servers = SpecServeServers(server_cfg, engine, registry)  # registers the metrics listener
    if start_engine:
        engine.start()
    try:
        asyncio.run_coroutine_threadsafe(servers.start(), loop).result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        if start_engine:
            engine.shutdown()
        raise
    return ServerHandle(servers, loop, thread, shutdown_engine=start_engine)


def run_server(cfg: Config | ServerConfig, engine: Any) -> int:
    """Serve until SIGTERM/SIGINT, drain, shut the engine down; return the exit code (0).

    Raises ConfigError when a port cannot be bound or the TLS files cannot be read.
    """
    return asyncio.run(_serve(_server_config(cfg), engine))


def exit_process(code: int) -> NoReturn:
    """End the process with ``code`` after ``run_server`` (or any orderly shutdown) returned.

    The exit hooks run (``atexit``: logging's flush, child processes, temporary files) and
    stdout/stderr are flushed; then the process leaves without the interpreter's teardown.
    That teardown frees nothing the operating system does not free, but it walks every
    object torch, transformers and the engine created (a garbage collection of hundreds of
    thousands of objects): it kept the process alive for seconds after the drain."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)


async def _engine_fatal(engine: Any) -> None:
    """Return once an engine that must not outlive a failure (``exit_on_failure``, set for
    tensor parallelism, where a dead rank cannot come back) has failed."""
    while not (getattr(engine, "exit_on_failure", False) and not engine.healthy):
        await asyncio.sleep(HEALTH_POLL_S)


async def _serve(cfg: ServerConfig, engine: Any) -> int:
    loop = asyncio.get_running_loop()
    servers = SpecServeServers(cfg, engine)  # registers the metrics listener before the engine runs
    engine.start()
    try:
        await servers.start()
        stop_requested = asyncio.Event()
        signals_seen: list[int] = []

        def on_signal(signum: int) -> None:
            signals_seen.append(signum)
            name = signal.Signals(signum).name
            if len(signals_seen) == 1:
                log.info("%s received: draining (up to %.1f s; a second signal aborts in-flight requests)",
                         name, cfg.drain_timeout_s)  # fmt: skip
                stop_requested.set()
            elif len(signals_seen) == 2:
                log.warning("second signal (%s): aborting in-flight requests now", name)
                stop_requested.set()
                servers.abort_inflight()
            else:
                log.warning("%s received again: in-flight requests are being aborted", name)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        stop_wait = loop.create_task(stop_requested.wait())
        fatal = loop.create_task(_engine_fatal(engine))
        await asyncio.wait([stop_wait, fatal], return_when=asyncio.FIRST_COMPLETED)
        if fatal.done():  # e.g. a tensor-parallel rank died: NOT_SERVING already, then exit non-zero
            stop_wait.cancel()
            log.error("the engine failed (%s); exiting with code 1", getattr(engine, "failure", None))
            await asyncio.sleep(servers.engine_dead_grace_s)  # in-flight requests get their errors first
            return 1
        fatal.cancel()
        await servers.drain()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        return 0
    finally:
        await servers.stop(grace_s=0)
        engine.shutdown()
