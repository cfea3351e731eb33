"""How the Triton kernels see their tensors: rows of a last axis with unit stride, the dtypes they
cover and the block shapes they launch with (docs/kernels.md#kernels)."""

from __future__ import annotations

import torch
import triton

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


def programs(items: int, per_program: int) -> tuple[int]:
    """A one-axis launch grid covering `items` (one program even for none: masks make it a no-op)."""
    return (max(1, triton.cdiv(items, per_program)),)
