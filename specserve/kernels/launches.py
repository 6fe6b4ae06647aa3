"""A Triton kernel launch as data: run it, compile it without running it, name its binary.

Triton compiles one binary per *specialization* of a kernel: the constexpr values,
the launch options (num_warps), each tensor argument's dtype and whether its address
is 16-byte aligned, and each int argument's width and whether it equals 1 (then it
becomes a constant) or is a multiple of 16 -- unless the kernel lists the argument
in ``do_not_specialize`` (``do_not_specialize_on_alignment`` for pointers).  A
specialization met for the first time while serving compiles on the engine thread
(seconds).  So each kernel module describes its launches as :class:`Launch` values,
and one piece of code

* runs them (:func:`run`),
* compiles them ahead of the first step without running them (:func:`compile_only`:
  the start-up warm-up, which also builds Triton's C launcher and loads the binary),
* names the binary Triton will look them up by (:func:`specialization`: the same
  binder Triton's ``JITFunction.run`` uses, so it can be computed on the CPU), and
* builds the ``ASTSource`` that ``triton.compile`` takes for another GPU
  (:func:`ast_source`: the ahead-of-time report, ``scripts/triton_aot_report.py``).

triton is imported lazily: this module imports without it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class KernelDef:
    """A kernel function (undecorated) and the arguments Triton must not specialise on."""

    fn: Callable
    do_not_specialize: tuple[str, ...] = ()
    do_not_specialize_on_alignment: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.fn.__name__.lstrip("_")


@dataclass
class Launch:
    """One launch: positional runtime arguments, constexprs and options by name."""

    kernel: KernelDef
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    options: dict[str, int] = field(default_factory=dict)  # num_warps, num_stages


def interpreter_active() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1 (its standard library is then
    built for the interpreter; setting the variable after ``import triton`` is too late)."""
    try:
        import triton.language as tl
    except ImportError:
        return False
    return type(tl.sum).__name__ == "InterpretedFunction"


@functools.cache
def jitted(kernel: KernelDef, interpreted: bool):
    """The kernel decorated by ``triton.jit`` (which reads TRITON_INTERPRET when it decorates)."""
    import triton

    fn = triton.jit(kernel.fn, do_not_specialize=list(kernel.do_not_specialize),
                    do_not_specialize_on_alignment=list(kernel.do_not_specialize_on_alignment))
    if (type(fn).__name__ == "InterpretedFunction") != interpreted:
        raise RuntimeError(f"{kernel.name}: TRITON_INTERPRET changed after triton was imported")
    return fn


def run(launch: Launch) -> None:
    jitted(launch.kernel, interpreter_active())[launch.grid](*launch.args, **launch.constexprs, **launch.options)


def compile_only(launch: Launch) -> None:
    """Compile (or load from TRITON_CACHE_DIR) the binary of ``launch`` without running it,
    and build its launcher; under the interpreter there is nothing to compile."""
    if interpreter_active():
        return
    fn = jitted(launch.kernel, False)
    kernel = fn.warmup(*launch.args, grid=launch.grid, **launch.constexprs, **launch.options)
    init = getattr(kernel, "_init_handles", None)
    if init is not None:  # load the module and build the C launcher now, not at the first step
        init()


@functools.cache
def _binder(kernel: KernelDef):
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = JITFunction(kernel.fn, do_not_specialize=list(kernel.do_not_specialize),
                     do_not_specialize_on_alignment=list(kernel.do_not_specialize_on_alignment))
    # the CUDA backend specialises ints and pointers exactly as the base backend does
    return fn, create_function_from_signature(fn.signature, fn.params, BaseBackend)


def specialization(launch: Launch) -> tuple:
    """The key Triton files the binary of ``launch`` under: (kernel, per-argument
    (type, attribute) pairs with constexpr values, options).  Two launches with the same
    key share one compiled binary."""
    _, binder = _binder(launch.kernel)
    _, spec, options = binder(*launch.args, **launch.constexprs, **launch.options)
    return (launch.kernel.name, tuple(_hashable(s) for s in spec), tuple(sorted(options.items())))


def _hashable(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(v) for v in x)
    return x


def ast_source(launch: Launch):
    """``(ASTSource, options)`` for ``triton.compile``: the same signature, constants and
    attributes a launch on a GPU would compile (what ``JITFunction.run`` builds)."""
    from triton.backends.compiler import BaseBackend
    from triton.compiler import ASTSource

    fn, binder = _binder(launch.kernel)
    bound, spec, options = binder(*launch.args, **launch.constexprs, **launch.options)
    names = list(bound)
    signature = {n: s[0] for n, s in zip(names, spec)}
    constexprs = {(i,): bound[n] for i, (n, s) in enumerate(zip(names, spec)) if s[0] == "constexpr"}
    attrs = {(i,): BaseBackend.parse_attr(s[1]) for i, s in enumerate(spec)
             if s[0] != "constexpr" and isinstance(s[1], str)}
    return ASTSource(fn, signature, constexprs, attrs), dict(options)
