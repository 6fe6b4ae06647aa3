"""Triton kernels, each with a torch reference twin elsewhere in the package.

``paged_attention`` and ``rejection_kernel`` hold the kernels; ``launches`` runs,
compiles and names their binaries; ``specializations`` lists every binary an
engine can launch (compiled at start-up); ``backends`` chooses Triton or the
twin after a start-up check; ``aot`` compiles the list for GPUs without one.

Nothing here imports triton at import time: ``import specserve.kernels`` works
where triton is missing, and :func:`triton_available` says whether the kernels
can be used.
"""

from __future__ import annotations

import functools
import importlib.util

__all__ = ["triton_available"]


@functools.cache
def triton_available() -> bool:
    """True when ``triton`` and ``triton.language`` import cleanly."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # a broken install counts as missing
        return False
    return True
