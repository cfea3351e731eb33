"""The front door against hostile requests, through the real app on both databases: nesting and
integer literals the server cannot handle, DNS rebinding of a token-less server, what a public
probe shows, Idempotency-Keys across bearer tokens, symlinks in the registry, the headers of every
answer, the admission slots, resume_checkpoint names longer than a path segment, encoded or merged
slashes in a route and query integers that are not plain decimal digits. Each refusal is the
envelope and leaves nothing behind."""

from __future__ import annotations

import json
import os

import pytest
from sqlalchemy import select

from api import create_app
from kiln.store import Job
from kiln_train.errors import KilnError
from kiln_train.sft_config import parse_sft_request
from tests.api.conftest import make_settings, sft_body, snapshot
from tests.api.registry_support import publish_adapter

MAX_DEPTH = 64
TOKENS = ["token-one", "token-two"]


def _body_nested(depth: int) -> dict:
    """A valid request whose arrays and objects nest exactly `depth` levels (the body is level 1):
    an assistant tool call whose JSON arguments are nested objects."""
    arguments: dict = {}
    for _ in range(depth - 9):  # body, examples, row, messages, message, tool_calls, call, function
        arguments = {"a": arguments}
    call = {"type": "function", "function": {"name": "lookup", "arguments": arguments}}
    row = {
        "messages": [
            {"role": "user", "content": "Look it up."},
            {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        ]
    }
    return {"examples": [row], "config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0}}


def _error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.get_data(as_text=True)[:500]
    error = response.get_json()["error"]
    assert error["code"] == code and error["message"] and "hint" in error
    return error


def test_nesting_at_the_limit_is_admitted_and_one_deeper_is_400(client, engine, broker, storage, runner):
    assert client.post("/v1/train/sft", json=_body_nested(MAX_DEPTH)).status_code == 200
    before = snapshot(engine, broker, storage)
    error = _error(
        client.post("/v1/train/sft", json=_body_nested(MAX_DEPTH + 1)), 400, "training_invalid_request"
    )
    assert "nested too deeply at examples[0].messages[1].tool_calls[0].function.arguments" in error["message"]
    assert f"at most {MAX_DEPTH} levels of arrays and objects" in error["message"]
    assert snapshot(engine, broker, storage) == before


@pytest.mark.parametrize("depth", [500, 980, 5000, 200_000])
def test_nesting_the_parser_or_the_fingerprint_cannot_follow_is_400(
    depth, client, engine, broker, storage, runner
):
    # ~980 levels pass json.loads; computing the request fingerprint must not overflow the stack.
    text = '{"examples": [{"messages": [], "x": ' + "[" * depth + "]" * depth + "}]}"
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", data=text, content_type="application/json")
    error = _error(response, 400, "training_invalid_request")
    assert "nested too deeply" in error["message"] and f"at most {MAX_DEPTH} levels" in error["message"]
    assert snapshot(engine, broker, storage) == before


@pytest.mark.parametrize(
    ("field", "bound"),
    [("lora_rank", 1 << 20), ("grad_checkpoint_segments", 1024), ("epochs", 100_000)],
)
@pytest.mark.parametrize("literal", ["10" + "0" * 400, "1" + "0" * 30, "bound+1"])
def test_an_integer_beyond_its_bound_is_400_naming_the_field(
    field, bound, literal, client, engine, broker, storage, runner
):
    body = sft_body(1)
    body["config"][field] = "VALUE"
    value = str(bound + 1) if literal == "bound+1" else literal
    text = json.dumps(body).replace('"VALUE"', value)  # the literal as sent, not a Python int's repr
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", data=text, content_type="application/json")
    error = _error(response, 400, "training_invalid_request")
    assert f"config.{field}" in error["message"] and f"less than or equal to {bound}" in error["message"]
    assert snapshot(engine, broker, storage) == before


def test_the_documented_integer_maxima_are_the_parsers(client):
    config = client.get("/openapi.json").get_json()["components"]["schemas"]["SftConfig"]["properties"]
    for field in ("lora_rank", "grad_checkpoint_segments", "epochs"):
        (schema,) = [s for s in config[field].get("anyOf", [config[field]]) if s.get("type") == "integer"]
        bound = schema["maximum"]
        body = {"examples": [{"messages": []}], "config": {field: bound, "optimizer": {"kind": "sgd"}}}
        assert parse_sft_request(body).config.model_dump()[field] == bound
        body["config"][field] = bound + 1
        with pytest.raises(KilnError, match=f"config.{field}"):
            parse_sft_request(body)


# ----- DNS rebinding: the Host allow-list of a token-less server ----------------------------


@pytest.mark.parametrize(
    "host",
    ["attacker.example", "attacker.example:8420", "127.attacker.example", "localhost.attacker.example", ""],
)
def test_a_token_less_loopback_server_refuses_other_host_names(host, client, engine, broker, storage, runner):
    before = snapshot(engine, broker, storage)
    for method, path, kwargs in (
        ("post", "/v1/train/sft", {"json": sft_body(1)}),
        ("get", "/v1/train/status", {}),
        ("get", "/health", {}),
    ):
        response = getattr(client, method)(path, headers={"Host": host}, **kwargs)
        error = _error(response, 403, "host_not_allowed")
        assert "server.allowed_hosts" in error["hint"] and "KILN_SERVER_ALLOWED_HOSTS" in error["hint"]
    assert snapshot(engine, broker, storage) == before


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:8420", "127.0.0.1:1", "[::1]:8420", "[::1]", "LOCALHOST"]
)
def test_loopback_host_names_are_answered(host, client, runner):
    assert client.get("/v1/train/status", headers={"Host": host}).status_code == 200
    assert client.post("/v1/train/sft", json=sft_body(1), headers={"Host": host}).status_code == 200


def test_the_allow_list_is_configurable(storage, db_url, engine, broker):
    settings = make_settings(storage, db_url, broker.queue, server={"allowed_hosts": ["kiln.internal"]})
    app = create_app(settings)
    try:
        client = app.test_client()
        assert client.get("/health", headers={"Host": "kiln.internal:8420"}).status_code == 200
        _error(client.get("/health", headers={"Host": "localhost"}), 403, "host_not_allowed")
        anything = create_app(make_settings(storage, db_url, broker.queue, server={"allowed_hosts": ["*"]}))
        assert anything.test_client().get("/health", headers={"Host": "anything.example"}).status_code == 200
        anything.extensions["kiln"].close()
    finally:
        app.extensions["kiln"].close()


@pytest.mark.parametrize(
    "server",
    [{"api_tokens": TOKENS}, {"host": "0.0.0.0", "allow_unauthenticated_remote": True}],
)
def test_the_host_check_is_off_with_tokens_and_on_an_open_remote_bind(
    server, storage, db_url, engine, broker
):
    app = create_app(make_settings(storage, db_url, broker.queue, server=server))
    try:
        headers = {"Host": "kiln.example.com", "Authorization": f"Bearer {TOKENS[0]}"}
        assert app.test_client().get("/v1/train/status", headers=headers).status_code == 200
    finally:
        app.extensions["kiln"].close()


# ----- what a public probe shows ------------------------------------------------------------


@pytest.fixture
def secured(storage, db_url, engine, broker):
    app = create_app(make_settings(storage, db_url, broker.queue, server={"api_tokens": TOKENS}))
    yield app.test_client()
    app.extensions["kiln"].close()


@pytest.mark.parametrize("path", ["/health", "/v1/health"])
def test_health_without_a_token_shows_liveness_only(path, secured, runner, runner_kwargs, sessions):
    from kiln.store import heartbeat_runner

    with sessions.begin() as session:
        heartbeat_runner(session, runner, current_job_id="job-secret-id")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = secured.get(path, headers=headers)
        assert response.status_code == 200
        body = response.get_json()
        assert set(body) == {"status", "database", "runner", "queue_depth", "native_training_supported"}
        assert set(body["runner"]) == {"state", "heartbeat_age_s"} and body["runner"]["state"] == "ready"
        text = response.get_data(as_text=True)
        for secret in (
            runner,
            runner_kwargs["hostname"],
            runner_kwargs["model_path"],
            "job-secret-id",
            str(runner_kwargs["free_memory_bytes"]),
            runner_kwargs["execution_identity_digest"],
        ):
            assert secret not in text
    full = secured.get(path, headers={"Authorization": f"Bearer {TOKENS[1]}"}).get_json()
    assert full["runner"]["id"] == runner and full["runner"]["model_path"] == runner_kwargs["model_path"]
    assert full["runner"]["current_job_id"] == "job-secret-id"
    assert full["runner"]["free_memory_bytes"] == runner_kwargs["free_memory_bytes"]
    assert full["execution_identity"] == runner_kwargs["execution_identity_digest"]


def test_the_document_describes_both_health_bodies(secured):
    doc = secured.get("/openapi.json", headers={"Authorization": f"Bearer {TOKENS[0]}"}).get_json()
    schema = doc["paths"]["/health"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert schema == {
        "oneOf": [
            {"$ref": "#/components/schemas/HealthResponse"},
            {"$ref": "#/components/schemas/HealthLiveness"},
        ]
    }
    liveness = doc["components"]["schemas"]["HealthLiveness"]
    assert set(liveness["properties"]) == {
        "status",
        "database",
        "runner",
        "queue_depth",
        "native_training_supported",
    }


# ----- Idempotency-Keys are scoped per bearer token -----------------------------------------


def test_idempotency_keys_of_two_tokens_never_meet(secured, sessions, runner):
    def submit(token: str, body: dict):
        headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": "nightly"}
        return secured.post("/v1/train/sft", json=body, headers=headers)

    first = submit(TOKENS[0], sft_body(2))
    assert first.status_code == 200 and "Idempotent-Replayed" not in first.headers
    # Another token, the same key and body: its own job, not a replay of the other caller's.
    other = submit(TOKENS[1], sft_body(2))
    assert other.status_code == 200 and "Idempotent-Replayed" not in other.headers
    assert other.get_json()["job_id"] != first.get_json()["job_id"]
    # Within one token the key still names exactly one body, and replays its job.
    _error(submit(TOKENS[1], sft_body(3)), 422, "idempotency_key_reused")
    replay = submit(TOKENS[0], sft_body(2))
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_json()["job_id"] == first.get_json()["job_id"]
    with sessions() as session:
        keys = session.scalars(select(Job.idempotency_key)).all()
    assert len(keys) == 2 and len(set(keys)) == 2 and "nightly" not in keys
    assert all(k.startswith("bearer:") and TOKENS[0] not in k and TOKENS[1] not in k for k in keys)


def test_a_token_less_server_stores_the_key_as_given(client, sessions, runner):
    response = client.post("/v1/train/sft", json=sft_body(1), headers={"Idempotency-Key": "plain-key"})
    assert response.status_code == 200
    with sessions() as session:
        assert session.scalars(select(Job.idempotency_key)).all() == ["plain-key"]


# ----- registry reads do not follow symlinks ------------------------------------------------


def _register(sessions, settings, name: str):
    publish_adapter(sessions, settings, name, checkpoints=(), big=16)
    root = settings.adapters_dir / name
    for rel in ("train_receipt.json", "adapter_manifest.json"):
        (root / rel).unlink()
    return root


def test_a_symlinked_receipt_or_manifest_is_not_read(client, sessions, settings, tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text('{"secret": "from outside the registry"}')
    root = _register(sessions, settings, "linked")
    (root / "train_receipt.json").symlink_to(outside)
    (root / "adapter_manifest.json").symlink_to(outside)
    error = _error(client.get("/v1/adapters/linked/receipt"), 404, "adapter_not_found")
    assert "symlink" in error["message"]
    (adapter,) = client.get("/v1/adapters").get_json()["adapters"]
    assert adapter["adapter_manifest"] is None and "symlink" in adapter["adapter_manifest_error"]
    assert "from outside" not in client.get("/v1/adapters").get_data(as_text=True)


def test_a_fifo_in_the_registry_does_not_block_the_request(client, sessions, settings):
    root = _register(sessions, settings, "piped")
    os.mkfifo(root / "train_receipt.json")
    error = _error(client.get("/v1/adapters/piped/receipt"), 404, "adapter_not_found")
    assert "not a regular file" in error["message"]


# ----- headers on every answer --------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("get", "/health", 200),
        ("get", "/v1/train/status", 200),
        ("get", "/metrics", 200),
        ("get", "/openapi.json", 200),
        ("get", "/v1/no/such/route", 404),
        ("post", "/v1/train/status", 405),
        ("post", "/v1/train/sft", 415),
    ],
)
def test_every_answer_is_nosniff_and_no_store(method, path, status, client):
    response = getattr(client, method)(path)
    assert response.status_code == status
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["Cache-Control"] == "no-store"


def test_an_oversized_body_answer_carries_them_too(storage, db_url, engine, broker):
    app = create_app(make_settings(storage, db_url, broker.queue, server={"max_request_mb": 0.001}))
    try:
        response = app.test_client().post("/v1/train/sft", json=sft_body(40))
        _error(response, 413, "training_request_too_large")
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert response.headers["Cache-Control"] == "no-store"
    finally:
        app.extensions["kiln"].close()


# ----- admission slots ----------------------------------------------------------------------


def test_a_submission_beyond_the_slots_is_503_with_retry_after(storage, db_url, engine, broker, runner):
    settings = make_settings(storage, db_url, broker.queue, server={"max_concurrent_admissions": 2})
    app = create_app(settings)
    # A second app on the same storage root is another worker process of the same server.
    other = create_app(settings)
    slots = other.extensions["kiln"].admission_slots
    try:
        client = app.test_client()
        held = [slots.try_acquire(), slots.try_acquire()]  # two admissions in progress elsewhere
        assert None not in held and slots.try_acquire() is None
        before = snapshot(engine, broker, storage)
        response = client.post("/v1/train/sft", json=sft_body(2))
        error = _error(response, 503, "admission_busy")
        assert response.headers["Retry-After"] == "2" and "2 submission(s)" in error["message"]
        assert "server.max_concurrent_admissions" in error["hint"]
        assert snapshot(engine, broker, storage) == before
        assert client.get("/health").status_code == 200 and client.get("/v1/train/status").status_code == 200
        slots.release(held.pop())
        assert client.post("/v1/train/sft", json=sft_body(2)).status_code == 200
        slots.release(held.pop())
        # A refused submission gives its slot back as an admitted one does.
        assert client.post("/v1/train/sft", json={"examples": []}).status_code == 400
        held = [slots.try_acquire(), slots.try_acquire()]
        assert None not in held
        for slot in held:
            slots.release(slot)
    finally:
        app.extensions["kiln"].close()
        other.extensions["kiln"].close()


# ----- path segments and query integers -----------------------------------------------------------


def _envelope(response) -> dict:
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
    error = _envelope(response)
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
    error = _envelope(response)
    assert error["code"] == "training_invalid_request"
    assert "at most 255" in error["message"]
    assert snapshot(engine, broker, storage) == before


def test_resume_checkpoint_of_255_bytes_is_looked_up(client, engine, broker, storage, runner):
    """The bound is the filesystem's: a 255-byte name is a plain 'does not exist'."""
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=sft_body(1, resume_checkpoint="c" * 255))
    assert response.status_code == 400
    assert "does not exist" in _envelope(response)["message"]
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
    assert _envelope(response)["code"] in {"not_found", "training_job_not_found"}
    assert snapshot(engine, broker, storage) == before


def test_a_job_named_events_is_not_reached_through_merged_slashes(client, runner):
    job_id = client.post("/v1/train/sft", json=sft_body(1)).get_json()["job_id"]
    assert client.get(f"/v1/train/jobs/{job_id}/events").status_code == 200
    response = client.get(f"/v1/train/jobs/{job_id}//events")
    assert response.status_code == 404
    assert _envelope(response)["code"] == "not_found"


# ----- query integers ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1_0", "%D9%A3", "%EF%BC%91", "%201", "+5", "1%20", "0x10", "1.0", "%00"])
def test_query_integers_are_ascii_decimal_digits(value, client, runner):
    """`int()` read `1_0` as 10, Arabic-Indic and fullwidth digits as numbers, and ` 1`/`+5`."""
    job_id = client.post("/v1/train/sft", json=sft_body(1)).get_json()["job_id"]
    for name in ("after", "limit"):
        response = client.get(f"/v1/train/jobs/{job_id}/events?{name}={value}")
        assert response.status_code == 400, (name, value)
        error = _envelope(response)
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
    assert "must be 0..=2147483647" in _envelope(huge)["message"]
    negative = client.get(f"/v1/train/jobs/{job_id}/events?after=-{'9' * 5000}")
    assert negative.status_code == 400
    assert "must be 0..=2147483647" in _envelope(negative)["message"]
