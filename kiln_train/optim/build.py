"""`build_optimizer`: the registered kind's update class over named trainable leaves."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln_train.optim.base import Optimizer
from kiln_train.optim.kinds import optimizer_kind


def build_optimizer(
    kind: str, params: Sequence[tuple[str, torch.nn.Parameter]], lr: float, **settings: float | int | bool
) -> Optimizer:
    """The `kind` optimizer (a registered kind: `sgd`, `adam_w`, `muon`, ...) over `params` in order."""
    return optimizer_kind(kind).update_class()(params, lr, **settings)
