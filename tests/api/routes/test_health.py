"""`GET /health` and `GET /v1/health`: readiness with the runner summary; 503 without a database."""

from __future__ import annotations

import pytest

from api import create_app
from tests.api.conftest import make_settings


@pytest.mark.parametrize("path", ["/health", "/v1/health"])
def test_health_without_a_runner(client, path, engine):
    response = client.get(path)
    assert response.status_code == 200
    body = response.get_json()
    assert body["status"] == "ok" and body["database"] == {"ok": True, "dialect": engine.dialect.name}
    assert body["runner"] is None and body["execution_identity"] is None
    assert body["queue_depth"] == 0 and body["native_training_supported"] is False


def test_health_with_a_runner(client, runner, runner_kwargs):
    client.post(
        "/v1/train/sft",
        json={
            "examples": [
                {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
            ],
            "config": {"lora_rank": 4, "lora_alpha": 8},
        },
    )
    body = client.get("/health").get_json()
    assert body["runner"]["id"] == runner and body["runner"]["state"] == "ready"
    assert 0 <= body["runner"]["heartbeat_age_s"] < 60
    assert body["execution_identity"] == runner_kwargs["execution_identity_digest"]
    assert body["base_weight_identity"] == runner_kwargs["model_config"]["base_weights_sha256"]
    assert body["queue_depth"] == 1 and body["native_training_supported"] is True


def test_health_is_503_when_the_database_is_unreachable(storage, broker, db_url):
    settings = make_settings(storage, db_url, broker.queue)
    settings = settings.model_copy(
        update={
            "database": settings.database.model_copy(update={"url": "postgresql://postgres@127.0.0.1:1/none"})
        }
    )
    app = create_app(settings)
    try:
        response = app.test_client().get("/health")
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "5"
        error = response.get_json()["error"]
        assert error["code"] == "database_unavailable" and "postgresql" in error["message"]
        assert "127.0.0.1:1" not in error["message"]  # no connection details leak
    finally:
        app.extensions["kiln"].close()
