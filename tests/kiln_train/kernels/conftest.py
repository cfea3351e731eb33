"""The kernel tests run Kiln's Triton kernels on the CPU through Triton's interpreter.

`TRITON_INTERPRET` is read when a kernel is decorated, so it is set before any kernel module is
imported; a kernel module imported earlier without it is reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

KERNEL_MODULES = (
    "kiln_train.kernels.rms_norm",
    "kiln_train.kernels.gated_norm",
    "kiln_train.kernels.swiglu",
    "kiln_train.kernels.causal_conv",
)


def _interpret_kernel_modules() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    for name in KERNEL_MODULES:
        module = sys.modules.get(name)
        if module is not None and not isinstance(module._forward_kernel, InterpretedFunction):
            importlib.reload(module)


_interpret_kernel_modules()
