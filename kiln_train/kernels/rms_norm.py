"""Triton kernels of Qwen3.5's offset RMSNorm, y = x·rsqrt(mean(x²)+eps)·(1+w) (docs/kernels.md#kernels).

The math and its rounding are `kiln_train.model.norms.rms_norm_offset`'s: normalise and scale in
f32, round once to x's dtype. The weight is a frozen buffer, so backward computes only dx.
Saved for backward: x as given (no f32 copy) and one f32 rstd per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln_train.kernels.layout import (
    as_rows,
    check_kernel_input,
    launch_rows,
    load_tile,
    rms_backward,
    row_tile,
    store_tile,
)


@triton.jit
def _forward_kernel(
    X, W, Y, RSTD, n_rows, width, stride_x, stride_y, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    rows, cols, row_ok, col_ok, mask = row_tile(n_rows, width, BLOCK_R, BLOCK_D)
    x = load_tile(X, rows, cols, stride_x, mask)
    scale = 1.0 + tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    store_tile(Y, rows, cols, stride_y, mask, x * rstd[:, None] * scale[None, :])
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
    rows, cols, row_ok, col_ok, mask = row_tile(n_rows, width, BLOCK_R, BLOCK_D)
    x = load_tile(X, rows, cols, stride_x, mask)
    dy = load_tile(DY, rows, cols, stride_dy, mask)
    scale = 1.0 + tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    store_tile(
        DX, rows, cols, stride_dx, mask, rms_backward(dy * scale[None, :], x * rstd[:, None], rstd, width)
    )


class OffsetRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = as_rows(x)
        n_rows, width = rows.shape
        y = torch.empty((n_rows, width), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        launch_rows(
            _forward_kernel, n_rows, width,
            rows, weight, y, rstd, n_rows, width, rows.stride(0), y.stride(0), eps,
        )  # fmt: skip
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, weight, rstd = ctx.saved_tensors
        n_rows, width = rows.shape
        dy_rows = as_rows(dy)
        dx = torch.empty((n_rows, width), dtype=rows.dtype, device=rows.device)
        launch_rows(
            _backward_kernel, n_rows, width,
            dy_rows, rows, weight, rstd, dx, n_rows, width, dy_rows.stride(0), rows.stride(0), dx.stride(0),
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
