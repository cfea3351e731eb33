"""SwiGLU MLP of every Qwen3.5 decoder layer: down(silu(gate(x)) · up(x)), no biases (docs/model.md#mlp)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln_train.model.linear import FrozenLinear


class SwiGLU(nn.Module):
    """HF module path `layers.{i}.mlp` (gate_proj, up_proj, down_proj)."""

    def __init__(self, hidden: int, intermediate: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.gate_proj = FrozenLinear(hidden, intermediate, **kw)
        self.up_proj = FrozenLinear(hidden, intermediate, **kw)
        self.down_proj = FrozenLinear(intermediate, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
