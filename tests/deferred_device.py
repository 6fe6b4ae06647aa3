"""A CPU stand-in for a CUDA stream that runs device work as late as a GPU may.

Inside ``with DeferredDevice() as dev:`` every torch operation is queued in issue
order instead of running, as kernels and copies queue on a stream; the queue runs
only when the host needs the device to have reached a point of it:

* ``event.synchronize()`` of an event from ``dev.event()`` (the ``Transfer`` seam
  of ``specserve.executor.staging``): the queue up to that event's ``record``;
* a read of tensor data by the host (``tolist``, ``item``, ``numpy``, ``bool``,
  ``int``, printing) or an operation whose output shape depends on data
  (``nonzero``, a boolean mask): everything queued so far;
* ``dev.synchronize()``.

A queued copy (``non_blocking`` or not) reads its source when it runs, not when it
was issued: what the host writes in between through numpy views of a pinned
buffer (no queue sees those writes) lands in the copy, exactly what a GPU does when
the host rewrites a pinned buffer before the stream has reached the copy.  A queued
operation's result is a tensor of the right shape (from the operation's meta
kernel), filled when it runs; views are taken at once (they read no data);
in-place operations return their mutated argument.

``dev.copies`` counts the copies run and ``dev.waits`` the event waits that found
work still queued (the host had run ahead of the device).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

# Tensor methods that read data on the host: a real device synchronises first.
_HOST_READS = {
    torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__repr__,
    torch.Tensor.__format__, torch.Tensor.data_ptr,
}


class DeferredEvent:
    """``torch.cuda.Event``'s two calls over the deferred queue."""

    def __init__(self, dev: "DeferredDevice"):
        self.dev = dev
        self.mark: object | None = None

    def record(self) -> None:
        self.mark = object()
        self.dev.queue.append(self.mark)

    def synchronize(self) -> None:
        if self.mark is not None:
            self.dev.run_until(self.mark)

    def query(self) -> bool:
        return self.mark is None or self.mark not in self.dev.queue


class _Sync(TorchFunctionMode):
    def __init__(self, dev: "DeferredDevice"):
        super().__init__()
        self.dev = dev

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            self.dev.run_until(None)
        return func(*args, **(kwargs or {}))


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.Generator):
        raise TypeError("a generator's state is host data")
    return x


def _written_args(func, args, kwargs) -> dict[Any, Any]:
    """alias set -> the argument value an in-place/out= operation writes."""
    out = {}
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            for s in a.alias_info.before_set:
                out[s] = value
    return out


class _Defer(TorchDispatchMode):
    def __init__(self, dev: "DeferredDevice"):
        super().__init__()
        self.dev = dev

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        returns = func._schema.returns
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # a composite (``to``, ``reshape``): queue the operations it is made of
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if any(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return func(*args, **kwargs)  # a view: metadata only, reads no data
        try:
            meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        except Exception:  # data-dependent shape, a host value, no meta kernel: the host waits
            self.dev.run_until(None)
            return func(*args, **kwargs)
        leaves, _ = tree_flatten(meta)
        if any(not isinstance(x, torch.Tensor) for x in leaves if x is not None):
            self.dev.run_until(None)
            return func(*args, **kwargs)
        written = _written_args(func, args, kwargs)
        if written:  # in place / out=: the arguments themselves are the results
            self.dev.push(lambda: func(*args, **kwargs), func)
            if not returns:
                return None
            outs = [written[next(iter(r.alias_info.before_set))] if r.alias_info else None for r in returns]
            return outs[0] if len(returns) == 1 else tuple(outs)
        result = tree_map(lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype), meta)

        def run() -> None:
            real = func(*args, **kwargs)
            for dst, src in zip(tree_flatten(result)[0], tree_flatten(real)[0]):
                if dst.shape != src.shape:  # an auxiliary output the meta kernel sizes otherwise
                    dst.resize_(src.shape)  # (batch norm's saved statistics, empty in eval mode)
                dst.copy_(src)

        self.dev.push(run, func)
        return result


class DeferredDevice:
    """The queue, the two modes that fill and drain it, and the ``Transfer`` seam."""

    def __init__(self) -> None:
        self.queue: list[Callable[[], None] | object] = []
        self.copies = 0
        self.waits = 0
        self._modes: list = []

    # ---------------------------------------------------------------- the Transfer seam
    def event(self) -> DeferredEvent:
        return DeferredEvent(self)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    # ---------------------------------------------------------------- the queue
    def push(self, fn: Callable[[], None], func) -> None:
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        copy = func is torch.ops.aten.copy_.default

        def queued() -> None:  # runs under the modes it was issued in
            self.copies += copy
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                fn()

        self.queue.append(queued)

    def run_until(self, mark: object | None) -> None:
        """Run the queue in order, through ``mark`` (None: all of it)."""
        if mark is not None and mark not in self.queue:
            return  # already reached
        ran = False
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            while self.queue:
                entry = self.queue.pop(0)
                if callable(entry):
                    entry()
                    ran = True
                if entry is mark:
                    break
        if mark is not None and ran:
            self.waits += 1

    def synchronize(self) -> None:
        self.run_until(None)

    def __enter__(self) -> "DeferredDevice":
        self._modes = [_Sync(self), _Defer(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self.synchronize()
