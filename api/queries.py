"""Read-only questions the api asks of the job store beyond `kiln.store`'s transitions.

Only SELECTs live here; every write goes through `kiln.store`.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kiln.store import Admission, Job, Runner, possible_job_id, states


def _summary_columns() -> list:
    # Only the receipt's counters are read (in SQL): the receipt itself lists every kept row's
    # hash and grows with the dataset.
    receipt = Admission.ingestion_receipt
    return [
        Admission.data_source,
        Admission.dataset_path,
        Admission.kept_corpus_sha256,
        receipt["rows_read"].as_integer().label("rows_read"),
        receipt["rows_rejected"].as_integer().label("rows_rejected"),
        Admission.checkpoint_plan["max_segments"].as_integer().label("max_segments"),
        Admission.memory_estimate_bytes,
        # the model of the runner admission priced the job against (outer-joined: a runner row
        # may be gone), and whether it is a random checkpoint Kiln drew
        Runner.model_path,
        Runner.model_config["random_init"].label("random_init"),
    ]


def _summary(row) -> dict | None:
    if row.data_source is None:  # no admission row (outer join)
        return None
    return {
        "data_source": row.data_source,
        "dataset_path": row.dataset_path,
        "kept_corpus_sha256": row.kept_corpus_sha256,
        "rows_read": row.rows_read,
        "rows_rejected": row.rows_rejected,
        "max_segments": row.max_segments,
        "memory_estimate_bytes": row.memory_estimate_bytes,
        "model": None if row.model_path is None else {"path": row.model_path, "random_init": row.random_init},
    }


def admission_summaries(session: Session, job_ids: list[str]) -> dict[str, dict]:
    """For each job: where its data came from, the admitted corpus digest, row counters, the
    segment plan and the memory estimate, in one query (no per-job round trips)."""
    if not job_ids:
        return {}
    rows = session.execute(
        select(Admission.job_id, *_summary_columns())
        .outerjoin(Runner, Runner.id == Admission.runner_id)
        .where(Admission.job_id.in_(job_ids))
    )
    return {row.job_id: _summary(row) for row in rows}


def job_with_summary(session: Session, job_id: str) -> tuple[Job, dict | None] | None:
    """A tracked job and its admission summary in one round trip (None when absent or deleted)."""
    if not possible_job_id(job_id):
        return None
    query = (
        select(Job, *_summary_columns())
        .outerjoin(Admission, Admission.job_id == Job.id)
        .outerjoin(Runner, Runner.id == Admission.runner_id)
        .where(Job.id == job_id, Job.deleted_at.is_(None))
    )
    row = session.execute(query).first()
    return None if row is None else (row[0], _summary(row))


def queue_position_of(session: Session, job: Job) -> int | None:
    """1-based FIFO position of a job already loaded (one COUNT; None when not queued)."""
    if job.state != states.QUEUED:
        return None
    ahead = session.execute(
        select(func.count())
        .select_from(Job)
        .where(Job.state == states.QUEUED, Job.queue_seq < job.queue_seq, Job.deleted_at.is_(None))
    ).scalar_one()
    return int(ahead) + 1


def active_jobs_for_adapter(session: Session, name: str) -> list[str]:
    """Queued or running jobs that will write adapter `name`."""
    query = select(Job.id).where(
        Job.adapter_name == name,
        Job.state.in_((states.QUEUED, states.RUNNING)),
        Job.deleted_at.is_(None),
    )
    return list(session.scalars(query.order_by(Job.queue_seq)))


def jobs_warm_starting_from(session: Session, name: str) -> list[str]:
    """Queued or running jobs whose `config.base_adapter` is adapter `name` (they read it)."""
    query = (
        select(Job.id)
        .join(Admission, Admission.job_id == Job.id)
        .where(
            Admission.effective_config["base_adapter"].as_string() == name,
            Job.state.in_((states.QUEUED, states.RUNNING)),
            Job.deleted_at.is_(None),
        )
    )
    return list(session.scalars(query.order_by(Job.queue_seq)))


def jobs_by_state(session: Session) -> dict[str, int]:
    """Tracked jobs per state (every state present, zero included)."""
    counts = dict.fromkeys(states.JOB_STATES, 0)
    rows = session.execute(
        select(Job.state, func.count()).where(Job.deleted_at.is_(None)).group_by(Job.state)
    )
    for state, count in rows:
        counts[state] = int(count)
    return counts


def unpublished_count(session: Session) -> int:
    return int(
        session.execute(
            select(func.count())
            .select_from(Job)
            .where(Job.state == states.QUEUED, Job.published_at.is_(None), Job.deleted_at.is_(None))
        ).scalar_one()
    )


def newest_runner(session: Session) -> Runner | None:
    """The runner with the most recent heartbeat, alive or not (for heartbeat age)."""
    return session.scalars(select(Runner).order_by(Runner.heartbeat_at.desc()).limit(1)).first()


def heartbeat_age_seconds(runner: Runner | None, now: datetime) -> float | None:
    if runner is None:
        return None
    return max(0.0, (now - runner.heartbeat_at).total_seconds())


def terminal_jobs(session: Session) -> list[Job]:
    """Finished, not deleted jobs, most recently finished first."""
    query = select(Job).where(Job.state.in_(states.TERMINAL_STATES), Job.deleted_at.is_(None))
    return list(session.scalars(query.order_by(Job.finished_at.desc(), Job.queue_seq.desc())))
