"""The two RMSNorms of Qwen3.5 (docs/model.md#norms).

- `rms_norm_offset`: Gemma-style zero-centred norm, y = x·rsqrt(mean(x²)+eps)·(1+w), used for the
  block norms, the final norm and the attention q/k norms. Checkpoints store the offset w.
- `gated_rms_norm`: the GDN output norm, y = [x·rsqrt(mean(x²)+eps)]·w·silu(z), plain w (no offset).

Both normalise in fp32 (or f64 when the input is f64) and cast back to the input dtype in the same
places transformers does, so bf16 runs round identically. The weights are frozen buffers, saved
constants (docs/training-profile.md#frozen-base). Each module runs its Triton kernel instead when
the backend chose it (`kernel_path`, docs/kernels.md#kernel-paths).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln_train.kernels.paths import TORCH, TRITON


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype internal reductions run in: fp32, or f64 when the input is already f64."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(1+w)-scaled RMSNorm over the last axis, computed in fp32, cast back to x.dtype."""
    cdt = compute_dtype(x.dtype)
    xf = x.to(cdt)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.to(cdt))).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-w RMSNorm of x times silu(gate), per head over the last axis (docs/model.md#norms)."""
    cdt = compute_dtype(x.dtype)
    xf = x.to(cdt)
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight * y
    return (y * F.silu(gate.to(cdt))).to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """Block / final / q-k RMSNorm with a frozen offset weight buffer (`weight`)."""

    kernel_path = TORCH

    def __init__(self, dim: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_path == TRITON:
            from kiln_train.kernels.rms_norm import rms_norm_offset as fused

            return fused(x, self.weight, self.eps)
        return rms_norm_offset(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """GDN output norm with a frozen plain weight buffer (`weight`, initialised to ones)."""

    kernel_path = TORCH

    def __init__(self, dim: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.kernel_path == TRITON:
            from kiln_train.kernels.gated_norm import gated_rms_norm as fused

            return fused(x, gate, self.weight, self.eps)
        return gated_rms_norm(x, gate, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
