"""`GET /v1/config`: the effective non-secret settings and the live runner's training support
(docs/optimizers.md#support-report)."""

from __future__ import annotations

from flask import Blueprint, Response

from api import schemas
from api.http import json_response, services
from api.serializers import checkpoint_boundary_policy, runner_summary, serving_profile
from kiln.redact import redact_url
from kiln.settings import Settings
from kiln.store import live_runner, store_now
from kiln_train.plan.optimizer_support import native_training_supported, native_training_unavailable_reason

bp = Blueprint("config", __name__)


def public_settings(settings: Settings) -> dict:
    """Every setting that is not a secret (tokens become a count, URLs lose their password)."""
    data = settings.model_dump(mode="json")
    tokens = data["server"].pop("api_tokens")
    data["server"]["auth_enabled"] = bool(tokens)
    data["server"]["api_token_count"] = len(tokens)
    data["database"]["url"] = redact_url(settings.database_url)
    data["queue"]["broker_url"] = redact_url(settings.broker_url)
    data["storage"]["root"] = str(settings.storage_root)
    data["storage"]["adapters_dir"] = str(settings.adapters_dir)
    data["storage"]["datasets_dir"] = str(settings.datasets_dir)
    data["model"]["path"] = str(settings.model_path)
    return data


@bp.get("/v1/config")
def config_view() -> Response:
    svc = services()
    with svc.sessions() as session:
        runner = live_runner(session, svc.settings.training.runner_stale_seconds)
        now = store_now(session)
    report = runner.optimizer_support if runner is not None else None
    data = public_settings(svc.settings)
    training = schemas.TrainingConfigOut(
        **data.pop("training"),
        optimizer_support=report,
        checkpoint_boundary_policy=checkpoint_boundary_policy(),
        native_training_supported=native_training_supported(report),
        native_training_unavailable_reason=native_training_unavailable_reason(report),
    )
    return json_response(
        schemas.ConfigResponse(
            **data,
            training=training,
            runner=runner_summary(runner, now),
            serving_profile=serving_profile(),
        )
    )
