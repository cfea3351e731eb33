"""Where the kernel tests run: without CUDA, Kiln's Triton kernels run on the CPU through Triton's
interpreter; with CUDA they compile for the GPU, the `gpu`-marked tests (test_kernels_gpu.py) run
them there, and the interpreter tests (which hand the kernels CPU tensors) are skipped.

`TRITON_INTERPRET` is read when a kernel is decorated, so it is set before any kernel module is
imported; a kernel module imported earlier without it is reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

INTERPRETED = not torch.cuda.is_available()
KERNEL_MODULES = (
    "kiln_train.kernels.rms_norm",
    "kiln_train.kernels.gated_norm",
    "kiln_train.kernels.swiglu",
    "kiln_train.kernels.causal_conv",
)

if INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"


def _interpret_kernel_modules() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    for name in KERNEL_MODULES:
        module = sys.modules.get(name)
        if module is not None and not isinstance(module._forward_kernel, InterpretedFunction):
            importlib.reload(module)


if INTERPRETED:
    _interpret_kernel_modules()


def pytest_collection_modifyitems(config, items) -> None:
    if INTERPRETED:
        return
    skip = pytest.mark.skip(reason="an interpreter test on CPU tensors; test_kernels_gpu.py covers CUDA")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here) and "gpu" not in item.keywords:
            item.add_marker(skip)
