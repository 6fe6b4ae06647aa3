"""Start a tensor-parallel group: which rank this process is, who starts the others.

Three ways in, read from the environment:

- one machine (nothing set): ``specserve parallelism=tp2`` is rank 0 and starts
  tp - 1 worker processes itself (``python -m specserve.parallel.worker``), on a
  free local port;
- ``torchrun --nproc-per-node N specserve parallelism=tpN ...``: every rank runs
  the same command line; ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
  ``MASTER_PORT`` say who is who, rank 0 serves, the others become workers;
- a LeaderWorkerSet (``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``,
  ``LWS_WORKER_INDEX``): one pod per node, tp / group-size ranks per pod; each
  pod's process is the first rank of its node and starts the node's other
  ranks; the leader's first rank is rank 0 and hosts the rendezvous on
  ``parallelism.master_port``.

A process holds at most one group (torch.distributed is per process); it is
made on first use (``tensor_parallel_group``) and lives until ``shutdown``.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.config import Config, ParallelismConfig
from specserve.errors import ConfigError
from specserve.parallel.plan import TP_KEY

log = logging.getLogger(__name__)

ENV_PREFIX = "SPECSERVE_TP_"  # how rank 0 (or a node's first rank) configures the processes it starts


@dataclass
class Topology:
    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int  # 0: pick a free one (single machine)
    spawn: list[int] = field(default_factory=list)  # global ranks this process starts on its node
    launcher: str = "specserve"

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def topology(p: ParallelismConfig, env: dict[str, str] | None = None) -> Topology:
    env = dict(os.environ) if env is None else env
    tp = p.tensor_parallel_size
    if env.get(ENV_PREFIX + "RANK") is not None:  # started by specserve itself
        return Topology(
            world_size=int(env[ENV_PREFIX + "WORLD_SIZE"]), rank=int(env[ENV_PREFIX + "RANK"]),
            local_rank=int(env[ENV_PREFIX + "LOCAL_RANK"]), local_world_size=int(env[ENV_PREFIX + "LOCAL_WORLD_SIZE"]),
            master_addr=env[ENV_PREFIX + "MASTER_ADDR"], master_port=int(env[ENV_PREFIX + "MASTER_PORT"]),
            launcher="specserve",
        )
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or any launcher speaking torch's env
        ws = int(env["WORLD_SIZE"])
        if ws != tp:
            raise ConfigError(TP_KEY, f"is {tp} but the launcher started WORLD_SIZE={ws} processes; they must match")
        rank = int(env["RANK"])
        return Topology(
            world_size=ws, rank=rank, local_rank=int(env.get("LOCAL_RANK", rank)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", ws)), master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", p.master_port)), launcher="torchrun",
        )
    if "LWS_LEADER_ADDRESS" in env and "LWS_GROUP_SIZE" in env:  # LeaderWorkerSet: one pod per node
        nodes = int(env["LWS_GROUP_SIZE"])
        if tp % nodes:
            raise ConfigError(TP_KEY, f"{tp} is not a multiple of the LeaderWorkerSet's {nodes} pods (LWS_GROUP_SIZE)")
        per = tp // nodes
        first = int(env.get("LWS_WORKER_INDEX", "0")) * per
        return Topology(
            world_size=tp, rank=first, local_rank=0, local_world_size=per, master_addr=env["LWS_LEADER_ADDRESS"],
            master_port=p.master_port, spawn=list(range(first + 1, first + per)), launcher="leaderworkerset",
        )
    return Topology(world_size=tp, rank=0, local_rank=0, local_world_size=tp, master_addr="127.0.0.1", master_port=0,
                    spawn=list(range(1, tp)))


def resolve_tp_device(name: str, local_rank: int, local_world_size: int) -> torch.device:
    """engine.device under TP: cuda:<local rank> when CUDA is used, with enough GPUs."""
    cuda = name == "cuda" or (name == "auto" and torch.cuda.is_available())
    if not cuda:
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if local_world_size > n:
        raise ConfigError(
            TP_KEY,
            f"needs {local_world_size} GPUs on this node but {n} are visible"
            + (f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})" if "CUDA_VISIBLE_DEVICES" in os.environ else ""),
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def default_threads(local_world_size: int) -> int:
    """The CPU's cores shared by this node's ranks."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // local_world_size)


def die_with_parent(parent_pid: int, poll_s: float = 0.2) -> None:
    """A started worker exits as soon as the process that started it is gone (even killed
    with SIGKILL, and even while the worker is busy loading, when no collective would notice):
    a daemon thread watches for the worker being re-parented.  (Not PR_SET_PDEATHSIG: that
    fires when the parent THREAD exits, and rank 0 may start its workers from any thread.)"""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        log.error("the process that started this worker (pid %d) is gone; exiting", parent_pid)
        os._exit(1)

    threading.Thread(target=watch, name="specserve-tp-parent-watch", daemon=True).start()


class TensorParallelGroup:
    """This process's place in the group: the process groups, and on rank 0 the control
    link, the worker processes it started and the models it loaded."""

    def __init__(self, p: ParallelismConfig, device_name: str, num_threads: int | None):
        import torch.distributed as dist

        self.topo = t = topology(p)
        self.size = t.world_size
        self.rank = t.rank
        self.device = resolve_tp_device(device_name, t.local_rank, t.local_world_size)
        self.threads = num_threads or default_threads(t.local_world_size)
        cuda = self.device.type == "cuda"
        if not cuda:
            torch.set_num_threads(self.threads)
        timeout = datetime.timedelta(seconds=p.timeout_s)
        backend = "nccl" if cuda else "gloo"
        self.procs: dict[int, subprocess.Popen] = {}
        self.reaped: dict[int, int] = {}  # rank -> exit code of workers that have exited
        self.master_port = t.master_port
        log.info("tensor parallel rank %d of %d (%s, %s via %s, %d CPU threads)", t.rank, t.world_size, self.device,
                 backend, t.launcher, self.threads)
        kw: dict[str, Any] = {"device_id": self.device} if cuda else {}
        if t.launcher == "torchrun":  # torchrun's agent hosts the store: join it the way it says (env://)
            dist.init_process_group(backend, init_method="env://", rank=t.rank, world_size=t.world_size,
                                    timeout=timeout, **kw)  # fmt: skip
        else:
            store = dist.TCPStore(
                t.master_addr, t.master_port, t.world_size, t.is_rank0, timeout=timeout, wait_for_workers=False
            )
            self.master_port = store.port
            for r in t.spawn:
                self.procs[r] = self._spawn(r, p)
            dist.init_process_group(backend, store=store, rank=t.rank, world_size=t.world_size, timeout=timeout, **kw)
        self.data_group = dist.group.WORLD
        self.control_group = dist.new_group(backend="gloo", timeout=timeout)
        self.link = None
        self._next_id = 0
        if t.is_rank0:
            from specserve.parallel.group import ControlLink

            self.link = ControlLink(self.control_group, t.world_size, watch=self._watch)
        self._closed = False
        atexit.register(self.shutdown)

    def _spawn(self, rank: int, p: ParallelismConfig) -> subprocess.Popen:
        t = self.topo
        env = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(k, None)  # the child is configured by ours, not by a torchrun above us
        env.update({
            ENV_PREFIX + "RANK": str(rank), ENV_PREFIX + "WORLD_SIZE": str(t.world_size),
            ENV_PREFIX + "LOCAL_RANK": str(t.local_rank + rank - t.rank),
            ENV_PREFIX + "LOCAL_WORLD_SIZE": str(t.local_world_size),
            ENV_PREFIX + "MASTER_ADDR": t.master_addr, ENV_PREFIX + "MASTER_PORT": str(self.master_port),
            ENV_PREFIX + "DEVICE": self.device.type, ENV_PREFIX + "THREADS": str(self.threads),
            ENV_PREFIX + "TIMEOUT_S": str(p.timeout_s), ENV_PREFIX + "PARENT_PID": str(os.getpid()),
        })  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-m", "specserve.parallel.worker"], env=env, stdin=subprocess.DEVNULL)
        log.info("started tensor-parallel worker rank %d (pid %d)", rank, proc.pid)
        return proc

    def _watch(self) -> str | None:
        for r, proc in self.procs.items():
            code = proc.poll()
            if code is not None and r not in self.reaped:
                self.reaped[r] = code
                return f"worker rank {r} (pid {proc.pid}) exited with code {code}"
        return None

    def load(self, path: str, dtype_name: str, max_model_len: int | None, cache_dir: str | None,
             key: str = "model") -> Any:
        """Rank 0: load this rank's shard of a model while every worker loads its own."""
        from specserve.executor.loader import load_model, resolve_dtype
        from specserve.parallel.loading import ShardSpec

        assert self.link is not None, "only rank 0 loads models; workers follow its messages"
        hf_dir, a = precheck(path, cache_dir, self.size, key)
        # Under TP the torch path runs on every rank: auto is float32 on the CPU, bfloat16 on CUDA.
        dtype = str(resolve_dtype(dtype_name, self.device, "torch")).removeprefix("torch.")
        model_id = self._next_id = self._next_id + 1
        self.link.send(("load", model_id, {"path": path, "hf_dir": str(hf_dir), "dtype": dtype,
                                           "max_model_len": max_model_len, "cache_dir": cache_dir, "key": key}))
        spec = ShardSpec(0, self.size, self.data_group, model_id, self.link, what=key)
        loaded = load_model(str(hf_dir), dtype, self.device, max_model_len, cache_dir, key=key, cpu_kernel="torch",
                            tp=spec)  # fmt: skip
        log.info("%s sharded over %d ranks: rank 0 holds %d of %d attention heads, %d KV heads", key, self.size,
                 loaded.tp.plan.num_heads, a.num_heads if a else -1, loaded.tp.plan.num_kv_heads)
        return loaded

    def shutdown(self, failed: bool = False, wait_s: float = 15.0) -> int:
        """Stop every rank this process is responsible for; returns 0 when all exited
        cleanly.  Rank 0 tells the workers to exit; the processes it started are reaped,
        or killed after ``wait_s``."""
        if self._closed:
            return 0
        self._closed = True
        ok = not failed
        if self.link is not None:
            ok = self.link.close() and ok
        code = 0 if ok else 1
        for r, proc in self.procs.items():
            try:
                rc = proc.wait(timeout=wait_s if ok else 2.0)
            except subprocess.TimeoutExpired:
                log.error("worker rank %d (pid %d) did not exit; killing it", r, proc.pid)
                proc.kill()
                rc = proc.wait()
            log.info("tensor-parallel worker rank %d exited with code %d", r, rc)
            code = code or int(rc != 0)
        if ok:
            try:
                import torch.distributed as dist

                dist.destroy_process_group()
            except Exception:  # best effort: the process is exiting
                log.debug("destroy_process_group failed", exc_info=True)
        return code


def precheck(path: str, cache_dir: str | None, tp: int, key: str) -> tuple[Any, Any]:
    """(the HF directory, its ArchConfig or None): a GGUF is converted here, once, before
    any worker reads it, and a layout that cannot be split is one line before any starts."""
    from transformers import AutoConfig

    from specserve.executor.loader import resolve_hf_dir
    from specserve.executor.models.llama import ArchConfig
    from specserve.parallel.plan import check_layout

    hf_dir = resolve_hf_dir(path, cache_dir)
    try:
        a = ArchConfig.from_hf(AutoConfig.from_pretrained(str(hf_dir), local_files_only=True))
    except Exception:
        return hf_dir, None  # load_model reports a bad config in its own words
    check_layout(a.num_heads, a.num_kv_heads, a.intermediate_size, tp, key)
    return hf_dir, a


_GROUP: TensorParallelGroup | None = None  # torch.distributed allows one default group per process


def tensor_parallel_group(cfg: Config) -> TensorParallelGroup:
    """This process's group, made on first use."""
    global _GROUP
    if _GROUP is None:
        _GROUP = TensorParallelGroup(cfg.parallelism, cfg.engine.device, cfg.engine.num_threads)
    elif _GROUP.size != cfg.parallelism.tensor_parallel_size:
        raise ConfigError(TP_KEY, f"this process already runs a group of {_GROUP.size} ranks")
    return _GROUP


def current_group() -> TensorParallelGroup | None:
    return _GROUP


def load_target(cfg: Config) -> Any:
    """Rank 0's shard of ``cfg.model`` (starting the group and its workers if needed)."""
    m = cfg.model
    if _GROUP is None:
        precheck(m.path, m.cache_dir, cfg.parallelism.tensor_parallel_size, "model")
    return tensor_parallel_group(cfg).load(m.path, m.dtype, m.max_model_len, m.cache_dir, key="model")


def is_worker_process(cfg: Config) -> bool:
    """True for a rank other than 0 started by torchrun or a LeaderWorkerSet (it runs the
    worker loop, not the servers)."""
    if cfg.parallelism.tensor_parallel_size <= 1:
        return False
    return not topology(cfg.parallelism).is_rank0


def shutdown(failed: bool = False) -> int:
    """Stop the group if this process has one; the exit code it implies."""
    return _GROUP.shutdown(failed) if _GROUP is not None else 0


def attach_engine(engine: Any) -> None:
    """A served engine under TP: a dead rank fails it (health NOT_SERVING) and makes the
    server exit non-zero (``server.lifecycle`` reads ``exit_on_failure``)."""
    g = _GROUP
    if g is None or g.link is None:
        return
    engine.exit_on_failure = True

    def failed(reason: str) -> None:
        if engine.healthy:
            engine.failure = reason
            engine.healthy = False

    g.link.on_failure(failed)
