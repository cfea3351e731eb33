"""Triton kernels of SwiGLU's product, h = silu(gate)·up (docs/kernels.md#kernels).

The rounding is the torch reference's (`kiln_train.model.mlp.SwiGLU`): silu is computed in f32 and
rounded to the input dtype, then the product is rounded again; backward rounds where autograd
does (each product's gradient, then silu's backward). Saved for backward: gate and up as given;
silu(gate) is recomputed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln_train.kernels.layout import TILE_ELEMENTS, check_kernel_input, programs


@triton.jit
def _forward_kernel(GATE, UP, H, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(GATE + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(H.dtype.element_ty).to(tl.float32)
    tl.store(H + offs, (s * u).to(H.dtype.element_ty), mask=ok)


@triton.jit
def _backward_kernel(DH, GATE, UP, DGATE, DUP, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    dh = tl.load(DH + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(GATE + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=ok, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    s = (g / (1.0 + tl.exp(-g))).to(DUP.dtype.element_ty).to(tl.float32)
    tl.store(DUP + offs, (dh * s).to(DUP.dtype.element_ty), mask=ok)
    ds = (dh * u).to(DGATE.dtype.element_ty).to(tl.float32)
    dg = ds * sig * (1.0 + g * (1.0 - sig))
    tl.store(DGATE + offs, dg.to(DGATE.dtype.element_ty), mask=ok)


class SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        h = torch.empty_like(gate)
        n = gate.numel()
        _forward_kernel[programs(n, TILE_ELEMENTS)](gate, up, h, n, BLOCK=TILE_ELEMENTS, num_warps=8)
        ctx.save_for_backward(gate, up)
        return h

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        dh = dh.contiguous()
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _backward_kernel[programs(n, TILE_ELEMENTS)](
            dh, gate, up, d_gate, d_up, n, BLOCK=TILE_ELEMENTS, num_warps=8
        )
        return d_gate, d_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate)·up, elementwise, for two tensors of one shape and dtype."""
    check_kernel_input("SwiGLU", gate, up)
    if gate.shape != up.shape:
        raise ValueError(f"SwiGLU: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    return SiluMul.apply(gate, up)
