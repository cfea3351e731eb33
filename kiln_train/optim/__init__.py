"""Kiln's own optimizers (SGD, AdamW, Muon) behind one all-or-nothing interface.

`build_optimizer(config, params, lr)` turns a validated request optimizer object
(`kiln_train.sft_config`) into an `Optimizer`; see `base.py` for the step and state contract.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln_train.optim.adamw import AdamW
from kiln_train.optim.base import GradientSetError, Optimizer, OptimizerStateError
from kiln_train.optim.muon import Muon
from kiln_train.optim.sgd import Sgd
from kiln_train.sft_config import AdamWConfig, MuonConfig, SgdConfig

__all__ = [
    "AdamW",
    "GradientSetError",
    "Muon",
    "Optimizer",
    "OptimizerStateError",
    "Sgd",
    "build_optimizer",
]


def build_optimizer(
    config: SgdConfig | AdamWConfig | MuonConfig,
    params: Sequence[tuple[str, torch.nn.Parameter]],
    lr: float,
) -> Optimizer:
    """The optimizer a request's `config.optimizer` names, over `params` in the given order."""
    if isinstance(config, SgdConfig):
        return Sgd(params, lr)
    if isinstance(config, AdamWConfig):
        return AdamW(
            params,
            lr,
            beta1=config.beta1,
            beta2=config.beta2,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    if isinstance(config, MuonConfig):
        return Muon(
            params,
            lr,
            momentum=config.momentum,
            nesterov=config.nesterov,
            ns_iters=config.ns_iters,
            weight_decay=config.weight_decay,
        )
    raise TypeError(f"unknown optimizer config {type(config).__name__}")
