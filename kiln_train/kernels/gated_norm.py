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

from kiln_train.kernels.layout import as_rows, check_kernel_input, programs, row_blocks, warps_for


@triton.jit
def _forward_kernel(
    X, Z, W, Y, RSTD, n_rows, width, stride_x, stride_z, stride_y, eps,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok, col_ok = rows < n_rows, cols < width
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    normed = (x * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)
    scaled = (normed * w[None, :]).to(Y.dtype.element_ty).to(tl.float32)
    y = scaled * (z / (1.0 + tl.exp(-z)))
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _backward_kernel(
    DY, X, Z, W, RSTD, DX, DZ, n_rows, width, stride_dy, stride_x, stride_z, stride_dx, stride_dz,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok, col_ok = rows < n_rows, cols < width
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    x_hat = x * rstd[:, None]
    scaled = (
        (x_hat.to(DX.dtype.element_ty).to(tl.float32) * w[None, :]).to(DX.dtype.element_ty).to(tl.float32)
    )
    sig = 1.0 / (1.0 + tl.exp(-z))
    dz = dy * scaled * sig * (1.0 + z * (1.0 - sig))
    tl.store(DZ + rows[:, None] * stride_dz + cols[None, :], dz.to(DZ.dtype.element_ty), mask=mask)
    d_scaled = (dy * (z / (1.0 + tl.exp(-z)))).to(DX.dtype.element_ty).to(tl.float32)
    d_normed = (d_scaled * w[None, :]).to(DX.dtype.element_ty).to(tl.float32)
    mean_gx = tl.sum(d_normed * x_hat, axis=1) / width
    dx = rstd[:, None] * (d_normed - x_hat * mean_gx[:, None])
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


class GatedRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x_rows, z_rows = as_rows(x), as_rows(gate)
        n_rows, width = x_rows.shape
        y = torch.empty((n_rows, width), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_r, block_d = row_blocks(width)
        _forward_kernel[programs(n_rows, block_r)](
            x_rows, z_rows, weight, y, rstd, n_rows, width, x_rows.stride(0), z_rows.stride(0), y.stride(0),
            eps, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps_for(block_r * block_d),
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
        block_r, block_d = row_blocks(width)
        _backward_kernel[programs(n_rows, block_r)](
            dy_rows, x_rows, z_rows, weight, rstd, dx, dz, n_rows, width,
            dy_rows.stride(0), x_rows.stride(0), z_rows.stride(0), dx.stride(0), dz.stride(0),
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps_for(block_r * block_d),
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
