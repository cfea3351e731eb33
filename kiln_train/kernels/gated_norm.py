"""Triton kernels of the Gated DeltaNet output norm, y = [x·rsqrt(mean(x²)+eps)]·w·silu(z)
(docs/kernels.md#kernels).

The rounding is `kiln_train.model.norms.gated_rms_norm`'s: the normalised x is rounded to x's
dtype, multiplied by w in that dtype, then by silu(z) in f32 and rounded once more; backward
rounds where autograd does. The weight is a frozen buffer. Saved for backward: x and z as given
and one f32 rstd per row.
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
    X, Z, W, Y, RSTD, n_rows, width, stride_x, stride_z, stride_y, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows, cols, row_ok, col_ok, mask = row_tile(n_rows, width, BLOCK_R, BLOCK_D)
    x, z = load_tile(X, rows, cols, stride_x, mask), load_tile(Z, rows, cols, stride_z, mask)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    normed = (x * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)
    scaled = (normed * w[None, :]).to(Y.dtype.element_ty).to(tl.float32)
    store_tile(Y, rows, cols, stride_y, mask, scaled * (z / (1.0 + tl.exp(-z))))
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _backward_kernel(
    DY, X, Z, W, RSTD, DX, DZ, n_rows, width, stride_dy, stride_x, stride_z, stride_dx, stride_dz,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows, cols, row_ok, col_ok, mask = row_tile(n_rows, width, BLOCK_R, BLOCK_D)
    x, z = load_tile(X, rows, cols, stride_x, mask), load_tile(Z, rows, cols, stride_z, mask)
    dy = load_tile(DY, rows, cols, stride_dy, mask)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    x_hat = x * rstd[:, None]
    scaled = (
        (x_hat.to(DX.dtype.element_ty).to(tl.float32) * w[None, :]).to(DX.dtype.element_ty).to(tl.float32)
    )
    sig = 1.0 / (1.0 + tl.exp(-z))
    store_tile(DZ, rows, cols, stride_dz, mask, dy * scaled * sig * (1.0 + z * (1.0 - sig)))
    # the reference rounds the gradient of w·normed, then of normed, to x's dtype
    d_scaled = (dy * (z / (1.0 + tl.exp(-z)))).to(DX.dtype.element_ty).to(tl.float32)
    d_normed = (d_scaled * w[None, :]).to(DX.dtype.element_ty).to(tl.float32)
    store_tile(DX, rows, cols, stride_dx, mask, rms_backward(d_normed, x_hat, rstd, width))


class GatedRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x_rows, z_rows = as_rows(x), as_rows(gate)
        n_rows, width = x_rows.shape
        y = torch.empty((n_rows, width), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        launch_rows(
            _forward_kernel, n_rows, width,
            x_rows, z_rows, weight, y, rstd, n_rows, width, x_rows.stride(0), z_rows.stride(0), y.stride(0),
            eps,
        )  # fmt: skip
        ctx.save_for_backward(x_rows, z_rows, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_rows, z_rows, weight, rstd = ctx.saved_tensors
        n_rows, width = x_rows.shape
        dy_rows = as_rows(dy)
        dx = torch.empty((n_rows, width), dtype=x_rows.dtype, device=x_rows.device)
        dz = torch.empty_like(dx)
        launch_rows(
            _backward_kernel, n_rows, width,
            dy_rows, x_rows, z_rows, weight, rstd, dx, dz, n_rows, width,
            dy_rows.stride(0), x_rows.stride(0), z_rows.stride(0), dx.stride(0), dz.stride(0),
        )  # fmt: skip
        return dx.view(dy.shape), dz.view(dy.shape), None, None


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-w RMSNorm of x times silu(gate) over the last axis (weight frozen)."""
    check_kernel_input("gated RMSNorm", x, gate, weight)
    if weight.requires_grad:
        raise ValueError("gated RMSNorm: the Triton kernel treats the weight as frozen")
    if gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(
            f"gated RMSNorm: x {tuple(x.shape)}, gate {tuple(gate.shape)} and weight {tuple(weight.shape)} "
            "do not fit"
        )
    return GatedRmsNorm.apply(x, gate, weight.contiguous(), float(eps))
