"""The queue as people see it: FIFO positions by admission order and the admission limits'
counts (`QueueResponse`, docs/ARCHITECTURE.md#job-states; `training_queue_full` /
`training_tracked_full`, docs/errors.md#codes).
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kiln.store import states
from kiln.store.jobs import list_jobs
from kiln.store.models import Job


def list_queued(session: Session) -> list[Job]:
    """Queued jobs in FIFO (admission) order."""
    return list_jobs(session, state=states.QUEUED)


def queue_positions(session: Session) -> dict[str, int]:
    """1-based FIFO position of every queued job, by admission order (docs/ARCHITECTURE.md#job-states)."""
    ids = session.scalars(
        select(Job.id).where(Job.state == states.QUEUED, Job.deleted_at.is_(None)).order_by(Job.queue_seq)
    )
    return {job_id: position for position, job_id in enumerate(ids, start=1)}


def queue_position(session: Session, job_id: str) -> int | None:
    """1-based FIFO position of one queued job; None when it is not queued."""
    seq = session.execute(
        select(Job.queue_seq).where(Job.id == job_id, Job.state == states.QUEUED)
    ).scalar_one_or_none()
    if seq is None:
        return None
    ahead = session.execute(
        select(func.count())
        .select_from(Job)
        .where(Job.state == states.QUEUED, Job.queue_seq < seq, Job.deleted_at.is_(None))
    ).scalar_one()
    return int(ahead) + 1


def count_queued(session: Session) -> int:
    """Jobs waiting in the queue (for `training_queue_full`)."""
    return int(
        session.execute(select(func.count()).select_from(Job).where(Job.state == states.QUEUED)).scalar_one()
    )


def count_tracked(session: Session) -> int:
    """Jobs not deleted, any state (for `training_tracked_full`)."""
    return int(
        session.execute(select(func.count()).select_from(Job).where(Job.deleted_at.is_(None))).scalar_one()
    )
