"""`GET /v1/config`: effective non-secret settings and the live runner's optimizer support."""

from __future__ import annotations

import json

import pytest
from sqlalchemy.engine import make_url

from api import create_app
from tests.api.conftest import make_settings


def test_config_without_a_runner(client, settings):
    config = client.get("/v1/config").get_json()
    training = config["training"]
    assert training["optimizer_support"] is None
    assert training["native_training_supported"] is False
    assert training["native_training_unavailable_reason"] == (
        "no live training runner has registered its resident identity"
    )
    assert training["max_queued_jobs"] == 64 and training["checkpoint_interval"] is None
    assert config["runner"] is None
    assert config["storage"]["adapters_dir"] == str(settings.adapters_dir)
    assert config["queue"]["queue_name"] == settings.queue.queue_name
    assert config["server"]["auth_enabled"] is False


def test_config_with_a_runner_reports_its_optimizer_support(client, runner, runner_kwargs):
    config = client.get("/v1/config").get_json()
    training = config["training"]
    assert training["optimizer_support"] == runner_kwargs["optimizer_support"]
    assert training["optimizer_support"]["schema"] == {"id": "kiln.training-optimizer-support", "version": 1}
    assert training["native_training_supported"] is True
    assert training["native_training_unavailable_reason"] is None
    assert config["runner"]["id"] == runner and config["runner"]["loss_route"] == "kt_tape_flce"
    assert config["runner"]["execution_identity_digest"] == runner_kwargs["execution_identity_digest"]


def test_config_never_shows_secrets(storage, engine, broker, db_url):
    # Postgres trusts local connections, so a password in the URL is accepted and must not leak.
    parsed = make_url(db_url)
    postgres = parsed.get_backend_name() == "postgresql"
    url = parsed.set(password="hunter2").render_as_string(hide_password=False) if postgres else db_url
    settings = make_settings(
        storage,
        db_url,
        broker.queue,
        server={"api_tokens": ["s3cret-token"]},
        queue={"broker_url": "redis://:brokerpass@127.0.0.1:6379/11"},
    )
    settings = settings.model_copy(update={"database": settings.database.model_copy(update={"url": url})})
    app = create_app(settings)
    try:
        response = app.test_client().get("/v1/config", headers={"Authorization": "Bearer s3cret-token"})
        text = json.dumps(response.get_json())
        assert response.status_code == 200
        for secret in ("s3cret-token", "hunter2", "brokerpass"):
            assert secret not in text
        body = response.get_json()
        if postgres:
            assert body["database"]["url"] == url.replace("hunter2", "***")
        assert body["queue"]["broker_url"] == "redis://:***@127.0.0.1:6379/11"
        assert body["server"]["auth_enabled"] is True and body["server"]["api_token_count"] == 1
    finally:
        app.extensions["kiln"].close()


POLICY = {
    "recompute_mode": "segments",
    "recompute_threshold_tokens": None,
    "anchor_stride": None,
    "cache_target_bytes": None,
}


@pytest.mark.parametrize("path", ["/v1/config", "/health", "/v1/health"])
def test_serving_profile_and_boundary_policy_are_reported(client, path):
    body = client.get(path).get_json()
    assert body["training"]["checkpoint_boundary_policy"] == POLICY
    profile = body["serving_profile"]
    assert (profile["profile"], profile["source"], profile["effective_policy_source"]) == (
        "maintenance",
        "built_in",
        "built_in",
    )
    assert profile["immutable_after_startup"] is True and profile["request_overrides_allowed"] is False
    assert profile["effective_policy"]["inference_admission"] == "disabled"
    assert profile["effective_policy"]["training_gpu_ownership"] == "exclusive"


def test_the_reported_boundary_policy_is_the_one_checkpoints_bind():
    from kiln_train.plan.formulas import checkpoint_boundary_policy

    assert checkpoint_boundary_policy() == POLICY
    first = checkpoint_boundary_policy()
    first["recompute_mode"] = "changed"
    assert checkpoint_boundary_policy() == POLICY


def test_config_never_shows_query_passwords(storage, engine, broker, db_url):
    # The `?password=` form: libpq and redis-py both take it; trust auth accepts it on Postgres.
    parsed = make_url(db_url)
    postgres = parsed.get_backend_name() == "postgresql"
    url = f"{db_url}?password=hunter2&sslpassword=hunter3" if postgres else db_url
    settings = make_settings(
        storage, db_url, broker.queue, queue={"broker_url": "redis://127.0.0.1:6379/11?password=brokerpass"}
    )
    settings = settings.model_copy(update={"database": settings.database.model_copy(update={"url": url})})
    app = create_app(settings)
    try:
        response = app.test_client().get("/v1/config")
        assert response.status_code == 200
        text = response.get_data(as_text=True)
        for secret in ("hunter2", "hunter3", "brokerpass"):
            assert secret not in text
        body = response.get_json()
        if postgres:
            assert body["database"]["url"] == f"{db_url}?password=***&sslpassword=***"
        assert body["queue"]["broker_url"] == "redis://127.0.0.1:6379/11?password=***"
    finally:
        app.extensions["kiln"].close()
