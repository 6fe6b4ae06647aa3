"""Kernel tests run the Triton kernels under Triton's interpreter on CPU tensors when no GPU
is present.

Triton decides between interpreter and compiler when it is first imported, so
TRITON_INTERPRET is set here, when pytest imports this conftest and before the test modules
import triton.  With a GPU the compiled kernel is tested on CUDA tensors and the variable is
left alone: set, it would turn every other Triton kernel in the session into the interpreter.
If triton was already imported without it, test_rejection_kernel.py reruns itself in a fresh
process instead.
"""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
