"""Bearer tokens: every route but the probes needs one when `server.api_tokens` is set."""

from __future__ import annotations

import pytest

from api import create_app
from api.auth import token_matches
from tests.api.conftest import make_settings

TOKENS = ["token-one", "token-two"]


@pytest.fixture
def secured(storage, db_url, engine, broker):
    app = create_app(make_settings(storage, db_url, broker.queue, server={"api_tokens": TOKENS}))
    yield app.test_client()
    app.extensions["kiln"].close()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("post", "/v1/train/sft"),
        ("get", "/v1/train/status"),
        ("get", "/v1/train/queue"),
        ("delete", "/v1/train/queue/x"),
        ("get", "/v1/config"),
        ("get", "/v1/adapters"),
        ("get", "/openapi.json"),
        ("get", "/v1/no/such/route"),
    ],
)
def test_protected_routes_need_a_bearer_token(secured, method, path):
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Basic token-one"},
        {"Authorization": "Bearer "},
    ):
        response = getattr(secured, method)(path, headers=headers)
        assert response.status_code == 401, (path, headers)
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert response.get_json()["error"]["code"] == "unauthorized"


def test_a_valid_token_is_accepted(secured):
    for token in TOKENS:
        response = secured.get("/v1/train/status", headers={"Authorization": f"Bearer {token}"})
        assert response.status_code == 200 and response.get_json() == []


@pytest.mark.parametrize("path", ["/health", "/v1/health"])
def test_probes_are_public(secured, path):
    assert secured.get(path).status_code == 200


def test_openapi_marks_protected_operations(secured):
    doc = secured.get("/openapi.json", headers={"Authorization": "Bearer token-one"}).get_json()
    assert doc["paths"]["/v1/train/sft"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]


def test_token_comparison():
    assert token_matches("token-two", TOKENS)
    assert not token_matches("token-tw", TOKENS) and not token_matches("", TOKENS)
    assert not token_matches("tökén", TOKENS)
