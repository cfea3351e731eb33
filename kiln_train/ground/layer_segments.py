"""How L layers are cut into S gradient-checkpoint segments: contiguous, sizes as numpy.array_split
gives them (the first L mod S segments one layer longer). Memory pricing bounds each segment
with these ranges and the model recomputes exactly these ranges (docs/training-profile.md#gradient-checkpointing).
"""

from __future__ import annotations


def segment_layer_ranges(num_layers: int, num_segments: int) -> list[tuple[int, int]]:
    """[start, stop) layers of each checkpoint segment, the cut `kiln_train.model.checkpointing`
    runs (numpy.array_split sizes, the first L mod S segments one layer longer); torch-free."""
    size, extra = divmod(num_layers, num_segments)
    bounds, start = [], 0
    for s in range(num_segments):
        stop = start + size + (1 if s < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def segment_bounds(num_layers: int, num_segments: int) -> list[tuple[int, int]]:
    """[start, stop) layer ranges of each segment, in order."""
    if not isinstance(num_segments, int) or not 1 <= num_segments <= num_layers:
        raise ValueError(f"num_segments must be an integer in 1..={num_layers}, got {num_segments!r}")
    return segment_layer_ranges(num_layers, num_segments)
