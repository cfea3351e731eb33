"""Whether a lost attempt moved its job on, and so whether it counts against max_attempts
(docs/recovery.md#attempts-that-make-progress).

An attempt advanced the job when it left a newer checkpoint than the one it started from, or
recorded a step further than any attempt before it reached. Dying between checkpoints at the
same step again and again is not progress (every retry would only redo the same steps), so such
a job still fails `worker_lost` once `training.max_attempts` deliveries in all ended without
progress, with a message that says where it kept stopping.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.store import furthest_step, stalled_deliveries


@dataclass(frozen=True)
class Settlement:
    record: dict  # the progress record of the `requeued` / `worker_lost` event
    note: str  # what the event's message adds about this attempt
    retry: bool  # whether the limit still allows another attempt
    give_up: str  # the failure message's reason when it does not


def settle_attempt(
    *,
    attempt: int,
    releases: int,
    start_step: int,
    reached_step: int,
    checkpoint_step: int | None,
    pinned_start: int,
    history: list[dict],
    max_attempts: int,
    released: bool = False,
) -> Settlement:
    """The record of lost attempt `attempt` (the job's `attempts`), which started at
    `start_step`, recorded steps up to `reached_step` and left its newest usable checkpoint at
    `checkpoint_step` (None: none past where the job began). A `released` attempt (a graceful
    release at a checkpoint) is already forgiven as a release and is not counted again."""
    furthest = furthest_step(history, max(pinned_start, start_step))
    new_checkpoint = checkpoint_step is not None and checkpoint_step > start_step
    advanced = (reached_step > furthest or new_checkpoint) and not released
    stalled = stalled_deliveries(attempt, releases, history) - (1 if advanced else 0)
    record = {
        "attempt": attempt,
        "start_step": start_step,
        "reached_step": reached_step,
        "checkpoint_step": checkpoint_step,
        "advanced": advanced,
        "released": released,
        "stalled_attempts": stalled,
    }
    if released:
        note = f"attempt {attempt} was released at a checkpoint at step {reached_step} (not counted)"
    elif advanced:
        note = (
            f"attempt {attempt} advanced from step {start_step} to step {reached_step}, so it does not count "
            f"against training.max_attempts ({stalled} of {max_attempts} attempts without progress)"
        )
    else:
        note = (
            f"attempt {attempt} made no progress: it stopped at step {reached_step}, no further than step "
            f"{furthest}; {stalled} of {max_attempts} attempts without progress"
        )
    give_up = (
        f"lost {stalled} attempts without progress (training.max_attempts {max_attempts}); the last, "
        f"attempt {attempt}, stopped at step {reached_step}, no further than step {furthest} reached before"
    )
    return Settlement(record=record, note=note, retry=stalled < max_attempts, give_up=give_up)


def settle_lost(lost, checkpoint_step: int | None, max_attempts: int) -> Settlement:
    """`settle_attempt` for the reconciler's `LostJob` (`worker/reconciler.py`)."""
    return settle_attempt(
        attempt=lost.attempts,
        releases=lost.releases,
        start_step=lost.start_step,
        reached_step=lost.reached_step,
        checkpoint_step=checkpoint_step,
        pinned_start=lost.pinned_start,
        history=list(lost.history),
        max_attempts=max_attempts,
        released=lost.released,
    )
