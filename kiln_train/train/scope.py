"""The training scope: gradients are recorded only inside the forward and backward of a step,
and the scope says so to code that must never run under it (the canary's generation)."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

# The training scope (docs/training-profile.md#training-scope): set only inside forward/backward of a step.
TRAINING_SCOPE: ContextVar[bool] = ContextVar("kiln_training_scope", default=False)


@contextmanager
def training_scope():
    """Open the explicit training scope: gradients recorded, graph-preserving kernels only."""
    token = TRAINING_SCOPE.set(True)
    try:
        with torch.enable_grad():
            yield
    finally:
        TRAINING_SCOPE.reset(token)
