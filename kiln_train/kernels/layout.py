"""How the Triton kernels see their tensors: rows of a last axis with unit stride, the dtypes they
cover and the block shapes they launch with (docs/kernels.md#kernels)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# f64 stays on the torch reference: the kernels compute in f32.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Lanes one program covers: a row block of at most this many elements.
TILE_ELEMENTS = 4096


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a [rows, width] tensor whose last axis is contiguous: a view when the strides allow
    one (a q/k slice of a wider projection output keeps its row stride), else a copy."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def check_kernel_input(name: str, *tensors: torch.Tensor) -> None:
    """The kernels take tensors of one supported dtype on one device."""
    first = tensors[0]
    if first.dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name}: the Triton kernel covers {KERNEL_DTYPES}, got {first.dtype}")
    for t in tensors[1:]:
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{name}: every input must be {first.dtype} on {first.device}, got {t.dtype} on {t.device}"
            )


def row_blocks(width: int) -> tuple[int, int]:
    """(rows per program, padded width): a power-of-two width and enough rows to fill a tile."""
    block_d = triton.next_power_of_2(width)
    return max(1, TILE_ELEMENTS // block_d), block_d


def warps_for(elements: int) -> int:
    """Warps per program: one per 256 lanes of the tile, between 1 and 16."""
    return max(1, min(16, elements // 256))


def launch_rows(kernel, n_rows: int, width: int, *args) -> None:
    """Launch a row-tile kernel (its last two parameters BLOCK_R, BLOCK_D) over `n_rows` rows."""
    block_r, block_d = row_blocks(width)
    kernel[programs(n_rows, block_r)](
        *args, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps_for(block_r * block_d)
    )


def programs(items: int, per_program: int) -> tuple[int]:
    """A one-axis launch grid covering `items` (one program even for none: masks make it a no-op)."""
    return (max(1, triton.cdiv(items, per_program)),)


# ----- the row tiles the norm kernels share (device functions) --------------------------------------
@triton.jit
def row_tile(n_rows, width, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's rows (int64) and columns, their bounds and the tile's mask."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok, col_ok = rows < n_rows, cols < width
    return rows, cols, row_ok, col_ok, row_ok[:, None] & col_ok[None, :]


@triton.jit
def load_tile(PTR, rows, cols, stride, mask):
    return tl.load(PTR + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_tile(PTR, rows, cols, stride, mask, value):
    """Store `value` rounded to the tensor's dtype."""
    tl.store(PTR + rows[:, None] * stride + cols[None, :], value.to(PTR.dtype.element_ty), mask=mask)


@triton.jit
def rms_backward(g, x_hat, rstd, width):
    """d/dx of x·rstd(x) pulled back along g: rstd·(g − x̂·mean(g·x̂)), per row."""
    mean_gx = tl.sum(g * x_hat, axis=1) / width
    return rstd[:, None] * (g - x_hat * mean_gx[:, None])
