"""What the fused CPU decoder needs from this machine (no torch import here:
the CLI asks before torch loads, to choose oneDNN's ISA cap).

``cpu_decoder.c`` has two builds: AVX512-BF16 (+ AMX where present) and
AVX2 + FMA + F16C.  The best one the CPU runs is used; ``SPECSERVE_CPU_ISA``
(``avx512`` or ``avx2``) restricts the choice, e.g. to test the AVX2 build on
an AVX512 machine.  Each build's library name carries its ISA and a hash of
the source and flags, so the builds never collide in a cache directory."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_decoder.c")
COMMON_CFLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp")

# The AVX512-BF16 / AMX build.
CFLAGS = (
    *COMMON_CFLAGS,
    "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mamx-tile", "-mamx-bf16",
)  # fmt: skip
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "fma")

# The AVX2 build (no AMX).
AVX2_CFLAGS = (*COMMON_CFLAGS, "-mavx2", "-mfma", "-mf16c")
AVX2_REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")

# isa -> (compiler flags, /proc/cpuinfo flags it needs), best first
ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512": (CFLAGS, REQUIRED_CPU_FLAGS),
    "avx2": (AVX2_CFLAGS, AVX2_REQUIRED_CPU_FLAGS),
}
ISA_ENV = "SPECSERVE_CPU_ISA"


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


def _allowed_isas() -> list[str]:
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    return [forced] if forced else list(ISAS)


def kernel_isa() -> str | None:
    """The best build of the kernel this CPU runs ("avx512" or "avx2"), or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = cpu_flags()
    for isa in _allowed_isas():
        if isa in ISAS and all(f in flags for f in ISAS[isa][1]):
            return isa
    return None


def cpu_unsupported_reason() -> str | None:
    """Why this CPU cannot run the kernel, or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"needs an x86-64 CPU, this is {platform.machine()}"
    if kernel_isa() is not None:
        return None
    allowed = _allowed_isas()
    if allowed[0] not in ISAS:
        return f"{ISA_ENV}={allowed[0]!r} is not one of {', '.join(ISAS)}"
    flags = cpu_flags()
    missing = [f for f in ISAS[allowed[-1]][1] if f not in flags]  # the least demanding build allowed
    return f"the CPU lacks {', '.join(missing)}"


def cflags(isa: str | None = None) -> tuple[str, ...]:
    """The compiler flags of a build (default: this CPU's, else the AVX512 one)."""
    return ISAS[isa or kernel_isa() or "avx512"][0]


def library_name(isa: str | None = None) -> str:
    """The built kernel's file name: the ISA, then a hash of the source and the flags."""
    isa = isa or kernel_isa() or "avx512"
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(cflags(isa)).encode()).hexdigest()[:16]
    return f"cpu_decoder-{isa}-{key}.so"


def fused_kernel_expected(cpu_kernel: str) -> bool:
    """Will the fused CPU decoder run (engine.cpu_kernel, this CPU, a prebuilt
    library or a compiler)?  Cheap, and torch-free."""
    if cpu_kernel == "torch" or cpu_unsupported_reason() is not None:
        return False
    return (SOURCE.parent / library_name()).exists() or find_compiler() is not None
