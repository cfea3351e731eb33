"""Triton kernels of Qwen3.5's offset RMSNorm, y = x·rsqrt(mean(x²)+eps)·(1+w) (docs/kernels.md#kernels).

The math and its rounding are `kiln_train.model.norms.rms_norm_offset`'s: normalise and scale in
f32, round once to x's dtype. The weight is a frozen buffer, so backward computes only dx.
Saved for backward: x as given (no f32 copy) and one f32 rstd per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln_train.kernels.layout import as_rows, check_kernel_input, programs, row_blocks, warps_for


@triton.jit
def _forward_kernel(
    X, W, Y, RSTD, n_rows, width, stride_x, stride_y, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok, col_ok = rows < n_rows, cols < width
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = 1.0 + tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    y = x * rstd[:, None] * scale[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _backward_kernel(
    DY,
    X,
    W,
    RSTD,
    DX,
    n_rows,
    width,
    stride_dy,
    stride_x,
    stride_dx,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok, col_ok = rows < n_rows, cols < width
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = 1.0 + tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    x_hat = x * rstd[:, None]
    g = dy * scale[None, :]
    # d/dx of x·rstd: rstd·(g − x̂·mean(g·x̂))
    mean_gx = tl.sum(g * x_hat, axis=1) / width
    dx = rstd[:, None] * (g - x_hat * mean_gx[:, None])
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


class OffsetRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = as_rows(x)
        n_rows, width = rows.shape
        y = torch.empty((n_rows, width), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_r, block_d = row_blocks(width)
        _forward_kernel[programs(n_rows, block_r)](
            rows, weight, y, rstd, n_rows, width, rows.stride(0), y.stride(0), eps,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps_for(block_r * block_d),
        )  # fmt: skip
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, weight, rstd = ctx.saved_tensors
        n_rows, width = rows.shape
        dy_rows = as_rows(dy)
        dx = torch.empty((n_rows, width), dtype=rows.dtype, device=rows.device)
        block_r, block_d = row_blocks(width)
        _backward_kernel[programs(n_rows, block_r)](
            dy_rows, rows, weight, rstd, dx, n_rows, width, dy_rows.stride(0), rows.stride(0), dx.stride(0),
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps_for(block_r * block_d),
        )  # fmt: skip
        return dx.view(dy.shape), None, None


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(1+w)-scaled RMSNorm over the last axis of x (weight frozen: no gradient reaches it)."""
    check_kernel_input("offset RMSNorm", x, weight)
    if weight.requires_grad:
        raise ValueError("offset RMSNorm: the Triton kernel treats the weight as frozen")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"offset RMSNorm: x width {x.shape[-1]} differs from the weight's {weight.shape[-1]}"
        )
    return OffsetRmsNorm.apply(x, weight.contiguous(), float(eps))
