"""Partial rotary position embedding of the gated full-attention layers (docs/model.md#gated-attention).

inv_freq_j = θ^(−2j/r) for j < r/2 over the rotary slice r = head_dim · partial_rotary_factor;
cos/sin are the r/2 angles duplicated to r; rotate-half acts inside the first r channels of each
head, the remaining channels pass through. Qwen3.5's mRoPE interleaves three position streams
(T/H/W) by `mrope_section`; for text all three streams are the 1-D position, so it reduces exactly
to this plain RoPE.
"""

from __future__ import annotations

import torch


def rope_tables(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, rotary_dim], computed in fp32 and cast to the activation dtype."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim)
    )
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(a ‖ b) -> (−b ‖ a) over the last axis."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [B, heads, T, head_dim]; keep the rest."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    rot = rot * cos + rotate_half(rot) * sin
    return torch.cat((rot, rest), dim=-1)
