"""Gradient checkpointing by contiguous layer segments (docs/training-profile.md#gradient-checkpointing,
docs/performance.md#recompute).

The layers are cut into `num_segments` contiguous groups, sizes as numpy.array_split gives them
(the first L mod S groups one layer longer). Every group but the last runs under non-reentrant
`torch.utils.checkpoint`, so only its input hidden state is kept and the group is recomputed in
backward. The recomputation is selective: each layer's output projections (o_proj / out_proj and
down_proj, whose outputs are one hidden-size row per token) are kept from the forward and replayed,
so only the rest of the layer runs again. The last group is not checkpointed: its backward runs
first, right after the loss, before any other group is rebuilt, so keeping its activations costs
no more memory than rebuilding it would (`kiln_train.plan.formulas` prices both phases). The
recomputation repeats the same deterministic kernels, so losses and gradients equal the
un-checkpointed run. One segment means no checkpointing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kiln_train.ground.layer_segments import segment_bounds
from kiln_train.model.recompute import SegmentOutputs, segment_outputs


def _run_range(layers: Sequence[nn.Module], h: torch.Tensor, rope) -> torch.Tensor:
    for layer in layers:
        h = layer(h, rope)
    return h


def _run_segment(layers: Sequence[nn.Module], h: torch.Tensor, rope, store: SegmentOutputs) -> torch.Tensor:
    with segment_outputs(store):
        return _run_range(layers, h, rope)


def run_layers(layers: Sequence[nn.Module], h: torch.Tensor, rope, num_segments: int = 1) -> torch.Tensor:
    """Run every layer on h; with num_segments > 1 and autograd on, checkpoint every segment but
    the last."""
    bounds = segment_bounds(len(layers), num_segments)
    if num_segments == 1 or not torch.is_grad_enabled():
        return _run_range(layers, h, rope)
    for start, stop in bounds[:-1]:
        h = checkpoint(_run_segment, layers[start:stop], h, rope, SegmentOutputs(), use_reentrant=False)
    start, stop = bounds[-1]
    return _run_range(layers[start:stop], h, rope)
