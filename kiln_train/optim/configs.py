"""The request's optimizer objects: one strict pydantic class per kind (docs/optimizers.md#hyperparameters).

Torch-free: `sft_config` composes them into the request contract and `kinds.py` names each one in
its kind's entry. Every numeric field is checked with a message that names it; the `*_SCHEMA` maps
say the same ranges in JSON Schema, for the OpenAPI document (pydantic's schema cannot).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator

MAX_NS_ITERS = 20

STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)
UNIT_INTERVAL = {"type": "number", "minimum": 0, "exclusiveMaximum": 1}  # [0, 1)
NON_NEGATIVE = {"type": "number", "minimum": 0}


def finite_value(name: str, value: float) -> float:
    """`value` as a float, or ValueError naming `name` when it is NaN or infinite."""
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite")
    return float(value)


def _non_negative_weight_decay(v: float) -> float:
    if finite_value("weight_decay", v) < 0.0:
        raise ValueError("weight_decay must be non-negative")
    return v


# Decoupled weight decay (AdamW, Muon): finite and non-negative.
WeightDecay = Annotated[float, AfterValidator(_non_negative_weight_decay)]


class SgdConfig(BaseModel):
    """Plain SGD; stateless, no optimizer-specific fields."""

    model_config = STRICT
    kind: Literal["sgd"]


class AdamWConfig(BaseModel):
    """AdamW with decoupled weight decay and bias correction."""

    model_config = STRICT
    kind: Literal["adam_w"]
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: WeightDecay = 0.0

    @field_validator("beta1", "beta2")
    @classmethod
    def _beta(cls, v: float, info) -> float:
        finite_value(info.field_name, v)
        if not 0.0 <= v < 1.0:
            raise ValueError(f"{info.field_name} must be in [0, 1)")
        return v

    @field_validator("eps")
    @classmethod
    def _eps(cls, v: float) -> float:
        if finite_value("eps", v) <= 0.0:
            raise ValueError("eps must be greater than zero")
        return v


ADAMW_SCHEMA = {
    "beta1": UNIT_INTERVAL,
    "beta2": UNIT_INTERVAL,
    "eps": {"type": "number", "exclusiveMinimum": 0},
    "weight_decay": NON_NEGATIVE,
}


class MuonConfig(BaseModel):
    """Muon: Nesterov momentum + Newton–Schulz orthogonalisation of each LoRA matrix update."""

    model_config = STRICT
    kind: Literal["muon"]
    momentum: float = 0.95
    nesterov: bool = True
    ns_iters: int = 5
    weight_decay: WeightDecay = 0.0

    @field_validator("momentum")
    @classmethod
    def _momentum(cls, v: float) -> float:
        finite_value("momentum", v)
        if not 0.0 <= v < 1.0:
            raise ValueError("momentum must be in [0, 1)")
        return v

    @field_validator("ns_iters")
    @classmethod
    def _ns(cls, v: int) -> int:
        if not 1 <= v <= MAX_NS_ITERS:
            raise ValueError(f"ns_iters must be in 1..={MAX_NS_ITERS}")
        return v


MUON_SCHEMA = {
    "momentum": UNIT_INTERVAL,
    "ns_iters": {"type": "integer", "minimum": 1, "maximum": MAX_NS_ITERS},
    "weight_decay": NON_NEGATIVE,
}
