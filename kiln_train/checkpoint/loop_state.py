"""The SFT loop state `sft_loop_state.json` (`kiln.sft-loop-state.v1`, docs/checkpoints.md#loop-state).

It is everything the SFT loop carries from one step to the next besides tensors: the per-step
loss history, the running epoch sums, the first/best epoch means and the LoRA gradient-norm
accumulator. Floats are written with Python's shortest round-trip repr, so a resumed run sees
bit-identical values. Invariants: `len(loss_history) == global_step`, `last_loss` is the last
element (null before any step), `current_epoch_items == cursor_in_epoch`, the epoch-loss fields
are present exactly when `epoch_index > 0`, everything finite; and, because the writer
checkpoints an epoch boundary after the epoch-end bookkeeping, a zero cursor means a zero
running sum. Against the manifest's progress (`check_loop_state_progress`) the running sum and
the first/best epoch means must also be exactly what the loss history gives.

The gradient-norm accumulator keeps `{sample_count, sum, min, max}` per LoRA module (the sum,
not the mean, so continuing the accumulation after resume is exact); `mean` is derived.
Torch-free.
"""

from __future__ import annotations

import math
import struct
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kiln_train.checkpoint.errors import CheckpointError
from kiln_train.checkpoint.json_io import dump_pretty_json, load_strict_json
from kiln_train.checkpoint.manifest import (
    LOOP_STATE_FILE,
    SFT_LOOP_STATE_TYPE,
    Progress,
    describe_model_error,
)

_STATE = ConfigDict(extra="forbid", strict=True, frozen=True)


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def _all_finite(field: str, values: list[float]) -> None:
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise ValueError(f"{field}[{i}] is not finite")


class GradNormStats(BaseModel):
    """Running statistics of one LoRA module's per-step gradient L2 norm."""

    model_config = _STATE
    sample_count: int = Field(ge=1)
    sum: float = Field(ge=0.0, allow_inf_nan=False)
    min: float = Field(ge=0.0, allow_inf_nan=False)
    max: float = Field(ge=0.0, allow_inf_nan=False)

    @property
    def mean(self) -> float:
        return self.sum / self.sample_count

    @classmethod
    def first(cls, norm: float) -> GradNormStats:
        return cls(sample_count=1, sum=float(norm), min=float(norm), max=float(norm))

    def add(self, norm: float) -> GradNormStats:
        """These statistics with one more sample."""
        norm = float(norm)
        return GradNormStats(
            sample_count=self.sample_count + 1,
            sum=self.sum + norm,
            min=min(self.min, norm),
            max=max(self.max, norm),
        )


class SftLoopState(BaseModel):
    """`sft_loop_state.json`; `validate_loop_state` checks the invariants."""

    model_config = _STATE
    schema_version: Literal[1] = 1
    state_type: Literal["kiln.sft-loop-state.v1"] = SFT_LOOP_STATE_TYPE
    global_step: int = Field(ge=0)
    epoch_index: int = Field(ge=0)
    cursor_in_epoch: int = Field(ge=0)
    loss_history: list[float]
    last_loss: float | None
    current_epoch_loss_sum: float = Field(allow_inf_nan=False)
    current_epoch_items: int = Field(ge=0)
    first_epoch_loss: float | None
    best_epoch_loss: float | None
    lora_grad_norms: dict[str, GradNormStats]

    @field_validator("loss_history")
    @classmethod
    def _finite_history(cls, v: list[float]) -> list[float]:
        _all_finite("loss_history", v)
        return v

    @field_validator("last_loss", "first_epoch_loss", "best_epoch_loss")
    @classmethod
    def _finite_optional(cls, v: float | None, info) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError(f"{info.field_name} is not finite")
        return v

    def to_bytes(self) -> bytes:
        """The exact bytes of `sft_loop_state.json` (validated first)."""
        validate_loop_state(self)
        return dump_pretty_json(self.model_dump(mode="json"))


def validate_loop_state(state: SftLoopState) -> None:
    """The loop-state invariants (docs/checkpoints.md#loop-state); raises `CheckpointError` naming the field."""
    what = LOOP_STATE_FILE
    if len(state.loss_history) != state.global_step:
        raise CheckpointError(
            f"{what}: loss_history has {len(state.loss_history)} entries, global_step is {state.global_step}"
        )
    if state.loss_history:
        if state.last_loss is None or _bits(state.last_loss) != _bits(state.loss_history[-1]):
            raise CheckpointError(
                f"{what}: last_loss {state.last_loss!r} is not the last loss_history entry "
                f"{state.loss_history[-1]!r}"
            )
    elif state.last_loss is not None:
        raise CheckpointError(f"{what}: last_loss must be null before the first step")
    if state.current_epoch_items != state.cursor_in_epoch:
        raise CheckpointError(
            f"{what}: current_epoch_items {state.current_epoch_items} differs from cursor_in_epoch "
            f"{state.cursor_in_epoch}"
        )
    if state.cursor_in_epoch == 0 and state.current_epoch_loss_sum != 0.0:
        raise CheckpointError(
            f"{what}: current_epoch_loss_sum {state.current_epoch_loss_sum!r} must be 0 at cursor 0"
        )
    if state.cursor_in_epoch > state.global_step:
        raise CheckpointError(
            f"{what}: cursor_in_epoch {state.cursor_in_epoch} exceeds global_step {state.global_step}"
        )
    for name in ("first_epoch_loss", "best_epoch_loss"):
        present = getattr(state, name) is not None
        if present != (state.epoch_index > 0):
            raise CheckpointError(
                f"{what}: {name} must be {'present' if state.epoch_index > 0 else 'null'} at epoch_index "
                f"{state.epoch_index}"
            )
    if state.epoch_index > 0 and state.best_epoch_loss > state.first_epoch_loss:
        raise CheckpointError(
            f"{what}: best_epoch_loss {state.best_epoch_loss!r} exceeds first_epoch_loss {state.first_epoch_loss!r}"
        )
    for module, stats in state.lora_grad_norms.items():
        if not module:
            raise CheckpointError(f"{what}: lora_grad_norms has an empty module name")
        if stats.min > stats.max:
            raise CheckpointError(f"{what}: lora_grad_norms[{module!r}].min exceeds max")


def parse_loop_state(data: bytes) -> SftLoopState:
    """Strict JSON, typed shape and invariants of `sft_loop_state.json`."""
    raw = load_strict_json(data, LOOP_STATE_FILE)
    try:
        state = SftLoopState.model_validate(raw)
    except ValidationError as exc:
        raise CheckpointError(describe_model_error(LOOP_STATE_FILE, exc)) from None
    validate_loop_state(state)
    return state


def _running_sum(values: list[float]) -> float:
    """The loop's own accumulation: `0.0 + v0 + v1 + ...`, left to right."""
    total = 0.0
    for v in values:
        total += v
    return total


def check_loop_state_progress(state: SftLoopState, progress: Progress) -> None:
    """The loop state and the manifest must describe the same point of the run.

    While the run is unfinished the manifest's data order gives the rows per epoch `n`, and the
    epoch statistics are then exactly what the loop derives from the loss history: the running
    sum of this epoch's losses, and the first and best completed-epoch means (running sum / n).
    """
    for name in ("global_step", "epoch_index", "cursor_in_epoch"):
        ours, theirs = getattr(state, name), getattr(progress, name)
        if ours != theirs:
            raise CheckpointError(f"{LOOP_STATE_FILE}: {name} {ours} differs from progress.{name} {theirs}")
    n = len(progress.data_order)
    if n == 0 or state.epoch_index * n + state.cursor_in_epoch != state.global_step:
        return  # finished, or inconsistent progress (the manifest rules name that)
    history = state.loss_history
    running = _running_sum(history[state.global_step - state.cursor_in_epoch :])
    if _bits(running) != _bits(state.current_epoch_loss_sum):
        raise CheckpointError(
            f"{LOOP_STATE_FILE}: current_epoch_loss_sum {state.current_epoch_loss_sum!r} is not the sum of "
            f"this epoch's {state.cursor_in_epoch} loss_history entries {running!r}"
        )
    means = [_running_sum(history[e * n : (e + 1) * n]) / n for e in range(state.epoch_index)]
    for name, expected in (
        ("first_epoch_loss", means[:1]),
        ("best_epoch_loss", [min(means)] if means else []),
    ):
        value = getattr(state, name)
        if expected and _bits(value) != _bits(expected[0]):
            raise CheckpointError(
                f"{LOOP_STATE_FILE}: {name} {value!r} is not the epoch mean {expected[0]!r} the loss_history gives"
            )
