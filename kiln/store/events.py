"""A job's event log (`job_events`) with cursor pagination (docs/ARCHITECTURE.md#routes).

The autoincrement id is the cursor: `list_events(after_id=last_id)` returns the next page.
A cursor is only sound if a job's event ids become visible in id order. Postgres hands out ids
when the row is inserted, not when it commits, so two transactions appending to one job (the
worker's progress and an api cancel, say) could commit out of id order and a reader holding
the later id would never see the earlier one. `append_event` therefore takes the job row's
lock first: appends to one job are serialised, and ids are drawn in commit order. (SQLite has
one writer at a time already.)
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.store import states
from kiln.store.models import Job, JobEvent, store_now

MAX_EVENT_PAGE = 1000


def append_event(
    session: Session,
    job_id: str,
    kind: str,
    message: str = "",
    *,
    level: str = states.LEVEL_INFO,
    data: dict[str, Any] | None = None,
) -> JobEvent:
    """Add one event to a job's log; the returned event has its id (the cursor) assigned."""
    if level not in states.EVENT_LEVELS:
        raise ValueError(f"event level must be one of {states.EVENT_LEVELS}, got {level!r}")
    if session.get_bind().dialect.name == "postgresql":
        # Held until commit (a no-op when this transaction already updated the job row).
        session.execute(select(Job.id).where(Job.id == job_id).with_for_update())
    event = JobEvent(
        job_id=job_id, kind=kind, level=level, message=message, data=data, created_at=store_now(session)
    )
    session.add(event)
    session.flush()
    return event


def list_events(
    session: Session, job_id: str, after_id: int | None = None, limit: int = 100
) -> tuple[list[JobEvent], bool]:
    """Up to `limit` events of a job with id > `after_id`, oldest first, and whether more follow."""
    if not 1 <= limit <= MAX_EVENT_PAGE:
        raise ValueError(f"limit must be in 1..={MAX_EVENT_PAGE}, got {limit}")
    query = select(JobEvent).where(JobEvent.job_id == job_id)
    if after_id is not None:
        query = query.where(JobEvent.id > after_id)
    rows = list(session.scalars(query.order_by(JobEvent.id).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def last_event(session: Session, job_id: str) -> JobEvent | None:
    """The job's newest event."""
    query = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id.desc()).limit(1)
    return session.scalars(query).first()
