"""`GET /health`, `GET /v1/health`: readiness (database reachable) with the runner summary and
the execution identity it pinned (docs/ARCHITECTURE.md#routes). 503 `database_unavailable`
otherwise.

The probes are public; on a server with api tokens, a caller without a valid one gets liveness
only (`HealthLiveness`)."""

from __future__ import annotations

import logging

from flask import Blueprint, Response
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from api import schemas
from api.auth import caller_authenticated
from api.errors import DATABASE_UNAVAILABLE, ApiError
from api.http import json_response, services
from api.serializers import checkpoint_boundary_policy, runner_summary, serving_profile
from kiln.store import count_queued, live_runner, store_now
from kiln_train.plan.optimizer_support import native_training_supported

log = logging.getLogger(__name__)

bp = Blueprint("health", __name__)


@bp.get("/health")
@bp.get("/v1/health")
def health() -> Response:
    svc = services()
    try:
        with svc.sessions() as session:
            session.execute(text("SELECT 1"))
            runner = live_runner(session, svc.settings.training.runner_stale_seconds)
            depth = count_queued(session)
            now = store_now(session)
    except SQLAlchemyError as exc:
        log.warning("health: the job database is unreachable: %s", exc)
        raise ApiError(DATABASE_UNAVAILABLE, f"the job database ({svc.dialect}) is unreachable") from None
    base = runner.model_config.get("base_weights_sha256") if runner is not None else None
    supported = native_training_supported(runner.optimizer_support if runner is not None else None)
    if not caller_authenticated():
        summary = runner_summary(runner, now)
        liveness = (
            None
            if summary is None
            else schemas.RunnerLiveness(state=summary.state, heartbeat_age_s=summary.heartbeat_age_s)
        )
        return json_response(
            schemas.HealthLiveness(
                status="ok",
                database=schemas.DatabaseHealth(ok=True, dialect=svc.dialect),
                runner=liveness,
                queue_depth=depth,
                native_training_supported=supported,
            )
        )
    return json_response(
        schemas.HealthResponse(
            status="ok",
            database=schemas.DatabaseHealth(ok=True, dialect=svc.dialect),
            runner=runner_summary(runner, now),
            execution_identity=runner.execution_identity_digest if runner is not None else None,
            base_weight_identity=base,
            queue_depth=depth,
            native_training_supported=supported,
            serving_profile=serving_profile(),
            training=schemas.HealthTraining(
                checkpoint_boundary_policy=checkpoint_boundary_policy(), native_training_supported=supported
            ),
        )
    )
