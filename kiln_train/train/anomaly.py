"""Per-operation anomaly diagnosis (docs/training-profile.md#anomaly-detection).

With `config.detect_anomaly=true` every backward operation's returned gradients are scanned and
the first NaN/Inf fails the step with the operation's name and its position on the tape (the
order in which autograd executes backward nodes, counted from 0 at the loss). Off by default: the
scan costs one finite reduction per produced gradient.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

import torch

from kiln_train.errors import TrainingFailure


class GradientAnomaly(TrainingFailure):
    def __init__(self, op_name: str, position: int, detail: str) -> None:
        self.op_name = op_name
        self.position = position
        super().__init__(
            "nan_loss",
            f"detect_anomaly: backward operation {op_name} at tape position {position} produced {detail}",
        )


def _graph_nodes(root) -> list:
    """Every autograd node reachable from `root`, breadth-first (root first)."""
    seen, order, queue = set(), [], deque([root])
    while queue:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        order.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                queue.append(child)
    return order


@contextmanager
def anomaly_scan(loss: torch.Tensor, enabled: bool):
    """Hook every backward node of `loss`'s graph; raise GradientAnomaly on the first bad gradient."""
    if not enabled or loss.grad_fn is None:
        yield
        return
    counter = {"position": 0}
    first: list[GradientAnomaly] = []

    def make_hook(node):
        def hook(grad_inputs, grad_outputs):
            position = counter["position"]
            counter["position"] += 1
            if first:
                return None
            for i, g in enumerate(grad_inputs):
                if g is not None and g.is_floating_point() and not bool(torch.isfinite(g).all()):
                    kind = "NaN" if bool(torch.isnan(g).any()) else "Inf"
                    first.append(GradientAnomaly(node.name(), position, f"{kind} in its gradient output {i}"))
                    break
            return None

        return hook

    handles = [node.register_hook(make_hook(node)) for node in _graph_nodes(loss.grad_fn)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    if first:
        raise first[0]
