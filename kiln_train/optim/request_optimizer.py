"""The run's optimizer, built from the request's optimizer object: the one module of
`kiln_train.optim` that reads the request; the optimizers themselves take plain arguments."""

from __future__ import annotations

from kiln_train.optim import Optimizer, build_optimizer
from kiln_train.sft_config import SftConfig


def optimizer_for(config: SftConfig, params) -> Optimizer:
    """The optimizer `config.optimizer` names, at the run's learning rate, over `params`."""
    choice = config.optimizer
    return build_optimizer(choice.kind, params, config.learning_rate, **choice.model_dump(exclude={"kind"}))
