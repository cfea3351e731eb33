"""SwiGLU MLP of every Qwen3.5 decoder layer: down(silu(gate(x)) · up(x)), no biases (docs/model.md#mlp).

The product silu(gate)·up runs as Kiln's Triton kernel when the backend chose it (`kernel_path`,
docs/kernels.md#kernel-paths)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln_train.kernels.paths import TORCH, TRITON
from kiln_train.model.linear import FrozenLinear
from kiln_train.model.recompute import project


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

    def product(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kernel_path == TRITON:
            from kiln_train.kernels.swiglu import silu_mul as fused

            return fused(gate, up)
        return silu_mul(gate, up)

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """x [.., hidden] (the pre-norm hidden state when `norm` is given: the norm is recomputed
        in backward instead of kept). Backward keeps x, gate and up (docs/performance.md)."""
        gate, up = project(norm, (x,), (self.gate_proj, self.up_proj))
        return project(self.product, (gate, up), (self.down_proj,), keep=True)[0]
