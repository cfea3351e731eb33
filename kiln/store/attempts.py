"""A job's deliveries and whether each moved it on (docs/recovery.md#attempts-that-make-progress).

Each attempt a worker loses is settled by the reconciler with a `progress` record in the data of
the `requeued` or `worker_lost` event it writes: the attempt's number, the step it started at,
the furthest step it recorded, whether it advanced the job, and how many ended deliveries so far
did not. Only those count against `training.max_attempts`: a job on a flaky or preemptible GPU that
gets further on every attempt is never failed for losing its worker. The records are the job's
own history, so nothing is counted twice and a restarted reconciler reads the same tally.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.store import states
from kiln.store.models import JobEvent

PROGRESS_KEY = "progress"
_SETTLED_KINDS = (states.EVENT_REQUEUED, states.EVENT_WORKER_LOST)


def attempt_history(session: Session, job_id: str) -> list[dict]:
    """The progress records of the job's settled lost attempts, oldest first."""
    rows = session.scalars(
        select(JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.kind.in_(_SETTLED_KINDS))
        .order_by(JobEvent.id)
    )
    return [
        dict(d[PROGRESS_KEY]) for d in rows if isinstance(d, dict) and isinstance(d.get(PROGRESS_KEY), dict)
    ]


def claim_start(session: Session, job_id: str) -> int | None:
    """The step the job's newest claim started at (its `started` event), None before any."""
    data = session.scalars(
        select(JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.kind == states.EVENT_STARTED)
        .order_by(JobEvent.id.desc())
        .limit(1)
    ).first()
    step = data.get("start_step") if isinstance(data, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def released_since_claim(session: Session, job_id: str) -> bool:
    """Whether the job's newest claim ended in a graceful release (a `requeued` event marked
    `released` after its `started` event): the worker gave it back at a checkpoint."""
    data = session.scalars(
        select(JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.kind.in_((states.EVENT_STARTED, states.EVENT_REQUEUED)))
        .order_by(JobEvent.id.desc())
        .limit(1)
    ).first()
    return isinstance(data, dict) and data.get("released") is True


def stalled_deliveries(ended: int, releases: int, history: list[dict]) -> int:
    """Of `ended` deliveries, those that count against max_attempts: all but graceful releases
    and the lost attempts recorded as having advanced the job. (A delivery settled before these
    records existed counts, as every delivery did then.)"""
    advanced = sum(1 for record in history if record.get("advanced") is True)
    return max(0, ended - releases - advanced)


def furthest_step(history: list[dict], floor: int) -> int:
    """The furthest step any recorded attempt reached, at least `floor` (where the job began)."""
    steps = [r["reached_step"] for r in history if isinstance(r.get("reached_step"), int)]
    return max([floor, *steps])
