"""Kiln's own optimizers (SGD, AdamW, Muon) behind one all-or-nothing interface.

`build_optimizer(kind, params, lr, **settings)` builds the optimizer of one kind over named
trainable leaves; `settings` are that optimizer's keyword arguments (AdamW: beta1, beta2, eps,
weight_decay; Muon: momentum, nesterov, ns_iters, weight_decay; SGD: none). Only
`request_optimizer.py` reads the training request: it turns a request's optimizer object into
these arguments. See `base.py` for the step and state contract and `state.py` for the state layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln_train.optim.adamw import AdamW
from kiln_train.optim.base import GradientSetError, Optimizer, OptimizerStateError
from kiln_train.optim.muon import Muon
from kiln_train.optim.sgd import Sgd

__all__ = [
    "OPTIMIZERS",
    "AdamW",
    "GradientSetError",
    "Muon",
    "Optimizer",
    "OptimizerStateError",
    "Sgd",
    "build_optimizer",
]

OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": Sgd, "adam_w": AdamW, "muon": Muon}


def build_optimizer(
    kind: str, params: Sequence[tuple[str, torch.nn.Parameter]], lr: float, **settings: float | int | bool
) -> Optimizer:
    """The `kind` optimizer (`sgd`, `adam_w` or `muon`) over `params` in the given order."""
    optimizer = OPTIMIZERS.get(kind)
    if optimizer is None:
        raise ValueError(f"unknown optimizer kind {kind!r}")
    return optimizer(params, lr, **settings)
