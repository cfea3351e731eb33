"""Kiln's own optimizers (SGD, AdamW, Muon) behind one all-or-nothing interface.

`kinds.py` is the registry: one entry per kind (its request object, update class, default learning
rate, rank rule and state buffers); it and `configs.py` are torch-free, and this package imports
torch only when an update class is first used. `build_optimizer(kind, params, lr, **settings)`
builds the optimizer of one kind over named trainable leaves; `settings` are that optimizer's
keyword arguments (AdamW: beta1, beta2, eps, weight_decay; Muon: momentum, nesterov, ns_iters,
weight_decay; SGD: none). Only `request_optimizer.py` reads the training request: it turns a
request's optimizer object into these arguments. See `base.py` for the step and state contract
and `state.py` for the state layout.
"""

from __future__ import annotations

from kiln_train import lazy_getattr

_EXPORTS = {
    "AdamW": "kiln_train.optim.adamw",
    "GradientSetError": "kiln_train.optim.base",
    "Muon": "kiln_train.optim.muon",
    "Optimizer": "kiln_train.optim.base",
    "OptimizerStateError": "kiln_train.optim.base",
    "Sgd": "kiln_train.optim.sgd",
    "build_optimizer": "kiln_train.optim.build",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
