"""The run's optimizer, built from the request's optimizer object: the one module of
`kiln_train.optim` that reads the request; the optimizers themselves take plain arguments."""

from __future__ import annotations

from typing import Protocol

from kiln_train.optim import Optimizer, build_optimizer
from kiln_train.optim.kinds import OptimizerConfig


class OptimizerRequest(Protocol):
    """What this module reads of an `SftConfig` (which stands above `optim`)."""

    optimizer: OptimizerConfig
    learning_rate: float | None


def optimizer_for(config: OptimizerRequest, params) -> Optimizer:
    """The optimizer `config.optimizer` names, at the run's learning rate, over `params`."""
    choice = config.optimizer
    return build_optimizer(choice.kind, params, config.learning_rate, **choice.model_dump(exclude={"kind"}))
