"""Plain SGD, `p <- p - lr * g`: stateless (docs/optimizers.md#hyperparameters)."""

from __future__ import annotations

from torch import Tensor

from kiln_train.optim.base import Optimizer, upcast, write_back


class Sgd(Optimizer):
    kind = "sgd"

    def _update(self, name: str, param: Tensor, grad: Tensor) -> None:
        p = upcast(param)
        p.add_(upcast(grad), alpha=-self.lr)
        write_back(param, p)
