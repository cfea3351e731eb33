"""Job reads and state transitions: claim, progress, finish, cancel, delete.

docs/ARCHITECTURE.md#job-states: `queued → running → completed | failed`; the row is
the truth and every transition is one conditional UPDATE, so two actors racing for the same
job (a redelivered message, a cancel against a claim, the reconciler against a late heartbeat)
never both win. Each transition writes its event in the same transaction.

Functions never commit; the caller owns the transaction (see kiln.store.engine).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import false, func, literal, select, update
from sqlalchemy.orm import Session

from kiln.store import states
from kiln.store.errors import (
    TRAINING_JOB_ALREADY_STARTED,
    TRAINING_JOB_NOT_CANCELLABLE,
    TRAINING_JOB_NOT_FOUND,
    InvalidTransition,
    LeaseLost,
)
from kiln.store.events import append_event
from kiln.store.models import Admission, Job, TrainingStep, UtcDateTime, store_now
from kiln_train.errors import KilnError

CANCELLED = "cancelled"
CANCELLING = "cancelling"
JOB_ID_MAX = Job.__table__.c.id.type.length


def _at(now: datetime) -> Any:
    """`now` as a bound value typed like the timestamp columns (so SQLite stores it as UTC text)."""
    return literal(now, UtcDateTime())


def possible_job_id(job_id: str) -> bool:
    """Whether `job_id` could name a row at all (1..=64 characters, no NUL: Postgres refuses NUL in
    a query parameter outright). Anything else is simply not found, without asking the database."""
    return 0 < len(job_id) <= JOB_ID_MAX and "\0" not in job_id


def get_job(session: Session, job_id: str, *, include_deleted: bool = False) -> Job | None:
    """The job as the database holds it now (None when absent or soft-deleted)."""
    if not possible_job_id(job_id):
        return None
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or (job.deleted_at is not None and not include_deleted):
        return None
    return job


def reread_job(session: Session, job_id: str) -> Job:
    """The job a transition of this transaction has just matched and written, read back."""
    job = get_job(session, job_id, include_deleted=True)
    assert job is not None, job_id
    return job


def get_admission(session: Session, job_id: str) -> Admission | None:
    """The pinned admission the worker re-verifies at dequeue."""
    return session.get(Admission, job_id)


def require_job(session: Session, job_id: str) -> Job:
    """The job, or KilnError `training_job_not_found`."""
    job = get_job(session, job_id)
    if job is None:
        raise KilnError(TRAINING_JOB_NOT_FOUND, f"no training job {job_id!r}")
    return job


def list_jobs(session: Session, *, state: str | None = None, include_deleted: bool = False) -> list[Job]:
    """Jobs in admission order, optionally of one state."""
    query = select(Job)
    if state is not None:
        query = query.where(Job.state == state)
    if not include_deleted:
        query = query.where(Job.deleted_at.is_(None))
    return list(session.scalars(query.order_by(Job.queue_seq)))


def claim_job(session: Session, job_id: str, worker_id: str, lease_seconds: float) -> Job | None:
    """Take a queued job for `worker_id` with a lease (docs/recovery.md#leases); None when not claimable.

    One conditional UPDATE: a redelivered duplicate, a job already running elsewhere, a
    cancelled one or a finished one all see zero rows and get None. A job the reconciler put
    back to `queued` for a resume (resume_checkpoint set) is claimed the same way.
    """
    now = store_now(session)
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == states.QUEUED, Job.cancel_requested == false())
        .values(
            state=states.RUNNING,
            worker_id=worker_id,
            lease_expires_at=now + timedelta(seconds=lease_seconds),
            heartbeat_at=now,
            attempts=Job.attempts + 1,
            started_at=func.coalesce(Job.started_at, _at(now)),
        )
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return None
    job = get_job(session, job_id)
    assert job is not None
    start = job.global_step or 0
    append_event(
        session,
        job_id,
        states.EVENT_STARTED,
        f"claimed by {worker_id}: attempt {job.attempts}, starting at step {start}"
        + (f" from {job.resume_checkpoint}" if job.resume_checkpoint else ""),
        data={
            "worker_id": worker_id,
            "attempt": job.attempts,
            "start_step": start,
            "resume_checkpoint": job.resume_checkpoint,
        },
    )
    return job


def renew_lease(
    session: Session, job_id: str, worker_id: str, lease_seconds: float, *, attempt: int | None = None
) -> bool:
    """Extend the worker's lease and heartbeat; returns whether a cancel was requested.

    Raises `LeaseLost` when the job is no longer running under this worker (and, with `attempt`,
    under that claim of it: the fence, see `require_owner`).
    """
    now = store_now(session)
    return _touch_running(
        session,
        job_id,
        worker_id,
        {"heartbeat_at": now, "lease_expires_at": now + timedelta(seconds=lease_seconds)},
        attempt,
    )


def require_owner(session: Session, job_id: str, worker_id: str, attempt: int) -> None:
    """The fence: raise `LeaseLost` unless the job is running under `worker_id`'s claim number
    `attempt` (each claim increments `attempts`, so a stale owner's claim never matches again).
    Checked in the transaction of every write a run makes, so a stale run's write never commits."""
    held = session.execute(
        select(Job.id).where(
            Job.id == job_id, Job.state == states.RUNNING, Job.worker_id == worker_id, Job.attempts == attempt
        )
    ).first()
    if held is None:
        raise LeaseLost(job_id, worker_id)


def record_step(
    session: Session,
    job_id: str,
    worker_id: str,
    *,
    global_step: int,
    epoch: int,
    loss: float,
    learning_rate: float,
    step_ms: float,
    tokens: int,
    supervised_tokens: int,
    lease_seconds: float | None = None,
    attempt: int | None = None,
) -> bool:
    """Store one optimizer step (the loss curve) and the job's progress and heartbeat.

    Extends the lease too when `lease_seconds` is given. Returns whether a cancel was requested
    (the trainer checks it each step); raises `LeaseLost` when the worker no longer owns the job.
    """
    now = store_now(session)
    values: dict[str, Any] = {
        "global_step": global_step,
        "current_epoch": epoch,
        "current_loss": loss,
        "heartbeat_at": now,
    }
    if lease_seconds is not None:
        values["lease_expires_at"] = now + timedelta(seconds=lease_seconds)
    cancel_requested = _touch_running(session, job_id, worker_id, values, attempt)
    session.add(
        TrainingStep(
            job_id=job_id,
            global_step=global_step,
            epoch=epoch,
            loss=loss,
            learning_rate=learning_rate,
            step_ms=step_ms,
            tokens=tokens,
            supervised_tokens=supervised_tokens,
            created_at=now,
        )
    )
    session.flush()
    return cancel_requested


def step_recorded(session: Session, job_id: str, global_step: int) -> bool:
    """Whether the loss curve already holds this step (a retried write whose commit went through)."""
    return session.get(TrainingStep, (job_id, global_step)) is not None


def _touch_running(
    session: Session, job_id: str, worker_id: str, values: dict[str, Any], attempt: int | None = None
) -> bool:
    conditions = [Job.id == job_id, Job.state == states.RUNNING, Job.worker_id == worker_id]
    if attempt is not None:
        conditions.append(Job.attempts == attempt)
    row = session.execute(
        update(Job)
        .where(*conditions)
        .values(**values)
        .returning(Job.cancel_requested)
        .execution_options(synchronize_session=False)
    ).first()
    if row is None:
        raise LeaseLost(job_id, worker_id)
    return bool(row[0])


def is_cancel_requested(session: Session, job_id: str) -> bool:
    """Whether someone asked the job to stop (the cooperative cancel flag)."""
    flag = session.execute(select(Job.cancel_requested).where(Job.id == job_id)).scalar_one_or_none()
    return bool(flag)


def finish_job(
    session: Session,
    job_id: str,
    state: str,
    *,
    worker_id: str | None = None,
    attempt: int | None = None,
    failure_reason: str | None = None,
    error_code: str | None = None,
    error_message: str | None = None,
    final_loss: float | None = None,
    global_step: int | None = None,
    adapter_path: str | None = None,
    latest_checkpoint: str | None = None,
    receipt: dict[str, Any] | None = None,
    peak_memory_bytes: int | None = None,
    wall_clock_ms: int | None = None,
) -> Job:
    """End a running job `completed` or `failed` (with a failure reason); guarded on `running`.

    With `worker_id` (and `attempt`), only that worker's run (that claim of the job) may be
    finished (`LeaseLost` otherwise). Finishing
    a job that is not running raises `InvalidTransition`. Fields left None keep their value.
    """
    if state == states.COMPLETED and failure_reason is not None:
        raise ValueError("a completed job has no failure_reason")
    if state == states.FAILED and not failure_reason:
        raise ValueError("a failed job needs a failure_reason")
    if state not in states.TERMINAL_STATES:
        raise ValueError(f"finish_job ends a job completed or failed, not {state!r}")
    now = store_now(session)
    optional = {
        "failure_reason": failure_reason,
        "error_code": error_code,
        "error_message": error_message,
        "final_loss": final_loss,
        "global_step": global_step,
        "adapter_path": adapter_path,
        "latest_checkpoint": latest_checkpoint,
        "receipt": receipt,
        "peak_memory_bytes": peak_memory_bytes,
        "wall_clock_ms": wall_clock_ms,
    }
    values = {k: v for k, v in optional.items() if v is not None}
    conditions = [Job.id == job_id, Job.state == states.RUNNING]
    if worker_id is not None:
        conditions.append(Job.worker_id == worker_id)
    if attempt is not None:
        conditions.append(Job.attempts == attempt)
    result = session.execute(
        update(Job)
        .where(*conditions)
        .values(state=state, finished_at=now, lease_expires_at=None, **values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        current = get_job(session, job_id, include_deleted=True)
        if worker_id is not None and current is not None and current.state == states.RUNNING:
            raise LeaseLost(job_id, worker_id)
        raise InvalidTransition(job_id, f"finish as {state}", current.state if current else None)
    if state == states.COMPLETED:
        append_event(session, job_id, states.EVENT_COMPLETED, "training completed")
    else:
        kind = states.EVENT_CANCELLED if failure_reason == states.REASON_CANCELLED else states.EVENT_FAILED
        append_event(
            session,
            job_id,
            kind,
            error_message or failure_reason or "",
            level=states.LEVEL_ERROR if kind == states.EVENT_FAILED else states.LEVEL_INFO,
            data={"failure_reason": failure_reason, "error_code": error_code},
        )
    return reread_job(session, job_id)


def request_cancel(session: Session, job_id: str) -> str:
    """Cancel a job (docs/ARCHITECTURE.md#job-states): returns "cancelled" or "cancelling".

    queued → failed with failure_reason `cancelled` at once ("cancelled"); running → the
    cooperative flag is set and the trainer stops at the next step boundary ("cancelling").
    Raises KilnError `training_job_not_found`, `training_job_not_cancellable` (terminal) or
    `training_job_already_started` (a worker claimed the job between our read and our write).
    """
    observed = None
    if possible_job_id(job_id):
        observed = session.execute(
            select(Job.state).where(Job.id == job_id, Job.deleted_at.is_(None))
        ).scalar_one_or_none()
    if observed is None:
        raise KilnError(TRAINING_JOB_NOT_FOUND, f"no training job {job_id!r}")
    now = store_now(session)
    if observed == states.QUEUED:
        message = "cancelled before it started"
        result = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.state == states.QUEUED)
            .values(
                state=states.FAILED,
                failure_reason=states.REASON_CANCELLED,
                error_message=message,
                finished_at=now,
                cancel_requested=True,
                cancel_requested_at=now,
            )
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:
            raise KilnError(TRAINING_JOB_ALREADY_STARTED, f"training job {job_id!r} left the queue")
        append_event(
            session, job_id, states.EVENT_CANCELLED, message, data={"failure_reason": states.REASON_CANCELLED}
        )
        return CANCELLED
    if observed == states.RUNNING:
        result = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.state == states.RUNNING)
            .values(
                cancel_requested=True, cancel_requested_at=func.coalesce(Job.cancel_requested_at, _at(now))
            )
            .execution_options(synchronize_session=False)
        )
        if result.rowcount != 1:
            raise KilnError(TRAINING_JOB_NOT_CANCELLABLE, f"training job {job_id!r} already finished")
        append_event(
            session,
            job_id,
            states.EVENT_CANCEL_REQUESTED,
            "stop requested — the trainer aborts at the next step boundary",
        )
        return CANCELLING
    raise KilnError(TRAINING_JOB_NOT_CANCELLABLE, f"training job {job_id!r} is {observed}")


def delete_job(session: Session, job_id: str) -> Job:
    """Soft-delete a terminal job (DELETE /v1/train/jobs/{id}); its rows stay for SQL history."""
    require_job(session, job_id)
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state.in_(states.TERMINAL_STATES), Job.deleted_at.is_(None))
        .values(deleted_at=store_now(session))
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        # Re-read: a concurrent DELETE that committed first makes this one "not found" (not a
        # 409 naming the terminal state we read before it won); otherwise the job is active.
        current = get_job(session, job_id, include_deleted=True)
        if current is None or current.deleted_at is not None:
            raise KilnError(TRAINING_JOB_NOT_FOUND, f"no training job {job_id!r}")
        raise InvalidTransition(job_id, "delete", current.state)
    append_event(session, job_id, states.EVENT_DELETED, "job deleted")
    return reread_job(session, job_id)
