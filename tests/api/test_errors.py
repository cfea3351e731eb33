"""The error envelope on every error: routing 404/405, unexpected exceptions (500, nothing leaked)."""

from __future__ import annotations

from api import create_app


def _envelope(response) -> dict:
    body = response.get_json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "hint"}
    return body["error"]


def test_unknown_route_is_404_envelope(client):
    response = client.get("/v1/nothing/here")
    assert response.status_code == 404
    assert _envelope(response)["code"] == "not_found"


def test_wrong_method_is_405_envelope_with_allow(client):
    response = client.put("/v1/train/sft", json={})
    assert response.status_code == 405
    assert _envelope(response)["code"] == "method_not_allowed"
    assert "POST" in response.headers["Allow"]
    assert client.post("/v1/train/status").status_code == 405


def test_unexpected_exception_is_500_without_a_traceback(settings):
    app = create_app(settings)

    @app.get("/boom")
    def boom():
        raise RuntimeError("secret internal detail")

    try:
        response = app.test_client().get("/boom")
        assert response.status_code == 500
        error = _envelope(response)
        assert error["code"] == "internal_error"
        text = response.get_data(as_text=True)
        assert "secret internal detail" not in text and "Traceback" not in text
    finally:
        app.extensions["kiln"].close()
