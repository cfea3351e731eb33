"""What one upload or inspection may cost (docs/security.md#what-a-request-may-cost): a line past
MAX_LINE_BYTES is a 400 naming the line before anything is parsed, and leaves nothing behind;
an inspector answer ends its page before its token pieces pass the budget."""

from __future__ import annotations

import json

import pytest

from api import create_app, request_bounds
from api.request_bounds import MAX_LINE_BYTES, LineMeter
from kiln_train.errors import KilnError
from tests.api.conftest import example, make_settings, snapshot

NDJSON = {"Content-Type": "application/x-ndjson"}


def long_row(size: int) -> bytes:
    row = json.dumps(example(0)).encode()
    return row[:-2] + b', "pad": "' + b"x" * (size - len(row) - 10) + b'"}'


def test_a_line_meter_finds_the_line_across_chunk_boundaries():
    meter = LineMeter(limit=10)
    meter.feed(b"short\n0123")
    meter.feed(b"456789\nok")  # line 2 is exactly 10 bytes, split over two chunks
    with pytest.raises(KilnError, match="line 3 of the body is longer than 10 bytes"):
        meter.feed(b"-and-more\n")
    meter = LineMeter(limit=10)
    with pytest.raises(KilnError, match="line 4 of the body"):
        meter.feed(b"a\nb\nc\n" + b"y" * 11)


@pytest.mark.parametrize("route", ["/v1/datasets?name=long.jsonl", "/v1/data/inspect"])
def test_a_line_past_the_bound_is_a_400_and_leaves_nothing(route, client, runner, engine, broker, storage):
    rows = json.dumps(example(0)).encode() + b"\n" + long_row(MAX_LINE_BYTES + 1) + b"\n"
    assert len(rows.split(b"\n")[1]) == MAX_LINE_BYTES + 1
    before = snapshot(engine, broker, storage)
    answer = client.post(route, data=rows, headers=NDJSON)
    assert answer.status_code == 400, answer.get_json()
    error = answer.get_json()["error"]
    assert error["code"] == "training_invalid_request"
    assert f"line 2 of the body is longer than {MAX_LINE_BYTES} bytes" in error["message"]
    assert "docs/security.md" in error["hint"]
    assert snapshot(engine, broker, storage) == before


def test_an_inspector_page_ends_before_its_pieces_pass_the_budget(client, runner, monkeypatch):
    rows = [json.dumps(example(i)) for i in range(5)]
    body = ("\n".join(rows) + "\n").encode()
    full = client.post("/v1/data/inspect", data=body, headers=NDJSON).get_json()
    costs = [r["facts"]["seq_len"] for r in full["rows"]]
    assert len(full["rows"]) == 5 and not full["has_more"]
    monkeypatch.setattr(request_bounds, "INSPECT_PIECES_MAX", costs[0] + costs[1])
    first = client.post("/v1/data/inspect", data=body, headers=NDJSON).get_json()
    assert [r["facts"]["row_index"] for r in first["rows"]] == [1, 2] and first["has_more"]
    assert first["rows_read"] == 5 and first["tokens"] == full["tokens"]
    assert [r["pieces"] for r in first["rows"]] == [r["pieces"] for r in full["rows"][:2]]
    after = client.post("/v1/data/inspect?offset=2", data=body, headers=NDJSON).get_json()
    assert after["offset"] == 2 and after["rows"][0]["facts"]["row_index"] == 3
    # a row whose pieces alone pass the budget is shown without them, alone on its page
    monkeypatch.setattr(request_bounds, "INSPECT_PIECES_MAX", min(costs) - 1)
    alone = client.post("/v1/data/inspect", data=body, headers=NDJSON).get_json()
    assert len(alone["rows"]) == 1 and alone["rows"][0]["pieces"] is None and alone["has_more"]
    assert alone["rows"][0]["facts"] == full["rows"][0]["facts"]


def _send(client, method: str, route: str, kind: str | None, row: bytes):
    if kind == "ndjson":
        return getattr(client, method)(route, data=row, headers=NDJSON)
    if kind == "json":
        return getattr(client, method)(route, json={"examples": [example(0)], "config": {}})
    return getattr(client, method)(route)


@pytest.mark.parametrize(
    ("method", "route", "kind"),
    [
        ("post", "/v1/datasets?name=busy.jsonl", "ndjson"),
        ("post", "/v1/data/inspect", "ndjson"),
        ("get", "/v1/datasets/stored.jsonl/inspect", None),
        ("post", "/v1/train/sft/preflight", "json"),
        ("post", "/v1/train/sft", "json"),
    ],
)
def test_tokenizing_routes_take_an_admission_slot(
    method, route, kind, app, client, runner, engine, broker, storage
):
    """With every slot held, each route that parses and tokenizes rows answers 503 at once (so the
    threads and cores left keep /health fast) and writes nothing; with a slot free it is answered."""
    row = json.dumps(example(0)).encode() + b"\n"
    assert client.post("/v1/datasets?name=stored.jsonl", data=row, headers=NDJSON).status_code == 201
    slots = app.extensions["kiln"].admission_slots
    held = [slots.try_acquire() for _ in range(slots.count)]
    try:
        before = snapshot(engine, broker, storage)
        answer = _send(client, method, route, kind, row)
        assert answer.status_code == 503, answer.get_json()
        assert answer.get_json()["error"]["code"] == "admission_busy" and answer.headers["Retry-After"] == "2"
        assert snapshot(engine, broker, storage) == before
    finally:
        for slot in held:
            slots.release(slot)
    assert _send(client, method, route, kind, row).status_code in (200, 201)


def test_a_body_of_exactly_the_size_limit_is_stored(storage, db_url, engine, broker, runner):
    """Under gunicorn (`wsgi.input_terminated`) the stream is cut at server.max_request_mb and one
    read past a body of exactly that size is a 413: the upload reads Content-Length bytes, no more."""
    app = create_app(make_settings(storage, db_url, broker.queue, server={"max_request_mb": 1}))
    row = json.dumps(example(0)).encode() + b"\n"
    body = row * ((1 << 20) // len(row))
    body += b" " * ((1 << 20) - len(body))
    gunicorn_like = {"wsgi.input_terminated": True}
    try:
        client = app.test_client()
        for route, status in (("/v1/data/inspect", 200), ("/v1/datasets?name=full.jsonl", 201)):
            answer = client.post(route, data=body, headers=NDJSON, environ_overrides=gunicorn_like)
            assert answer.status_code == status, (route, answer.get_json())
        over = client.post("/v1/datasets?name=over.jsonl", data=body + b" ", headers=NDJSON)
        assert over.status_code == 413 and over.get_json()["error"]["code"] == "training_request_too_large"
    finally:
        app.extensions["kiln"].close()


def test_a_busy_answer_to_a_large_body_waits_in_proportion_to_it(app, client, runner):
    """A refused client sends its body again after Retry-After: 2 s for a small body, one second
    per 4 MiB for a large one, so resends cost the server at most 4 MiB/s per client."""
    slots = app.extensions["kiln"].admission_slots
    held = [slots.try_acquire() for _ in range(slots.count)]
    try:
        row = json.dumps(example(0)).encode() + b"\n"
        body = row * ((13 << 20) // len(row))
        large = client.post("/v1/datasets?name=large.jsonl", data=body, headers=NDJSON)
        small = client.post("/v1/datasets?name=small.jsonl", data=row, headers=NDJSON)
    finally:
        for slot in held:
            slots.release(slot)
    assert large.status_code == 503 and large.headers["Retry-After"] == "4"
    assert small.status_code == 503 and small.headers["Retry-After"] == "2"


def _big_example() -> dict:
    big = example(0)
    big["messages"][-1]["content"] = "y" * MAX_LINE_BYTES
    return big


@pytest.mark.parametrize(
    ("route", "body", "where"),
    [
        ("/v1/train/sft", {"examples": [example(0), _big_example()], "config": {}}, "examples[1]"),
        ("/v1/train/sft/preflight", {"examples": [_big_example()], "config": {}}, "examples[0]"),
        (
            "/v1/train/sft",
            {"examples": [example(0)], "validation": {"examples": [_big_example()]}, "config": {}},
            "validation.examples[0]",
        ),
        (
            "/v1/train/hf/sft/exports",
            {"name": "big", "examples": [_big_example()], "config": {}},
            "examples[0]",
        ),
    ],
)
def test_an_inline_example_is_bounded_like_a_row(route, body, where, client, runner, engine, broker, storage):
    before = snapshot(engine, broker, storage)
    answer = client.post(route, json=body)
    assert answer.status_code == 400, answer.get_json()
    error = answer.get_json()["error"]
    assert error["code"] == "training_invalid_request"
    assert f"{where} is " in error["message"] and f"at most {MAX_LINE_BYTES}" in error["message"], error
    assert snapshot(engine, broker, storage) == before
