"""Job reads and deletion: status, detail (loss curve, receipt, checkpoint), events
(docs/ARCHITECTURE.md#job-states; cursor pagination: docs/ARCHITECTURE.md#routes)."""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response

from api import schemas
from api.errors import TRAINING_JOB_ACTIVE, ApiError
from api.http import json_list_response, json_response, query_int, services
from api.openapi import MAX_EVENT_ID
from api.queries import admission_summaries, job_with_summary, queue_position_of
from api.serializers import event_out, job_detail, training_status
from kiln.store import (
    InvalidTransition,
    delete_job,
    get_admission,
    latest_checkpoint,
    list_events,
    list_jobs,
    loss_history,
    require_job,
    states,
    store_now,
    validation_histories,
    validation_history,
)
from kiln.store.errors import TRAINING_JOB_NOT_FOUND
from kiln.store.events import MAX_EVENT_PAGE
from kiln_train.errors import KilnError

bp = Blueprint("jobs", __name__)

DEFAULT_EVENT_PAGE = 100


def queue_positions_of(jobs) -> dict[str, int]:
    """1-based FIFO positions of the queued jobs among `jobs` (already in admission order)."""
    queued = (j.id for j in jobs if j.state == states.QUEUED)
    return {job_id: position for position, job_id in enumerate(queued, start=1)}


@bp.get("/v1/train/status")
def list_status() -> Response:
    """Every retained job in admission order (`[TrainingStatus]`)."""
    with services().sessions() as session:
        jobs = list_jobs(session)
        summaries = admission_summaries(session, [j.id for j in jobs])
        curves = validation_histories(session, [j.id for j in jobs])
        # Positions come from the same read as the jobs (admission order): a second query could see
        # a job claimed, cancelled or admitted meanwhile (Postgres reads each statement afresh) and
        # give a queued job no position, or positions with a gap.
        now = store_now(session)
    positions = queue_positions_of(jobs)
    return json_list_response(
        [training_status(j, summaries.get(j.id), positions.get(j.id), now, curves.get(j.id)) for j in jobs]
    )


@bp.get("/v1/train/status/<job_id>")
def job_status(job_id: str) -> Response:
    """One job's `TrainingStatus`; 404 `training_job_not_found`."""
    with services().sessions() as session:
        found = job_with_summary(session, job_id)
        if found is None:
            raise KilnError(TRAINING_JOB_NOT_FOUND, f"no training job {job_id!r}")
        job, summary = found
        position = queue_position_of(session, job)
        evaluations = validation_history(session, job_id)
        now = store_now(session)
    return json_response(training_status(job, summary, position, now, evaluations))


@bp.get("/v1/train/jobs/<job_id>")
def job_detail_view(job_id: str) -> Response:
    """`TrainingJobDetail`: status plus loss history, receipt and the latest checkpoint."""
    svc = services()
    with svc.sessions() as session:
        job = require_job(session, job_id)
        admission = get_admission(session, job_id)
        summary = admission_summaries(session, [job_id]).get(job_id)
        position = queue_position_of(session, job)
        steps = loss_history(session, job_id)
        evaluations = validation_history(session, job_id)
        checkpoint = latest_checkpoint(session, job_id)
        now = store_now(session)
    latest = Path(checkpoint.path) if checkpoint is not None else None
    if latest is None and job.latest_checkpoint:
        latest = svc.settings.adapters_dir / job.latest_checkpoint
    detail = job_detail(
        job, admission, summary, position, steps, latest, svc.settings.adapters_dir, now, evaluations
    )
    return json_response(detail)


@bp.get("/v1/train/jobs/<job_id>/events")
def job_events(job_id: str) -> Response:
    """A page of the job's events after the cursor `after` (an event id), oldest first."""
    after = query_int("after", None, minimum=0, maximum=MAX_EVENT_ID)
    limit = query_int("limit", DEFAULT_EVENT_PAGE, minimum=1, maximum=MAX_EVENT_PAGE)
    with services().sessions() as session:
        require_job(session, job_id)
        events, has_more = list_events(session, job_id, after, limit)
    data = [event_out(e) for e in events]
    return json_response(
        schemas.EventPage(
            data=data,
            has_more=has_more,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
        )
    )


@bp.delete("/v1/train/jobs/<job_id>")
def delete_job_view(job_id: str) -> Response:
    """Delete a finished job (409 `training_job_active` while it is queued or running).

    The rows stay for SQL history (soft delete). This server keeps no per-job archive file, so
    `removed_archive_file` is always false.
    """
    with services().sessions.begin() as session:
        try:
            delete_job(session, job_id)
        except InvalidTransition as exc:
            raise ApiError(
                TRAINING_JOB_ACTIVE,
                f"training job {job_id!r} is {exc.state}; only finished jobs can be deleted",
            ) from None
    return json_response(schemas.DeletedJob(job_id=job_id, status="deleted", removed_archive_file=False))
