"""`GET /metrics`: Prometheus text exposition (process counters + job-store gauges)."""

from __future__ import annotations

from flask import Blueprint, Response

from api.http import services
from api.metrics import CONTENT_TYPE
from api.queries import heartbeat_age_seconds, jobs_by_state, newest_runner, unpublished_count
from kiln.store import count_queued, latest_evaluations, live_runner, store_now

bp = Blueprint("metrics", __name__)


@bp.get("/metrics")
def metrics() -> Response:
    svc = services()

    def snapshot() -> dict:
        with svc.sessions() as session:
            return {
                "jobs_by_state": jobs_by_state(session),
                "queue_depth": count_queued(session),
                "unpublished": unpublished_count(session),
                "runner": live_runner(session, svc.settings.training.runner_stale_seconds) is not None,
                "heartbeat_age_s": heartbeat_age_seconds(newest_runner(session), store_now(session)),
                "validation": [
                    {
                        "job_id": row.job_id,
                        "adapter_name": name,
                        "global_step": row.global_step,
                        "loss": row.loss,
                        "token_accuracy": row.token_accuracy,
                    }
                    for name, row in latest_evaluations(session)
                ],
            }

    return Response(svc.metrics.render(snapshot), content_type=CONTENT_TYPE)
