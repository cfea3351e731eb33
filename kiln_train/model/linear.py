"""A bias-free linear projection with a frozen base matrix and an optional LoRA pair.

docs/training-profile.md#frozen-base: the base matrix is a buffer (a saved constant), so autograd
computes only the activation gradient through it and never a base-weight gradient. When a LoRA
pair is attached, y = x·Wᵀ + scale·(x·Aᵀ)·Bᵀ with A [r, in] and B [out, r] trainable leaves and no
dropout (docs/training-profile.md#lora).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FrozenLinear(nn.Module):
    """`weight` [out, in] is a frozen buffer; `lora_A`/`lora_B` are parameters once attached."""

    def __init__(self, in_features: int, out_features: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.lora_A: nn.Parameter | None = None
        self.lora_B: nn.Parameter | None = None
        self.lora_scale = 0.0

    def set_lora(self, a: nn.Parameter, b: nn.Parameter, scale: float) -> None:
        if a.shape != (a.shape[0], self.in_features) or b.shape != (self.out_features, a.shape[0]):
            raise ValueError(
                f"LoRA shapes A{tuple(a.shape)} B{tuple(b.shape)} do not fit a "
                f"{self.in_features}->{self.out_features} projection"
            )
        self.lora_A, self.lora_B, self.lora_scale = a, b, float(scale)

    def clear_lora(self) -> None:
        self.lora_A = self.lora_B = None
        self.lora_scale = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.lora_A is not None:
            # Scaling the rank-r intermediate is cheaper than scaling the [.., out] product.
            y = y + F.linear(F.linear(x, self.lora_A) * self.lora_scale, self.lora_B)
        return y

    def extra_repr(self) -> str:
        lora = f", lora_rank={self.lora_A.shape[0]}" if self.lora_A is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{lora}"
