"""SwiGLU MLP of every Qwen3.5 decoder layer: down(silu(gate(x)) · up(x)), no biases (docs/model.md#mlp).

The product silu(gate)·up runs as Kiln's Triton kernel when the backend chose it (`kernel`,
docs/kernels.md#kernel-paths)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln_train.kernels.paths import TORCH, TRITON
from kiln_train.model.linear import FrozenLinear


class SwiGLU(nn.Module):
    """HF module path `layers.{i}.mlp` (gate_proj, up_proj, down_proj)."""

    kernel_path = TORCH

    def __init__(self, hidden: int, intermediate: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.gate_proj = FrozenLinear(hidden, intermediate, **kw)
        self.up_proj = FrozenLinear(hidden, intermediate, **kw)
        self.down_proj = FrozenLinear(intermediate, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_path == TRITON:
            from kiln_train.kernels.swiglu import silu_mul

            return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
