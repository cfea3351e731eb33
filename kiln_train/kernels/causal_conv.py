"""Triton kernels of the Gated DeltaNet's causal depthwise conv1d + SiLU (docs/kernels.md#kernels).

y_t = silu(Σ_j w[c, j]·m_{t−(K−1)+j}) over m [B, T, C], with the K−1 inputs before t = 0 taken
from a carried prefix [B, K−1, C] or zero: `kiln_train.model.gdn.CausalDepthwiseConv`'s math,
accumulated in f32, rounded to m's dtype before the SiLU as the reference does. The weight is a
frozen buffer. Saved for backward: m (and the prefix) as given; the pre-activation is recomputed
from them, so backward needs no buffer of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln_train.kernels.layout import check_kernel_input

BLOCK_T, BLOCK_C = 32, 128


@triton.jit
def _taps(M, P, b, src, c, ok_t, ok_c, s_mb, s_mt, s_pb, s_pt, K: tl.constexpr, HAS_PREFIX: tl.constexpr):
    """Inputs at positions `src` (≥ −(K−1)); before 0 they come from the prefix, or are zero."""
    mask = (ok_t & (src >= 0))[:, None] & ok_c[None, :]
    at = tl.where(src >= 0, src, 0).to(tl.int64)
    v = tl.load(M + b * s_mb + at[:, None] * s_mt + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_PREFIX:
        p_mask = (ok_t & (src < 0))[:, None] & ok_c[None, :]
        p_at = tl.where(src < 0, src + (K - 1), 0).to(tl.int64)
        v += tl.load(P + b * s_pb + p_at[:, None] * s_pt + c[None, :], mask=p_mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _pre_activation(
    M, P, W, b, t, c, ok_t, ok_c, s_mb, s_mt, s_pb, s_pt,
    K: tl.constexpr, HAS_PREFIX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Σ_j w_j·m_{t−(K−1)+j} in f32, then rounded to m's dtype (the reference's cast before SiLU)."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        w_j = tl.load(W + c * K + j, mask=ok_c, other=0.0).to(tl.float32)
        acc += (
            _taps(M, P, b, t + (j - (K - 1)), c, ok_t, ok_c, s_mb, s_mt, s_pb, s_pt, K, HAS_PREFIX)
            * w_j[None, :]
        )
    return acc.to(M.dtype.element_ty).to(tl.float32)


@triton.jit
def _forward_kernel(
    M, P, W, Y, T, C, s_mb, s_mt, s_pb, s_pt, s_yb, s_yt,
    K: tl.constexpr, HAS_PREFIX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok_t, ok_c = t < T, c < C
    pre = _pre_activation(
        M, P, W, b, t, c, ok_t, ok_c, s_mb, s_mt, s_pb, s_pt, K, HAS_PREFIX, BLOCK_T, BLOCK_C
    )
    y = pre / (1.0 + tl.exp(-pre))
    at = t.to(tl.int64)
    mask = ok_t[:, None] & ok_c[None, :]
    tl.store(Y + b * s_yb + at[:, None] * s_yt + c[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(
    DY, M, P, W, DX, T, C, first, count, s_dyb, s_dyt, s_mb, s_mt, s_pb, s_pt, s_xb, s_xt,
    K: tl.constexpr, HAS_PREFIX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Gradients of the inputs at positions first .. first+count−1 (negative: the prefix)."""
    b = tl.program_id(2).to(tl.int64)
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    s = first + row
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok_s, ok_c = row < count, c < C
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        # input s feeds output t = s + (K−1) − j through tap j
        t = s + (K - 1 - j)
        ok_t = ok_s & (t >= 0) & (t < T)
        pre = _pre_activation(
            M, P, W, b, t, c, ok_t, ok_c, s_mb, s_mt, s_pb, s_pt, K, HAS_PREFIX, BLOCK_T, BLOCK_C
        )
        at = tl.where(ok_t, t, 0).to(tl.int64)
        mask = ok_t[:, None] & ok_c[None, :]
        dy = tl.load(DY + b * s_dyb + at[:, None] * s_dyt + c[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-pre))
        d_pre = (dy * sig * (1.0 + pre * (1.0 - sig))).to(DX.dtype.element_ty).to(tl.float32)
        w_j = tl.load(W + c * K + j, mask=ok_c, other=0.0).to(tl.float32)
        dx += d_pre * w_j[None, :]
    out = row.to(tl.int64)
    mask = ok_s[:, None] & ok_c[None, :]
    tl.store(DX + b * s_xb + out[:, None] * s_xt + c[None, :], dx.to(DX.dtype.element_ty), mask=mask)


def _grid(positions: int, channels: int, batch: int) -> tuple[int, int, int]:
    return (max(1, triton.cdiv(positions, BLOCK_T)), triton.cdiv(channels, BLOCK_C), batch)


class CausalConv1dSilu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, m: torch.Tensor, weight: torch.Tensor, prefix: torch.Tensor | None) -> torch.Tensor:
        b, t, c = m.shape
        k = weight.shape[-1]
        taps = weight.reshape(c, k).contiguous()
        y = torch.empty((b, t, c), dtype=m.dtype, device=m.device)
        p = prefix if prefix is not None else m  # an unread stand-in when there is no prefix
        _forward_kernel[_grid(t, c, b)](
            m, p, taps, y, t, c, m.stride(0), m.stride(1), p.stride(0), p.stride(1), y.stride(0), y.stride(1),
            K=k, HAS_PREFIX=prefix is not None, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=4,
        )  # fmt: skip
        ctx.has_prefix = prefix is not None
        ctx.save_for_backward(m, taps, p)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        m, taps, p = ctx.saved_tensors
        b, t, c = m.shape
        k = taps.shape[-1]
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()

        def grad_of(first: int, count: int) -> torch.Tensor:
            dx = torch.empty((b, count, c), dtype=m.dtype, device=m.device)
            _backward_kernel[_grid(count, c, b)](
                dy, m, p, taps, dx, t, c, first, count, dy.stride(0), dy.stride(1), m.stride(0), m.stride(1),
                p.stride(0), p.stride(1), dx.stride(0), dx.stride(1),
                K=k, HAS_PREFIX=ctx.has_prefix, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=4,
            )  # fmt: skip
            return dx

        d_m = grad_of(0, t) if ctx.needs_input_grad[0] else None
        d_prefix = grad_of(-(k - 1), k - 1) if ctx.has_prefix and ctx.needs_input_grad[2] and k > 1 else None
        return d_m, None, d_prefix


def causal_conv1d_silu(
    m: torch.Tensor, weight: torch.Tensor, prefix: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """m [B, T, C], weight [C, 1, K] (frozen), prefix [B, K−1, C] or None ->
    (silu(conv(m)) [B, T, C], the last K−1 inputs [B, K−1, C], the next call's prefix)."""
    check_kernel_input("causal conv1d", m, weight)
    if weight.requires_grad:
        raise ValueError("causal conv1d: the Triton kernel treats the weight as frozen")
    if m.dim() != 3 or weight.dim() != 3 or weight.shape[:2] != (m.shape[2], 1):
        raise ValueError(f"causal conv1d: m {tuple(m.shape)} and weight {tuple(weight.shape)} do not fit")
    k = weight.shape[-1]
    if prefix is not None:
        if prefix.shape != (m.shape[0], k - 1, m.shape[2]):
            raise ValueError(
                f"causal conv1d: prefix must be {[m.shape[0], k - 1, m.shape[2]]}, got {list(prefix.shape)}"
            )
        prefix = prefix.to(m.dtype)
        prefix = prefix if prefix.stride(-1) == 1 else prefix.contiguous()
    m_in = m if m.stride(-1) == 1 else m.contiguous()
    y = CausalConv1dSilu.apply(m_in, weight, prefix)
    return y, _tail(m, prefix, k)


def _tail(m: torch.Tensor, prefix: torch.Tensor | None, k: int) -> torch.Tensor:
    """The last K−1 inputs of prefix ++ m (zeros standing in for a missing prefix)."""
    t = m.shape[1]
    if t >= k - 1:
        return m[:, t - (k - 1) :]
    before = prefix if prefix is not None else m.new_zeros(m.shape[0], k - 1, m.shape[2])
    return torch.cat((before, m), 1)[:, t:]
