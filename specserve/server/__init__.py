"""The network front ends: gRPC (``specserve.v1.SpecServe``) and OpenAI-compatible HTTP.

Entry points:

* ``run_server(cfg, engine) -> int`` -- serve until SIGTERM/SIGINT, drain, return 0.
* ``check_ports(server_cfg)`` -- both fixed ports free, checked before the model loads.
* ``start_servers(cfg, engine) -> ServerHandle`` -- the same servers on a
  background event loop, for tests and embedding (``.grpc_port``,
  ``.http_port``, ``.drain()``, ``.stop()``; port 0 binds an ephemeral port).

Modules: ``frontend`` (what both share), ``grpc_service``, ``http_app``,
``errors`` (the status table), ``auth`` (API key), ``lifecycle`` (start/drain).
"""

from specserve.server.lifecycle import ServerHandle, SpecServeServers, check_ports, run_server, start_servers

__all__ = ["ServerHandle", "SpecServeServers", "check_ports", "run_server", "start_servers"]
