"""Gradient checkpointing by contiguous layer segments (docs/training-profile.md#gradient-checkpointing).

The layers are cut into `num_segments` contiguous groups, sizes as numpy.array_split gives them
(the first L mod S groups one layer longer). Each group runs under non-reentrant
`torch.utils.checkpoint`, so only its input hidden state is kept and the group is recomputed in
backward. The recomputation repeats the same deterministic kernels, so losses and gradients equal
the un-checkpointed run. One segment means no checkpointing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kiln_train.ground.layer_segments import segment_bounds


def _run_range(layers: Sequence[nn.Module], h: torch.Tensor, rope) -> torch.Tensor:
    for layer in layers:
        h = layer(h, rope)
    return h


def run_layers(layers: Sequence[nn.Module], h: torch.Tensor, rope, num_segments: int = 1) -> torch.Tensor:
    """Run every layer on h; with num_segments > 1 and autograd on, checkpoint each segment."""
    bounds = segment_bounds(len(layers), num_segments)
    if num_segments == 1 or not torch.is_grad_enabled():
        return _run_range(layers, h, rope)
    for start, stop in bounds:
        h = checkpoint(_run_range, layers[start:stop], h, rope, use_reentrant=False)
    return h
