"""Triton kernels, each with a torch reference twin elsewhere in the package.

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
