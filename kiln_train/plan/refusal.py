"""The 413 `training_will_not_fit`: the one-line message with the estimate's breakdown and the
advice of what to change. Torch-free.
"""

from __future__ import annotations

from kiln_train.errors import TRAINING_WILL_NOT_FIT, KilnError
from kiln_train.ground.backend import FULL_LOGITS
from kiln_train.plan.memory import GIB, Breakdown, saturate


def _gb(n: int) -> str:
    return f"{n / GIB:.2f}"


def will_not_fit_message(
    breakdown: Breakdown,
    available_bytes: int,
    *,
    rank_ceiling: int,
    tried: list[int] | None = None,
    what: str = "training step",
) -> str:
    """The one-line `training_will_not_fit` message plus the advice (docs/memory.md#the-413)."""
    return f"{_head(breakdown, available_bytes, what)} {advice(breakdown, rank_ceiling=rank_ceiling, tried=tried)}"


def _head(breakdown: Breakdown, available_bytes: int, what: str) -> str:
    b = breakdown
    return (
        f"Estimated {what} working set is {_gb(b.total)} GB but only {_gb(available_bytes)} GB "
        f"is available. Breakdown: weights {_gb(b.base_weights)} GB, activations {_gb(b.activations)} GB "
        f"(max_seq_len={b.max_seq_len}, num_segments={b.num_segments}), loss workspace "
        f"{_gb(b.loss_workspace)} GB (route={b.loss_route}), LoRA params+grads {_gb(b.lora_param_grad)} GB, "
        f"optimizer state {_gb(b.lora_optimizer_state)} GB, residency scratch {_gb(b.residency_scratch)} GB "
        f"(lora_rank={b.lora_rank})."
    )


def dominant_component(breakdown: Breakdown) -> str:
    """Which part of the request the estimate mostly pays for: weights, sequence, loss or rank."""
    b = breakdown
    parts = {
        "weights": b.base_weights,
        "sequence": b.activations,
        "loss": b.loss_workspace,
        "rank": saturate(b.lora_param_grad + b.lora_optimizer_state + b.residency_scratch),
    }
    return max(parts, key=lambda k: parts[k])


def advice(breakdown: Breakdown, *, rank_ceiling: int, tried: list[int] | None = None) -> str:
    b = breakdown
    cause = dominant_component(b)
    if cause == "rank":
        rank_part = saturate(b.lora_param_grad + b.lora_optimizer_state + b.residency_scratch)
        first = (
            f"LoRA rank dominates: lora_rank={b.lora_rank} needs {_gb(rank_part)} GB for LoRA params, "
            f"gradients, {b.optimizer_kind} state and scratch; shrink lora_rank."
        )
    elif cause == "sequence":
        first = (
            f"Sequence length dominates: activations for max_seq_len={b.max_seq_len} need "
            f"{_gb(b.activations)} GB even at num_segments={b.num_segments}; send shorter examples."
        )
    elif cause == "loss":
        first = (
            f"The loss workspace dominates: route={b.loss_route} needs {_gb(b.loss_workspace)} GB for "
            f"max_seq_len={b.max_seq_len} with {b.max_supervised_tokens} supervised tokens; send shorter "
            "examples or fewer supervised tokens."
        )
    else:
        first = (
            f"General capacity: the base weights alone need {_gb(b.base_weights)} GB; free device memory "
            "or raise [memory].training_memory_gb."
        )
    if tried and len(tried) > 1:
        checkpointing = (
            f"Dynamic gradient checkpointing was already tried (num_segments {tried[0]}..={tried[-1]})."
        )
    elif b.loss_route == FULL_LOGITS:
        checkpointing = "The full_logits loss route allows a single checkpoint segment only."
    else:
        checkpointing = f"The requested grad_checkpoint_segments={b.num_segments} was honoured as given."
    if rank_ceiling > 0:
        ceiling = f"The largest lora_rank that fits this request is {rank_ceiling}."
    else:
        ceiling = "No lora_rank fits this request; send shorter examples or free memory."
    return f"{first} {checkpointing} {ceiling}"


def will_not_fit(
    breakdown: Breakdown, available_bytes: int, *, rank_ceiling: int, tried: list[int] | None = None
) -> KilnError:
    """The 413 error: code `training_will_not_fit`, message per docs/memory.md#the-413."""
    error = KilnError(
        TRAINING_WILL_NOT_FIT,
        will_not_fit_message(breakdown, available_bytes, rank_ceiling=rank_ceiling, tried=tried),
    )
    # The numbers ride along in bytes (with the budget) for clients that draw them.
    error.breakdown = {**breakdown.to_dict(), "available_bytes": available_bytes}
    return error


def validation_will_not_fit(breakdown: Breakdown, available_bytes: int) -> KilnError:
    """The 413 for held-out validation rows whose forward (no gradient) does not fit although the
    training rows do: the same message shape, naming the validation forward and what to change."""
    b = breakdown
    message = (
        f"{_head(b, available_bytes, 'validation forward')} The longest validation row "
        f"(max_seq_len={b.max_seq_len}, {b.max_supervised_tokens} supervised tokens) does not fit even "
        "without a gradient; send shorter validation examples, fewer supervised tokens per validation "
        "row, or free device memory."
    )
    error = KilnError(TRAINING_WILL_NOT_FIT, message)
    error.breakdown = {**b.to_dict(), "available_bytes": available_bytes, "phase": "validation_forward"}
    return error
