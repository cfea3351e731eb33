"""Optimizer state serialisation: the `optimizer.safetensors` key layout.

docs/checkpoints.md#optimizer-state.

Every state array is stored as F32 and every per-parameter step counter as U32 shape [1]:

- AdamW: `{key}.adamw.m`, `{key}.adamw.v`, `{key}.adamw.step`
- Muon: `{key}.muon.momentum`, `{key}.muon.step`
- SGD: no state (the checkpoint has no `optimizer.safetensors`).

`{key}` is the trainable leaf's name (the PEFT tensor name). Loading casts back into the resident
dtype and device; the F32 file is a portable encoding, not a master copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from safetensors.torch import save as _save_bytes

from kiln_train.optim.kinds import optimizer_kind

if TYPE_CHECKING:
    from torch import Tensor

STEP = "step"


def state_key(param_name: str, kind: str, field: str) -> str:
    """`{key}.adamw.m` and friends (the kind enum is `adam_w`, its registered key segment `adamw`)."""
    return f"{param_name}.{optimizer_kind(kind).state_key_segment}.{field}"


def encode_state(tensors: dict[str, Tensor]) -> bytes:
    """The safetensors bytes of a `state_tensors()` dict."""
    return _save_bytes(tensors)
