"""Segment planning: how many gradient-checkpoint segments a request (or each row) runs with,
chosen as the fewest whose bound fits the budget, and the largest LoRA rank that fits.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Unpack

from kiln_train.errors import invalid_request
from kiln_train.ground.backend import FULL_LOGITS, Backend
from kiln_train.model.config import Qwen35Config
from kiln_train.plan.memory import Breakdown, Pricing, estimate, forward_estimate
from kiln_train.plan.optimizer_support import rank_range
from kiln_train.plan.refusal import validation_will_not_fit, will_not_fit


@dataclass(frozen=True)
class SegmentPlan:
    """The admitted checkpoint plan: how many segments, and the breakdown that fits."""

    num_segments: int
    breakdown: Breakdown
    available_bytes: int


def candidate_segments(config: Qwen35Config, loss_route: str) -> range:
    """Segment counts automatic planning may try: 1 for `full_logits`, else 1..=num_layers."""
    return range(1, 2) if loss_route == FULL_LOGITS else range(1, config.num_hidden_layers + 1)


def segment_counts(config: Qwen35Config, loss_route: str, requested: int | None) -> list[int]:
    """The counts admission tries, in order: the requested one alone, else every candidate."""
    return [requested] if requested is not None else list(candidate_segments(config, loss_route))


def check_segment_request(config: Qwen35Config, loss_route: str, requested: int | None) -> None:
    """Reject an explicit segment count the route or the model cannot honour (400)."""
    if requested is None:
        return
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise invalid_request(
            f"config.grad_checkpoint_segments must be a positive integer, got {requested!r}"
        )
    if loss_route == FULL_LOGITS and requested > 1:
        raise invalid_request(
            f"config.grad_checkpoint_segments={requested} is not allowed on the full_logits loss route: "
            "checkpoint tails run outside the active tape, so full_logits is a one-segment plan"
        )
    if requested > config.num_hidden_layers:
        raise invalid_request(
            f"config.grad_checkpoint_segments={requested} exceeds the model's "
            f"{config.num_hidden_layers} layers"
        )


def plan_segments(
    config: Qwen35Config,
    *,
    max_seq_len: int,
    max_supervised_tokens: int,
    available_bytes: int,
    requested_segments: int | None = None,
    **pricing: Unpack[Pricing],
) -> SegmentPlan:
    """Admit the first plan whose complete bound fits, or raise 400/413 (docs/memory.md#segment-planning).

    An explicit `requested_segments` is honoured as is (413 when it does not fit); otherwise
    1 segment is tried, then 2..=num_layers (never more than 1 for `full_logits`).
    """
    check_segment_request(config, pricing["loss_route"], requested_segments)
    counts = segment_counts(config, pricing["loss_route"], requested_segments)
    sizes = {"max_seq_len": max_seq_len, "max_supervised_tokens": max_supervised_tokens}
    breakdown = None
    for s in counts:
        breakdown = estimate(config, num_segments=s, **sizes, **pricing)
        if breakdown.fits(available_bytes):
            return SegmentPlan(s, breakdown, available_bytes)
    ceiling = admissible_rank_ceiling(
        config,
        max_rank_that_fits(
            config,
            available_bytes=available_bytes,
            requested_segments=requested_segments,
            **sizes,
            **{k: v for k, v in pricing.items() if k != "lora_rank"},
        ),
        optimizer_kind=pricing["optimizer_kind"],
        backend=pricing["backend"],
    )
    raise will_not_fit(breakdown, available_bytes, rank_ceiling=ceiling, tried=counts)


def plan_validation_forward(
    config: Qwen35Config,
    *,
    max_seq_len: int,
    max_supervised_tokens: int,
    available_bytes: int,
    **pricing: Unpack[Pricing],
) -> Breakdown:
    """The working set of a validation forward over the longest validation row (no gradient;
    `memory.forward_estimate`), or the 413 `training_will_not_fit` naming the validation forward.

    Admission admits `max(training plan, validation forward)`: held-out rows longer than every
    training row can need more than a training step without a backward."""
    breakdown = forward_estimate(
        config, max_seq_len=max_seq_len, max_supervised_tokens=max_supervised_tokens, **pricing
    )
    if not breakdown.fits(available_bytes):
        raise validation_will_not_fit(breakdown, available_bytes)
    return breakdown


def row_segments(
    plan: dict, seq_len: int, supervised: int, estimate_fits: Callable[[int, int, int], bool]
) -> int:
    """Segments for one row: the smallest count within the pinned plan whose bound fits.

    `plan` is a pinned checkpoint plan `{max_segments, auto, budget_bytes}`; a plan that is not
    auto (or has no budget) runs every row with `max_segments`. `estimate_fits(seq_len,
    supervised, segments)` says whether that row's bound fits the plan's budget.
    """
    max_s = int(plan.get("max_segments", 1))
    if not plan.get("auto", False) or plan.get("budget_bytes") is None:
        return max_s
    for s in range(1, max_s + 1):
        if estimate_fits(seq_len, supervised, s):
            return s
    return max_s


def check_row_plan_fits(
    config: Qwen35Config,
    rows: Iterable[tuple[int, int]],
    plan: dict,
    *,
    available_bytes: int,
    **pricing: Unpack[Pricing],
) -> Breakdown | None:
    """Re-admit a pinned per-row plan (a resume's) against today's budget: each row's bound with
    the segments the plan gives it must fit `available_bytes`; raises 413 for the worst row that
    does not. `rows` are `(seq_len, supervised_tokens)`. Returns the largest row bound (None for
    no rows)."""
    budget = plan.get("budget_bytes")

    def bound(seq_len: int, supervised: int, segments: int) -> Breakdown:
        return estimate(
            config, max_seq_len=seq_len, max_supervised_tokens=supervised, num_segments=segments, **pricing
        )

    worst: tuple[Breakdown, int, int, int] | None = None
    for seq_len, supervised in sorted(set(rows)):
        s = row_segments(plan, seq_len, supervised, lambda t, a, k: bound(t, a, k).fits(int(budget)))
        b = bound(seq_len, supervised, s)
        if worst is None or b.total > worst[0].total:
            worst = (b, seq_len, supervised, s)
    if worst is None:
        return None
    breakdown, seq_len, supervised, s = worst
    if not breakdown.fits(available_bytes):
        # plan_segments raises the contract's 413 (breakdown, advice, rank ceiling) for that row.
        plan_segments(
            config,
            max_seq_len=seq_len,
            max_supervised_tokens=supervised,
            available_bytes=available_bytes,
            requested_segments=s,
            **pricing,
        )
    return breakdown


def admissible_rank_ceiling(
    config: Qwen35Config, resource_ceiling: int, *, optimizer_kind: str, backend: Backend
) -> int:
    """The rank the 413 may advise: the memory ceiling clamped to the optimizer tuple's static range.

    A rank above the backend's ceiling (CUDA Muon: 48) or below the optimizer's minimum (Muon: 2)
    would be rejected with 400 before memory is even priced, so it is never advised; 0 = none.
    """
    ranks = rank_range(backend, config, optimizer_kind)
    ceiling = min(resource_ceiling, ranks["maximum"])
    return ceiling if ceiling >= ranks["minimum"] else 0


def max_rank_that_fits(
    config: Qwen35Config,
    *,
    max_seq_len: int,
    max_supervised_tokens: int,
    optimizer_kind: str,
    loss_route: str,
    backend: Backend,
    weights_resident: bool,
    available_bytes: int,
    requested_segments: int | None = None,
) -> int:
    """The largest LoRA rank that fits: min(model ceiling, resource ceiling); 0 when none does.

    The resource ceiling searches the same segment plans admission would try; the estimate grows
    with rank, so a bisection over 1..=model ceiling finds it.
    """
    counts = segment_counts(config, loss_route, requested_segments)

    def fits(rank: int) -> bool:
        return any(
            estimate(
                config,
                max_seq_len=max_seq_len,
                max_supervised_tokens=max_supervised_tokens,
                lora_rank=rank,
                optimizer_kind=optimizer_kind,
                num_segments=s,
                loss_route=loss_route,
                backend=backend,
                weights_resident=weights_resident,
            ).fits(available_bytes)
            for s in counts
        )

    low, high = 0, config.model_maximum_rank()
    while low < high:  # invariant: every rank <= low fits (rank 0 trivially)
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
