"""Pinned host buffers that feed non-blocking host -> device copies, reused without racing.

A non-blocking copy from pinned memory reads the host buffer when the device's
stream reaches it, not when the host issues it.  A host that rewrites the buffer
for the next step before then -- nothing forces a wait between steps that sample
nothing, nor inside a drafter's K-step loop -- hands the device the next step's ids,
positions and slots for this one: silently wrong K/V.  ``StagingBuffer`` is the one
place that prevents it: each copy is followed by an event, and a host buffer is
handed out for writing only after the event of its previous copy has completed;
with two host buffers used in turn that event is two copies old, so in steady state
the wait costs nothing and the host still runs a step ahead of the device.

``Transfer`` issues the copies and makes the events (CUDA's); tests substitute a
device double that runs each copy as late as a GPU may
(``tests/deferred_device.py``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


class Transfer:
    """Issues the copies and makes the events that say they ran: CUDA's stream and events
    (the seam where tests put their device double)."""

    def copy(self, dst: Tensor, src: Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()


Field = tuple[str, int] | tuple[str, int | tuple[int, ...], torch.dtype]
_ALIGN = 16  # bytes: every field starts aligned (Triton specialises on 16-byte pointers)


def _layout(fields: list[Field]) -> tuple[list[tuple[str, int, int, torch.dtype, tuple[int, ...]]], int]:
    """(name, byte offset, bytes, dtype, shape) per field, and the buffer's size in bytes."""
    layout, nbytes = [], 0
    for name, shape, *dtype in fields:
        dt = dtype[0] if dtype else torch.int32
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        size = math.prod(shape) * dt.itemsize
        layout.append((name, nbytes, size, dt, shape))
        nbytes += -(-size // _ALIGN) * _ALIGN
    return layout, nbytes


def staging_bytes(fields: list[Field]) -> int:
    """Device bytes of a ``StagingBuffer`` of ``fields`` (each field 16-byte aligned)."""
    return _layout(fields)[1]


class StagingBuffer:
    """Named fields packed in a host buffer (pinned on CUDA) and ONE device twin: the
    host writes the fields through numpy views (``acquire``), the device reads tensor
    views (``d``, fixed: a captured graph stays valid), and ``upload`` is the one
    host -> device copy between them.  ``fields``: (name, n) is n int32 values,
    (name, shape, dtype) any other.

    The copy is non-blocking, so the host must not rewrite a buffer before the copy
    has read it: there are ``slots`` host buffers (2: double buffering) used in turn;
    ``upload`` records an event behind its copy and ``acquire`` waits for the event of
    the slot's previous copy -- issued ``slots`` uploads ago, long done in steady state
    -- before handing the slot out, so the host fills one buffer while the other's
    copy may still be in flight, and never waits on the step it just issued.

    On the CPU without a ``transfer`` the device reads the host buffer itself (one
    slot, no copy)."""

    def __init__(self, fields: list[Field], device: torch.device, transfer: Transfer | None = None,
                 slots: int = 2):
        device = torch.device(device)
        if transfer is None and device.type != "cpu":
            transfer = Transfer()
        self.transfer = transfer
        layout, nbytes = _layout(fields)
        pin = device.type == "cuda"
        n = 1 if transfer is None else slots
        self.hosts = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(n)]
        self.dev = self.hosts[0] if transfer is None else torch.zeros(nbytes, dtype=torch.uint8, device=device)

        def views(buf: Tensor) -> dict[str, Tensor]:
            return {name: buf[at : at + size].view(dt).view(shape) for name, at, size, dt, shape in layout}

        self._h: list[dict[str, np.ndarray]] = [{k: v.numpy() for k, v in views(h).items()} for h in self.hosts]
        self.d: dict[str, Tensor] = views(self.dev)
        self._done = [transfer.event() if transfer is not None else None for _ in self.hosts]
        self._in_flight = [False] * n  # the slot's last copy may not have run yet
        self._slot = 0

    def acquire(self) -> dict[str, np.ndarray]:
        """Numpy views of a host buffer the host may write now (the one ``upload`` sends)."""
        i = self._slot
        if self._in_flight[i]:
            self._done[i].synchronize()  # the copy issued `slots` uploads ago has read this buffer
            self._in_flight[i] = False
        return self._h[i]

    def upload(self) -> None:
        """Copy the acquired buffer to the device (non-blocking); the next ``acquire``
        hands out the next slot."""
        if self.transfer is None:
            return  # the device reads the host buffer itself
        i = self._slot
        self.transfer.copy(self.dev, self.hosts[i])
        self._done[i].record()
        self._in_flight[i] = True
        self._slot = (i + 1) % len(self.hosts)
