"""Requests found misbehaving by fuzzing the HTTP front door (schemathesis + hand-made bodies):
each now gets the envelope with the contract's status and code and leaves no row, no queue
message and no file -- on SQLite and on Postgres."""

from __future__ import annotations

import pytest

from tests.api.conftest import sft_body, snapshot


def _error(response) -> dict:
    body = response.get_json()
    assert body is not None, response.get_data(as_text=True)[:300]
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "hint"}
    return body["error"]


# ----- resume_checkpoint longer than one path segment -----------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "a" * 256,  # 256 bytes
        "é" * 128,  # 128 characters, 256 bytes
        "x" * 300 + ".kiln-checkpoint",
    ],
)
def test_resume_checkpoint_name_longer_than_a_path_segment_is_400(
    name, client, engine, broker, storage, runner
):
    """The checkpoint loader's lstat raised ENAMETOOLONG (OSError), answered as 500 internal_error."""
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=sft_body(1, resume_checkpoint=name))
    assert response.status_code == 400
    error = _error(response)
    assert error["code"] == "training_invalid_request"
    assert "config.resume_checkpoint names a directory of" in error["message"]
    assert "at most 255" in error["message"]
    assert snapshot(engine, broker, storage) == before


def test_absolute_resume_checkpoint_with_an_overlong_basename_is_400(
    client, engine, broker, storage, settings, runner
):
    before = snapshot(engine, broker, storage)
    name = str(settings.adapters_dir / ("b" * 300))
    response = client.post("/v1/train/sft", json=sft_body(1, resume_checkpoint=name))
    assert response.status_code == 400
    error = _error(response)
    assert error["code"] == "training_invalid_request"
    assert "at most 255" in error["message"]
    assert snapshot(engine, broker, storage) == before


def test_resume_checkpoint_of_255_bytes_is_looked_up(client, engine, broker, storage, runner):
    """The bound is the filesystem's: a 255-byte name is a plain 'does not exist'."""
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=sft_body(1, resume_checkpoint="c" * 255))
    assert response.status_code == 400
    assert "does not exist" in _error(response)["message"]
    assert snapshot(engine, broker, storage) == before


# ----- an encoded slash in a path parameter -----------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/v1/train/jobs/%2F/events"),
        ("get", "/v1/train/jobs//events"),
        ("get", "/v1/train/jobs/a%2F%2Fb/events"),
        ("get", "/v1/train/status/%2F%2Fx"),
        ("delete", "/v1/train/queue/a%2F%2Fb"),
        ("get", "/v1/adapters/%2F%2F/receipt"),
    ],
)
def test_encoded_slashes_are_a_404_envelope_not_a_redirect(
    method, path, client, engine, broker, storage, runner
):
    """Werkzeug merged the slashes of `/v1/train/jobs///events` and answered 308 (an HTML body,
    no envelope) to `/v1/train/jobs/events`: the detail of a job called "events"."""
    before = snapshot(engine, broker, storage)
    response = getattr(client, method)(path)
    assert response.status_code == 404, (response.status_code, response.headers.get("Location"))
    assert "Location" not in response.headers
    assert _error(response)["code"] in {"not_found", "training_job_not_found"}
    assert snapshot(engine, broker, storage) == before


def test_a_job_named_events_is_not_reached_through_merged_slashes(client, runner):
    job_id = client.post("/v1/train/sft", json=sft_body(1)).get_json()["job_id"]
    assert client.get(f"/v1/train/jobs/{job_id}/events").status_code == 200
    response = client.get(f"/v1/train/jobs/{job_id}//events")
    assert response.status_code == 404
    assert _error(response)["code"] == "not_found"


# ----- query integers ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1_0", "%D9%A3", "%EF%BC%91", "%201", "+5", "1%20", "0x10", "1.0", "%00"])
def test_query_integers_are_ascii_decimal_digits(value, client, runner):
    """`int()` read `1_0` as 10, Arabic-Indic and fullwidth digits as numbers, and ` 1`/`+5`."""
    job_id = client.post("/v1/train/sft", json=sft_body(1)).get_json()["job_id"]
    for name in ("after", "limit"):
        response = client.get(f"/v1/train/jobs/{job_id}/events?{name}={value}")
        assert response.status_code == 400, (name, value)
        error = _error(response)
        assert error["code"] == "training_invalid_request"
        assert (
            f"query parameter {name}=" in error["message"] and "is not a decimal integer" in error["message"]
        )


def test_query_integers_with_many_digits(client, runner):
    job_id = client.post("/v1/train/sft", json=sft_body(1)).get_json()["job_id"]
    padded = client.get(f"/v1/train/jobs/{job_id}/events?after={'0' * 40}&limit={'0' * 30}1")
    assert padded.status_code == 200
    page = padded.get_json()
    assert len(page["data"]) == 1 and page["has_more"] is False
    huge = client.get(f"/v1/train/jobs/{job_id}/events?after={'9' * 5000}")
    assert huge.status_code == 400
    assert "must be 0..=2147483647" in _error(huge)["message"]
    negative = client.get(f"/v1/train/jobs/{job_id}/events?after=-{'9' * 5000}")
    assert negative.status_code == 400
    assert "must be 0..=2147483647" in _error(negative)["message"]
