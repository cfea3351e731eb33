"""Admission's writes: the pinned plan, the queued job and its first event in one transaction
(docs/ARCHITECTURE.md#the-path-of-one-job, step 10), the Idempotency-Key lookup, and the
publish mark.

The job row is committed before the Celery message is published, so a lost message loses no job;
`published_at` stays null until the api (or the reconciler) has published it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import exc, func, select, update
from sqlalchemy.orm import Session

from kiln.store import states
from kiln.store.errors import IdempotencyKeyTaken
from kiln.store.events import append_event
from kiln.store.models import QUEUE_SEQ, Admission, Job, store_now

# Columns only the store sets: admission may not choose them.
_STORE_OWNED = frozenset(
    {
        "state",
        "queue_seq",
        "published_at",
        "started_at",
        "finished_at",
        "deleted_at",
        "attempts",
        "worker_id",
        "lease_expires_at",
        "heartbeat_at",
        "cancel_requested",
        "cancel_requested_at",
        "failure_reason",
        "error_code",
        "error_message",
        "final_loss",
        "receipt",
    }
)


def new_job_id() -> str:
    """A fresh job id: UUID4 text (docs/ARCHITECTURE.md#job-states)."""
    return str(uuid.uuid4())


def next_queue_seq(session: Session) -> int:
    """The next admission-order number (Postgres sequence; SQLite max + 1 under its write lock)."""
    if session.get_bind().dialect.name == "postgresql":
        return int(session.execute(select(QUEUE_SEQ.next_value())).scalar_one())
    return int(session.execute(select(func.coalesce(func.max(Job.queue_seq), 0) + 1)).scalar_one())


def insert_admitted_job(
    session: Session,
    job_fields: Mapping[str, Any],
    admission_fields: Mapping[str, Any],
    first_event: Mapping[str, Any] | None = None,
) -> Job:
    """Write the pinned admission, the queued job and its first event (docs/ARCHITECTURE.md#pinning).

    `job_fields` are `training_jobs` columns (an `id` is drawn when absent); `admission_fields`
    are `prepared_sft_admissions` columns; `first_event` holds `kind`, `message`, `level`,
    `data` (default: a `queued` event). Raises `IdempotencyKeyTaken` when another job holds
    the key; the caller's transaction stays usable (the insert ran in a savepoint).
    """
    owned = _STORE_OWNED & set(job_fields)
    if owned:
        raise ValueError(f"admission may not set store-owned job columns: {sorted(owned)}")
    now = store_now(session)
    fields = dict(job_fields)
    job_id = fields.pop("id", None) or new_job_id()
    fields.setdefault("submitted_at", now)
    job = Job(
        id=job_id,
        state=states.QUEUED,
        queue_seq=next_queue_seq(session),
        attempts=0,
        global_step=fields.pop("global_step", 0),
        cancel_requested=False,
        **fields,
    )
    admission = Admission(job_id=job_id, **{"created_at": now, **admission_fields})
    try:
        with session.begin_nested():
            session.add(job)
            session.flush()
            session.add(admission)
            session.flush()
    except exc.IntegrityError as error:
        key = fields.get("idempotency_key")
        if key is not None and "idempotency_key" in str(error.orig):
            raise IdempotencyKeyTaken(key) from error
        raise
    event = dict(first_event or {"kind": states.EVENT_QUEUED, "message": "admitted and queued"})
    append_event(
        session,
        job_id,
        event.pop("kind"),
        event.pop("message", ""),
        level=event.pop("level", states.LEVEL_INFO),
        data=event.pop("data", None),
    )
    if event:
        raise ValueError(f"unknown first_event keys: {sorted(event)}")
    return job


def find_by_idempotency_key(session: Session, key: str) -> Job | None:
    """The job admitted under this Idempotency-Key, deleted or not (the key stays spent)."""
    return session.scalars(select(Job).where(Job.idempotency_key == key)).one_or_none()


def mark_published(session: Session, job_id: str, now: datetime | None = None) -> bool:
    """Record that the Celery message went out; False when it was already recorded."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.published_at.is_(None))
        .values(published_at=now or store_now(session))
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1
