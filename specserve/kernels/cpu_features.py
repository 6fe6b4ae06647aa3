"""What the fused CPU decoder needs from this machine (no torch import here:
the CLI asks before torch loads, to choose oneDNN's ISA cap)."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_decoder.c")
CFLAGS = (
    "-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp",
    "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mamx-tile", "-mamx-bf16",
)  # fmt: skip

REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def cpu_unsupported_reason() -> str | None:
    """Why this CPU cannot run the kernel, or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"needs an x86-64 CPU, this is {platform.machine()}"
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    return None


def library_name() -> str:
    """The built kernel's file name: a hash of the source and the flags."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return f"cpu_decoder-{key}.so"


def fused_kernel_expected(cpu_kernel: str) -> bool:
    """Will the fused CPU decoder run (engine.cpu_kernel, this CPU, a prebuilt
    library or a compiler)?  Cheap, and torch-free."""
    if cpu_kernel == "torch" or cpu_unsupported_reason() is not None:
        return False
    return (SOURCE.parent / library_name()).exists() or find_compiler() is not None
