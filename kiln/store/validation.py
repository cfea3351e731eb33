"""The validation curve: one row per evaluation of a job's held-out rows (docs/validation.md).

Written by the run that holds the job, under its claim number like a training step (`record_evaluation`
checks the fence in the same transaction), read by the api (`validation_history`,
`validation_histories`) and the metrics (`latest_evaluations`). A resume drops the rows past its
checkpoint and a restart drops them all, like the loss curve (kiln.store.reconcile).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kiln.store.jobs import require_owner
from kiln.store.models import Job, ValidationEvaluation, store_now

# What a stored evaluation keeps: the record receipts and checkpoints keep, and its sizes.
EVALUATION_COLUMNS = ("global_step", "epoch", "loss", "token_accuracy", "supervised_tokens", "rows")


def record_evaluation(
    session: Session, job_id: str, worker_id: str, evaluation: Mapping[str, Any], *, attempt: int
) -> ValidationEvaluation:
    """Store one evaluation of the running job (the `EVALUATION_COLUMNS` of `evaluation`);
    `LeaseLost` (nothing written) unless the job is running under `worker_id`'s claim `attempt`."""
    require_owner(session, job_id, worker_id, attempt)
    row = ValidationEvaluation(
        job_id=job_id,
        evaluated_at=store_now(session),
        **{column: evaluation[column] for column in EVALUATION_COLUMNS},
    )
    session.add(row)
    session.flush()
    return row


def evaluation_recorded(session: Session, job_id: str, global_step: int) -> bool:
    """Whether the job's validation curve holds this step (a retried write whose commit went through)."""
    return session.get(ValidationEvaluation, (job_id, global_step)) is not None


def validation_history(session: Session, job_id: str) -> list[ValidationEvaluation]:
    """The job's evaluations in step order."""
    query = (
        select(ValidationEvaluation)
        .where(ValidationEvaluation.job_id == job_id)
        .order_by(ValidationEvaluation.global_step)
    )
    return list(session.scalars(query))


def validation_histories(session: Session, job_ids: list[str]) -> dict[str, list[ValidationEvaluation]]:
    """Every listed job's evaluations in step order, in one query (jobs without any are absent)."""
    if not job_ids:
        return {}
    query = (
        select(ValidationEvaluation)
        .where(ValidationEvaluation.job_id.in_(job_ids))
        .order_by(ValidationEvaluation.job_id, ValidationEvaluation.global_step)
    )
    out: dict[str, list[ValidationEvaluation]] = {}
    for row in session.scalars(query):
        out.setdefault(row.job_id, []).append(row)
    return out


def latest_evaluations(session: Session) -> list[tuple[str, ValidationEvaluation]]:
    """(adapter name, newest evaluation) of every job that is not deleted and has one."""
    newest = (
        select(ValidationEvaluation.job_id, func.max(ValidationEvaluation.global_step).label("step"))
        .group_by(ValidationEvaluation.job_id)
        .subquery()
    )
    query = (
        select(Job.adapter_name, ValidationEvaluation)
        .join(
            newest,
            (newest.c.job_id == ValidationEvaluation.job_id)
            & (newest.c.step == ValidationEvaluation.global_step),
        )
        .join(Job, Job.id == ValidationEvaluation.job_id)
        .where(Job.deleted_at.is_(None))
        .order_by(Job.queue_seq)
    )
    return [(name, row) for name, row in session.execute(query)]
