"""What the reconciler asks of the store (docs/recovery.md#reconciler).

Two kinds of stray jobs: committed but never published (the api died between commit and
publish), and running with an expired lease (the worker died). The first are republished;
the second are put back in the queue to resume from their latest exact checkpoint, or failed
with `worker_lost`. Every transition is guarded on the state the reconciler saw, so a worker
that renews its lease at the last moment keeps its job.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, false, func, select, update
from sqlalchemy.orm import Session

from kiln.store import states
from kiln.store.admission import next_queue_seq
from kiln.store.artifacts import get_checkpoint, register_adapter
from kiln.store.attempts import PROGRESS_KEY
from kiln.store.errors import InvalidTransition
from kiln.store.events import append_event
from kiln.store.jobs import get_job, reread_job
from kiln.store.models import Checkpoint, Job, JobEvent, Runner, TrainingStep, ValidationEvaluation, store_now


def unpublished_jobs(session: Session, older_than: datetime) -> list[Job]:
    """Queued jobs whose message never went out and that were admitted before `older_than`
    (the margin keeps the reconciler from racing the api's own publish)."""
    query = select(Job).where(
        Job.state == states.QUEUED,
        Job.published_at.is_(None),
        Job.deleted_at.is_(None),
        Job.submitted_at < older_than,
    )
    return list(session.scalars(query.order_by(Job.queue_seq)))


def lost_message_jobs(session: Session, older_than: datetime) -> list[Job]:
    """Queued jobs (no cancel requested) whose message went out before `older_than` and that are
    still waiting: the reconciler of a worker idle since before `older_than` publishes them again,
    since a message in the broker would have reached it (the broker lost it: restarted without
    persistence, flushed, or the message sits unacknowledged with a worker that died)."""
    query = select(Job).where(
        Job.state == states.QUEUED,
        Job.cancel_requested == false(),
        Job.published_at.is_not(None),
        Job.published_at < older_than,
        Job.deleted_at.is_(None),
    )
    return list(session.scalars(query.order_by(Job.queue_seq)))


def restamp_published(session: Session, job_id: str, seen: datetime, now: datetime | None = None) -> bool:
    """Move a queued job's `published_at` from `seen` to now (its message is published again); False
    when another reconciler did it first or the job left the queue."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == states.QUEUED, Job.published_at == seen)
        .values(published_at=now or store_now(session))
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1


def count_graceful_releases(session: Session, job_id: str) -> int:
    """Deliveries of the job that a worker ended by a warm shutdown at a checkpoint (its
    `requeued` events marked `released`): they do not count against `max_attempts`."""
    rows = session.scalars(
        select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == states.EVENT_REQUEUED)
    )
    return sum(1 for data in rows if (data or {}).get("released") is True)


def expired_leases(
    session: Session, now: datetime | None = None, *, owner_fresh_seconds: float | None = None
) -> list[Job]:
    """Running jobs whose worker stopped renewing its lease before `now`.

    With `owner_fresh_seconds`, a job is left alone while its owner is provably alive and still
    running it: the owner's runner row names the job and beat after the lease ran out, within the
    last `owner_fresh_seconds` (a clock step or a stalled renewal is not a dead worker, and taking
    the job from a live one would run it twice). A dead worker's last heartbeat predates its last
    lease expiry, so its jobs are not held back.
    """
    now = now or store_now(session)
    query = select(Job).where(Job.state == states.RUNNING, Job.lease_expires_at < now)
    if owner_fresh_seconds is not None:
        owner_alive = (
            select(Runner.id)
            .where(
                Runner.id == Job.worker_id,
                Runner.state != states.RUNNER_STOPPED,
                Runner.current_job_id == Job.id,
                Runner.heartbeat_at > Job.lease_expires_at,
                Runner.heartbeat_at >= now - timedelta(seconds=owner_fresh_seconds),
            )
            .exists()
        )
        query = query.where(~owner_alive)
    return list(session.scalars(query.order_by(Job.queue_seq)))


def _expired_lease_update(
    session: Session, job_id: str, wanted: str, now: datetime, *conditions, **values
) -> None:
    """One guarded transition of a running job whose lease expired before `now` (and that meets
    `conditions`); InvalidTransition names the state found when the row did not match."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == states.RUNNING, Job.lease_expires_at < now, *conditions)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        current = get_job(session, job_id, include_deleted=True)
        raise InvalidTransition(job_id, wanted, current.state if current else None)


def _lost_job(session: Session, job_id: str, wanted: str) -> Job:
    """The job a reconciler transition is about to act on; InvalidTransition when it is gone."""
    job = get_job(session, job_id, include_deleted=True)
    if job is None:
        raise InvalidTransition(job_id, wanted, None)
    return job


def _requeue_expired(session: Session, job_id: str, wanted: str, now: datetime, **values) -> None:
    """Back to the queue, unowned and unpublished, at its back; `values` say where it starts
    again. A job with a cancel request is not requeued."""
    _expired_lease_update(
        session,
        job_id,
        wanted,
        now,
        Job.cancel_requested == false(),
        state=states.QUEUED,
        worker_id=None,
        lease_expires_at=None,
        heartbeat_at=None,
        published_at=None,
        queue_seq=next_queue_seq(session),
        **values,
    )


def _announce_requeue(
    session: Session, job_id: str, message: str, data: dict, progress: dict | None = None, note: str = ""
) -> Job:
    """The `requeued` event of a job put back in the queue (its attempts so far added, and the
    lost attempt's progress record, `kiln.store.attempts`)."""
    job = reread_job(session, job_id)
    extra = {PROGRESS_KEY: progress} if progress is not None else {}
    append_event(
        session,
        job_id,
        states.EVENT_REQUEUED,
        message + (f"; {note}" if note else ""),
        level=states.LEVEL_WARNING,
        data={**data, "attempts": job.attempts, **extra},
    )
    return job


def requeue_for_resume(
    session: Session,
    job_id: str,
    checkpoint: str,
    now: datetime | None = None,
    *,
    progress: dict | None = None,
    note: str = "",
) -> Job:
    """Put a job whose lease expired back in the queue, to resume from `checkpoint` (a basename
    from the job's `checkpoints` rows). Steps, validation evaluations and checkpoints recorded
    after that checkpoint are dropped (the resumed run records them again); the job gets a new
    place at the back of the queue and is unpublished until the reconciler republishes it. A job with a cancel request is not
    resumed (fail it with `fail_worker_lost`)."""
    now = now or store_now(session)
    row = get_checkpoint(session, job_id, checkpoint)
    if row is None:
        raise ValueError(f"job {job_id}: no recorded checkpoint {checkpoint!r}")
    _requeue_expired(
        session,
        job_id,
        "requeue an expired lease",
        now,
        resume_checkpoint=checkpoint,
        latest_checkpoint=checkpoint,
        global_step=row.global_step,
        current_epoch=row.epoch_index,
    )
    for table in (TrainingStep, ValidationEvaluation):
        session.execute(
            delete(table)
            .where(table.job_id == job_id, table.global_step > row.global_step)
            .execution_options(synchronize_session=False)
        )
    session.execute(
        delete(Checkpoint)
        .where(Checkpoint.job_id == job_id, Checkpoint.global_step > row.global_step)
        .execution_options(synchronize_session=False)
    )
    return _announce_requeue(
        session,
        job_id,
        f"worker lost; resuming from {checkpoint} at step {row.global_step}",
        {"checkpoint": checkpoint, "global_step": row.global_step},
        progress,
        note,
    )


def requeue_for_restart(
    session: Session,
    job_id: str,
    *,
    resume_checkpoint: str | None,
    start_step: int,
    reason: str,
    now: datetime | None = None,
    progress: dict | None = None,
    note: str = "",
) -> Job:
    """Put a job whose lease expired back in the queue to run again from where it first started:
    step 0, or the checkpoint its submission resumed (`resume_checkpoint`, at `start_step`). Its
    seed and plan are pinned, so the run computes the same bits. Every step, evaluation and checkpoint row is
    dropped (the new attempt records them again)."""
    now = now or store_now(session)
    _requeue_expired(
        session,
        job_id,
        "restart an expired lease",
        now,
        resume_checkpoint=resume_checkpoint,
        latest_checkpoint=None,
        global_step=start_step,
        current_epoch=None,
        current_loss=None,
    )
    for table in (TrainingStep, ValidationEvaluation, Checkpoint):
        session.execute(
            delete(table).where(table.job_id == job_id).execution_options(synchronize_session=False)
        )
    return _announce_requeue(
        session,
        job_id,
        f"{reason}; restarting from step {start_step}"
        + (f" ({resume_checkpoint})" if resume_checkpoint else " with the pinned seed and plan"),
        {"restart": True, "checkpoint": resume_checkpoint, "global_step": start_step},
        progress,
        note,
    )


def steps_recorded_through(session: Session, job_id: str, global_step: int) -> bool:
    """Whether the loss curve holds every step 1..=`global_step` of the job."""
    count = session.scalar(
        select(func.count())
        .select_from(TrainingStep)
        .where(TrainingStep.job_id == job_id, TrainingStep.global_step <= global_step)
    )
    return int(count or 0) == global_step


def fail_worker_lost(
    session: Session,
    job_id: str,
    now: datetime | None = None,
    *,
    progress: dict | None = None,
    note: str = "",
) -> Job:
    """Fail a job whose lease expired: `failure_reason = worker_lost`, or `cancelled` when a
    cancel had been requested (the run was going to end cancelled anyway). `note` says why it is
    not retried; `progress` is the lost attempt's record (`kiln.store.attempts`)."""
    now = now or store_now(session)
    job = _lost_job(session, job_id, "fail an expired lease")
    reason = states.REASON_CANCELLED if job.cancel_requested else states.REASON_WORKER_LOST
    message = f"worker {job.worker_id} stopped renewing its lease (expired {job.lease_expires_at})"
    message += f"; {note}" if note else ""
    _expired_lease_update(
        session,
        job_id,
        "fail an expired lease",
        now,
        state=states.FAILED,
        failure_reason=reason,
        error_message=message,
        finished_at=now,
        lease_expires_at=None,
    )
    append_event(
        session,
        job_id,
        states.EVENT_WORKER_LOST,
        message,
        level=states.LEVEL_ERROR,
        data={
            "failure_reason": reason,
            "worker_id": job.worker_id,
            **({PROGRESS_KEY: progress} if progress is not None else {}),
        },
    )
    return reread_job(session, job_id)


def complete_lost_job(
    session: Session,
    job_id: str,
    *,
    adapter_path: str,
    receipt: dict,
    size_bytes: int,
    safetensors_sha256: str,
    rank: int,
    alpha: float,
    base_model_sha256: str | None,
    now: datetime | None = None,
) -> Job:
    """Complete a job whose worker was lost after it published the adapter but before it recorded
    that: the adapter is registered and the job ends `completed` (guarded like the other
    reconciler transitions: running, lease expired)."""
    now = now or store_now(session)
    job = _lost_job(session, job_id, "complete a lost job")
    _expired_lease_update(
        session,
        job_id,
        "complete a lost job",
        now,
        state=states.COMPLETED,
        finished_at=now,
        lease_expires_at=None,
        global_step=Job.total_steps,
        adapter_path=adapter_path,
        receipt=receipt,
        final_loss=Job.current_loss,
    )
    register_adapter(
        session,
        name=job.adapter_name,
        job_id=job_id,
        path=adapter_path,
        size_bytes=size_bytes,
        safetensors_sha256=safetensors_sha256,
        rank=rank,
        alpha=alpha,
        base_model_sha256=base_model_sha256,
    )
    append_event(
        session,
        job_id,
        states.EVENT_COMPLETED,
        f"worker {job.worker_id} was lost after publishing the adapter; completed by the reconciler",
        level=states.LEVEL_WARNING,
        data={"worker_id": job.worker_id, "adapter_path": adapter_path},
    )
    return reread_job(session, job_id)
