"""Without CUDA, Kiln's Triton kernels run on the CPU through Triton's interpreter in these tests
(docs/kernels.md#kernels); with CUDA they compile for the GPU, the interpreter tests (which hand
the kernels CPU tensors) skip, and tests/kiln_train/kernels/test_kernels_gpu.py runs them there.

`TRITON_INTERPRET` is read when a kernel is decorated, so it is set before any kernel module is
imported; a kernel module imported earlier without it is reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

INTERPRETED = not torch.cuda.is_available()
KERNEL_MODULES = (
    "kiln_train.kernels.rms_norm",
    "kiln_train.kernels.gated_norm",
    "kiln_train.kernels.swiglu",
    "kiln_train.kernels.causal_conv",
)


def _interpret_kernel_modules() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    for name in KERNEL_MODULES:
        module = sys.modules.get(name)
        if module is not None and not isinstance(module._forward_kernel, InterpretedFunction):
            importlib.reload(module)


if INTERPRETED:
    _interpret_kernel_modules()
