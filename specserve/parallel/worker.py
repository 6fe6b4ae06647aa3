"""The worker loop: a rank other than 0 runs rank 0's forwards on its own shards.

It holds no scheduler, tokenizer state or server: it follows rank 0's control
messages in order (``parallel.group``) and answers with collectives only.

    load    model_id, how to load it   -> load this rank's shard (same slices rule)
    runner  model_id, runner_id, ...   -> a runner and its KV cache (same block count as rank 0)
    step    runner_id, StepBatch, aux  -> the runner's execute on the shard (the torch backend)
    free    runner_id, ...             -> drop runners rank 0 has dropped
    embed   model_id, ids              -> the vocabulary-parallel embedding (an EAGLE head on rank 0)
    logits  model_id, hidden           -> the vocabulary-parallel LM head (same)
    ping                               -> nothing (rank 0 is alive)
    shutdown                           -> exit 0

Exit codes: 0 after ``shutdown``; 1 when rank 0 is gone or a forward fails
(rank 0 sees the broken collective and fails its engine); 2 for a load error
(rank 0 reports the same error itself).  SIGINT/SIGTERM are ignored: the
worker stays until rank 0, which drains first, tells it to go (or dies).

``python -m specserve.parallel.worker`` is how rank 0 starts it (environment
``SPECSERVE_TP_*``); under torchrun or a LeaderWorkerSet the ``specserve``
command itself lands here (``specserve.cli``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch

from specserve.config import Config, ParallelismConfig
from specserve.errors import SpecServeError

log = logging.getLogger("specserve.parallel.worker")


def serve_worker(group: Any) -> int:
    """Follow rank 0 until it says shutdown (0) or goes away (1)."""
    from specserve.executor.backends.factory import RunnerFactory
    from specserve.executor.kv_cache import KVCache
    from specserve.executor.loader import load_model
    from specserve.executor.runner import Runner
    from specserve.parallel.group import recv_message
    from specserve.parallel.loading import ShardSpec

    rank = group.rank
    models: dict[int, Any] = {}
    runners: dict[int, Runner] = {}
    factory = RunnerFactory(cpu_kernel="torch")
    while True:
        try:
            msg = recv_message(group.control_group)
        except Exception as e:
            log.error("rank %d: lost rank 0 (%s); exiting", rank, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return 1
        op, payload = msg[0], msg[1:]
        try:
            if op == "ping":
                continue
            if op == "shutdown":
                log.info("rank %d: shutdown", rank)
                return 0
            if op == "step":
                runner_id, batch, aux = payload
                runners[runner_id].execute(batch, aux)
            elif op == "free":
                for runner_id in payload:
                    runners.pop(runner_id, None)
            elif op == "load":
                model_id, how = payload
                path = _local_model_dir(how)
                spec = ShardSpec(rank, group.size, group.data_group, model_id, None, what=how["key"])
                models[model_id] = load_model(path, how["dtype"], group.device, how["max_model_len"], how["cache_dir"],
                                              key=how["key"], cpu_kernel="torch", tp=spec)  # fmt: skip
            elif op == "runner":
                model_id, runner_id, num_blocks, block_size, min_causal_len = payload
                m = models[model_id]
                a = m.arch
                kv = KVCache(a.num_layers, num_blocks, block_size, a.num_kv_heads, a.head_dim, m.dtype, m.device)
                runners[runner_id] = factory.runner(m, kv, min_causal_len=min_causal_len)
            elif op == "embed":
                model_id, ids = payload
                with torch.inference_mode():
                    models[model_id].model.embed_tokens(ids.to(group.device))
            elif op == "logits":
                model_id, hidden = payload
                m = models[model_id]
                with torch.inference_mode():
                    m.model.compute_logits(hidden.to(m.device, m.dtype))
            else:
                log.error("rank %d: unknown message %r", rank, op)
                return 1
        except SpecServeError as e:  # rank 0 meets the same error and reports it
            log.info("rank %d: %s", rank, e)
            return 2
        except Exception:
            log.exception("rank %d: %s failed", rank, op)
            return 1


def _local_model_dir(how: dict) -> str:
    """The HF directory rank 0 resolved, when this node sees it (one machine, a shared
    volume); else resolve the path here (another node converts its own GGUF copy), one
    local rank at a time: the conversion writes into the shared cache dir."""
    if os.path.isfile(os.path.join(how["hf_dir"], "config.json")):
        return how["hf_dir"]
    import fcntl

    from specserve.executor.loader import default_cache_dir, resolve_hf_dir

    cache = Path(how["cache_dir"]) if how["cache_dir"] else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".tp-resolve.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return str(resolve_hf_dir(how["path"], how["cache_dir"]))


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _exit_now(code: int) -> NoReturn:
    """End a worker without tearing down its process groups.  Rank 0 may already be gone
    once it has said shutdown (under a LeaderWorkerSet or torchrun it does not wait for
    us), and with it the TCP store our groups hang on: destroying them then, or letting
    the interpreter's finalizers do it, can abort in C++ ("terminate called without an
    active exception").  The process holds nothing else worth a clean teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def run_worker(cfg: Config) -> NoReturn:
    """A non-zero rank started by torchrun or a LeaderWorkerSet (the `specserve` command);
    it never returns: the process exits with 0 after ``shutdown``, 1 otherwise."""
    from specserve.parallel.launch import tensor_parallel_group

    _ignore_stop_signals()
    group = tensor_parallel_group(cfg)
    _exit_now(serve_worker(group))


def main() -> None:
    """Entry of a worker process started by rank 0 (``SPECSERVE_TP_*`` in the environment)."""
    from specserve.parallel.launch import ENV_PREFIX, TensorParallelGroup, die_with_parent

    die_with_parent(int(os.environ[ENV_PREFIX + "PARENT_PID"]))
    _ignore_stop_signals()
    rank = os.environ.get(ENV_PREFIX + "RANK", "?")
    logging.basicConfig(
        level=os.environ.get("SPECSERVE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}]: %(message)s",
    )
    env = os.environ
    p = ParallelismConfig(tensor_parallel_size=int(env[ENV_PREFIX + "WORLD_SIZE"]),
                          timeout_s=float(env[ENV_PREFIX + "TIMEOUT_S"]))  # fmt: skip
    try:
        group = TensorParallelGroup(p, env[ENV_PREFIX + "DEVICE"], int(env[ENV_PREFIX + "THREADS"]))
    except Exception as e:
        log.error("rank %s could not join the group: %s", rank, str(e).splitlines()[0] if str(e) else e)
        sys.exit(1)
    _exit_now(serve_worker(group))


if __name__ == "__main__":
    main()
