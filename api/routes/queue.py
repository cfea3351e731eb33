"""The queue view and cancellation: `QueueResponse`, cancel responses (docs/ARCHITECTURE.md#job-states)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from flask import Blueprint, Response, current_app

from api import schemas
from api.http import json_response, services
from api.queries import admission_summaries
from api.serializers import training_status
from kiln.store import CANCELLED, list_jobs, request_cancel, states, store_now, validation_histories

log = logging.getLogger(__name__)

bp = Blueprint("queue", __name__)

_NEVER = datetime.min.replace(tzinfo=UTC)
CANCELLING_MESSAGE = "stop requested — the trainer aborts at the next step boundary"


@bp.get("/v1/train/queue")
def queue_view() -> Response:
    """Running job(s), queued jobs with 1-based FIFO positions, finished jobs newest first."""
    with services().sessions() as session:
        # One read of every tracked job, split here: three queries could each see a different
        # moment (Postgres), so a job claimed or finished between them would vanish from the
        # answer or appear twice.
        jobs = list_jobs(session)
        now = store_now(session)
        running = [j for j in jobs if j.state == states.RUNNING]
        finished = [j for j in jobs if j.state in states.TERMINAL_STATES]
        summaries = admission_summaries(session, [j.id for j in (*running, *finished)])
        curves = validation_histories(session, [j.id for j in (*running, *finished)])
    queued = [j for j in jobs if j.state == states.QUEUED]
    # Most recently finished first, ties newest admission first (as api.queries.terminal_jobs).
    finished.sort(
        key=lambda j: (j.finished_at is not None, j.finished_at or _NEVER, j.queue_seq), reverse=True
    )
    running_out = [training_status(j, summaries.get(j.id), None, now, curves.get(j.id)) for j in running]
    return json_response(
        schemas.QueueResponse(
            running=running_out[0] if running_out else None,
            running_jobs=running_out,
            queued=[
                schemas.QueuedEntry(job_id=j.id, job_type=j.job_type, adapter_name=j.adapter_name, position=i)
                for i, j in enumerate(queued, start=1)
            ],
            completed=[
                training_status(j, summaries.get(j.id), None, now, curves.get(j.id)) for j in finished
            ],
        )
    )


@bp.delete("/v1/train/queue/<job_id>")
def cancel_job(job_id: str) -> Response:
    """Cancel: a queued job ends at once ("cancelled"), a running one stops at the next step
    boundary ("cancelling"); 409 when it already finished or left the queue meanwhile."""
    svc = services()
    with svc.sessions.begin() as session:
        outcome = request_cancel(session, job_id)
    if outcome == CANCELLED:
        revoke(svc.celery, job_id)
        # The contract's body for a queued job is exactly `{"status", "job_id"}` (no message).
        body = schemas.CancelResponse(status="cancelled", job_id=job_id).model_dump_json(exclude_none=True)
        return current_app.response_class(body, mimetype="application/json")
    return json_response(
        schemas.CancelResponse(status="cancelling", job_id=job_id, message=CANCELLING_MESSAGE)
    )


def revoke(celery, job_id: str) -> None:
    """Tell workers to drop the message (task_id = job_id). Best effort: the row is the truth,
    and a worker acknowledges and drops a message whose row is not queued anyway."""
    try:
        celery.control.revoke(job_id)
    except Exception:
        log.warning(
            "could not broadcast the revoke of %s; the worker will drop it at dequeue", job_id, exc_info=True
        )
