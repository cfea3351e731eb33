"""SwiGLU MLP of every Qwen3.5 decoder layer: down(silu(gate(x)) · up(x)), no biases (docs/model.md#mlp).

The product silu(gate)·up runs as Kiln's Triton kernel when the backend chose it (`kernel_path`,
docs/kernels.md#kernel-paths)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln_train.kernels.paths import TORCH, TRITON
from kiln_train.model.linear import FrozenLinear


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate)·up in the inputs' dtype: the torch reference of the MLP's product."""
    return F.silu(gate) * up


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
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.kernel_path == TRITON:
            from kiln_train.kernels.swiglu import silu_mul as fused

            return self.down_proj(fused(gate, up))
        return self.down_proj(silu_mul(gate, up))
