"""Run the rendered CPU-mode Deployment's container command line on this machine.

Takes a `helm template` render, writes the ConfigMap mounted at the container's
--config-dir into a temporary directory, runs the container's command + args
(same args; mount paths mapped to local directories, /cache to the local
specserve cache), waits for grpc.health.v1 SERVING on the rendered gRPC port,
then sends SIGTERM and expects exit code 0.  Exit 0 on success.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def main(render: str) -> int:
    docs = [d for d in yaml.safe_load_all(Path(render).read_text()) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    tmp = Path(tempfile.mkdtemp(prefix="specserve-rendered-"))
    mounts: dict[str, str] = {}
    for m in c.get("volumeMounts", []):
        vol = volumes[m["name"]]
        local = tmp / m["name"]
        local.mkdir(parents=True, exist_ok=True)
        if "configMap" in vol:
            cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == vol["configMap"]["name"])
            for key, text in cm.get("data", {}).items():
                (local / key).parent.mkdir(parents=True, exist_ok=True)
                (local / key).write_text(text)
        if m["mountPath"] == "/cache":
            local = Path(os.environ.get("SPECSERVE_CACHE_DIR", Path.home() / ".cache" / "specserve"))
        mounts[m["mountPath"]] = str(local)

    def local_path(text: str) -> str:
        for mount, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
            if text == mount or text.startswith(mount + "/"):
                return local + text[len(mount):]
        return text

    exe = Path(sys.executable).parent / c["command"][0]
    args = [local_path(a) for a in c.get("args", [])]
    env = dict(os.environ)
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = local_path(e["value"])
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    http_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
    extra = []
    if not (port_free(grpc_port) and port_free(http_port)):
        # Only when this machine already uses the rendered ports.
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            b.bind(("127.0.0.1", 0))
            grpc_port, http_port = a.getsockname()[1], b.getsockname()[1]
        extra = [f"server.grpc_port={grpc_port}", f"server.http_port={http_port}"]
    cmd = [str(exe), *args, *extra]
    print("running:", " ".join(cmd), flush=True)
    log = tmp / "server.log"
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        probe = c["readinessProbe"]["grpc"]
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=probe.get("service", "")), timeout=2)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
                if status == "SERVING":
                    print(f"grpc health {probe.get('service', '')!r}: SERVING", flush=True)
                    break
            except grpc.RpcError:
                pass
            time.sleep(1)
        else:
            print("server never reported SERVING; log tail:\n" + log.read_text()[-3000:])
            return 1
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        print(f"exit code after SIGTERM: {rc}")
        return 0 if rc == 0 else 1
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
