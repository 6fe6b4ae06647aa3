"""Process groups and rank 0's control link to the workers.

Two groups span the same ranks:

- the data group (the default group: NCCL on CUDA, gloo on the CPU) carries
  the forward's all-reduces and the logits gather;
- the control group (always gloo, CPU tensors) carries rank 0's messages:
  ``load``, ``runner``/``free``, ``step`` (a pickled ``StepBatch``), ``embed``/
  ``logits`` (a rank-0 proposer using the target's vocabulary-parallel layers),
  ``ping`` and ``shutdown``.  Workers handle them in order (``parallel.worker``).

Failure detection, so that nothing hangs: a rank that dies closes its
sockets, and gloo fails the next collective on every other rank at once
("Connection closed by peer"); rank 0 pings idle workers every second, so a
dead worker is noticed within about a second even without traffic, and it
also watches the worker processes it started.  A worker waits for rank 0's
next message at most ``parallelism.timeout_s`` (the group timeout), so a
hung rank 0 cannot hold it forever.
"""

from __future__ import annotations

import logging
import pickle
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

FRAME = 16 * 1024  # bytes per control broadcast; longer messages take a second one
HEARTBEAT_S = 1.0  # rank 0 pings workers after this long without a message
_HEADER = struct.Struct("<q")


class RankFailure(RuntimeError):
    """A rank of the tensor-parallel group died or stopped answering."""


def send_message(msg: Any, group: Any) -> None:
    """Rank 0: broadcast one picklable message over the (gloo) control group."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    n = len(data)
    frame = bytearray(FRAME)
    _HEADER.pack_into(frame, 0, n)
    head = min(n, FRAME - _HEADER.size)
    frame[_HEADER.size : _HEADER.size + head] = data[:head]
    dist.broadcast(torch.frombuffer(frame, dtype=torch.uint8), 0, group=group)
    if n > head:
        dist.broadcast(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8), 0, group=group)


def recv_message(group: Any) -> Any:
    """A worker: the next message from rank 0 (raises when rank 0 is gone or the wait times out)."""
    frame = torch.empty(FRAME, dtype=torch.uint8)
    dist.broadcast(frame, 0, group=group)
    raw = frame.numpy().tobytes()
    (n,) = _HEADER.unpack_from(raw, 0)
    head = min(n, FRAME - _HEADER.size)
    data = raw[_HEADER.size : _HEADER.size + head]
    if n > head:
        rest = torch.empty(n - head, dtype=torch.uint8)
        dist.broadcast(rest, 0, group=group)
        data += rest.numpy().tobytes()
    return pickle.loads(data)


class ControlLink:
    """Rank 0's side of the control group: ordered sends from any thread, a heartbeat,
    and the first failure seen (then every later send raises ``RankFailure``)."""

    def __init__(self, group: Any, world_size: int, watch: Callable[[], str | None] | None = None):
        self.group = group
        self.world_size = world_size
        self.failure: str | None = None
        self._watch = watch  # returns a reason when a local worker process has exited
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._listeners: list[Callable[[str], None]] = []
        self._runner_ids = 0
        self._released: list[int] = []  # runners dropped on rank 0, to free on the workers
        self._thread = threading.Thread(target=self._heartbeat, name="specserve-tp-heartbeat", daemon=True)
        self._thread.start()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self._listeners.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def new_runner_id(self) -> int:
        self._runner_ids += 1
        return self._runner_ids

    def release_runner(self, runner_id: int) -> None:
        """A runner was garbage-collected on rank 0 (any thread, maybe mid-send): its worker
        twins are freed with the next message."""
        self._released.append(runner_id)

    def send(self, msg: tuple) -> None:
        with self._lock:
            if self.failure is not None:
                raise RankFailure(self.failure)
            try:
                if self._released:
                    freed, self._released = self._released, []
                    send_message(("free", *freed), self.group)
                send_message(msg, self.group)
            except Exception as e:
                self._fail(f"a tensor-parallel rank stopped answering: {e}".splitlines()[0])
                raise RankFailure(self.failure) from e
            self._last_send = time.monotonic()

    def fail(self, reason: str) -> None:
        with self._lock:
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        log.error("tensor parallelism: %s", reason)
        for cb in list(self._listeners):
            try:
                cb(reason)
            except Exception:  # a listener's bug must not hide the failure
                log.exception("a rank-failure listener failed")

    def _heartbeat(self) -> None:
        while not self._closed.wait(0.2):
            if self.failure is not None:
                return
            reason = self._watch() if self._watch is not None else None
            if reason is not None:
                self.fail(reason)
                return
            if time.monotonic() - self._last_send < HEARTBEAT_S:
                continue
            if self._lock.acquire(timeout=0.1):
                try:
                    if self.failure is None and time.monotonic() - self._last_send >= HEARTBEAT_S:
                        try:
                            send_message(("ping",), self.group)
                            self._last_send = time.monotonic()
                        except Exception as e:
                            self._fail(f"a tensor-parallel rank stopped answering: {e}".splitlines()[0])
                finally:
                    self._lock.release()

    def close(self) -> bool:
        """Tell the workers to exit (clean shutdown); False if they could not be told."""
        self._closed.set()
        self._thread.join(timeout=5)
        with self._lock:
            if self.failure is not None:
                return False
            try:
                send_message(("shutdown",), self.group)
                return True
            except Exception as e:
                self._fail(f"could not tell the workers to exit: {e}".splitlines()[0])
                return False
