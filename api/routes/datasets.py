"""Stored datasets (`/v1/datasets`) and the data inspector (`/v1/data/inspect`); see api.datasets."""

from __future__ import annotations

import tempfile
from pathlib import Path

from flask import Blueprint, Response, request

from api.admission import lock_admissions
from api.datasets import (
    DATASET_IN_USE,
    INSPECT_PAGE_DEFAULT,
    INSPECT_PAGE_MAX,
    NDJSON,
    DatasetList,
    DeletedDataset,
    dataset_error,
    dataset_file,
    describe_dataset,
    inspect_file,
    inspect_response,
    inspection_tokenizer,
    jobs_reading,
    list_datasets,
    remove_dataset,
    spooled_body,
    store_upload,
)
from api.errors import UNSUPPORTED_MEDIA_TYPE, ApiError
from api.http import json_response, query_int, services
from api.request_bounds import PageBudget
from api.routes.training import admission_slot
from kiln_train.data.ingestion_receipt import POLICIES
from kiln_train.errors import invalid_request

bp = Blueprint("datasets", __name__)

NDJSON_HINT = (
    f"Send the rows as JSON Lines with `Content-Type: {NDJSON}` "
    f"(curl: --data-binary @rows.jsonl -H 'Content-Type: {NDJSON}')."
)


def _require_ndjson() -> None:
    # Never a form or multipart body: those a web page on another site may send without asking.
    mimetype = request.mimetype
    if mimetype != NDJSON:
        raise ApiError(
            UNSUPPORTED_MEDIA_TYPE,
            f"the request body must be JSON Lines (Content-Type: {NDJSON}), not {mimetype or 'unlabelled'}",
            hint=NDJSON_HINT,
        )


def _policy(default: str) -> str:
    policy = request.args.get("invalid_row_policy", default)
    if policy not in POLICIES:
        raise invalid_request(
            f"query parameter invalid_row_policy={policy[:40]!r} must be one of {', '.join(POLICIES)}"
        )
    return policy


def _page() -> tuple[int, int]:
    offset = query_int("offset", 0, minimum=0, maximum=2**31 - 1)
    limit = query_int("limit", INSPECT_PAGE_DEFAULT, minimum=1, maximum=INSPECT_PAGE_MAX)
    assert offset is not None and limit is not None
    return offset, limit


@bp.post("/v1/datasets")
def upload() -> Response:
    """Store the JSON Lines body as dataset `name` after validating it (nothing stored on failure)."""
    _require_ndjson()
    name = request.args.get("name")
    if not name:
        raise invalid_request("query parameter name is required: POST /v1/datasets?name=NAME")
    policy = _policy("fail")
    svc = services()
    with admission_slot(svc):  # spooling, parsing and tokenizing: a submission's cost (/health stays fast)
        info = store_upload(svc, name, request.stream, policy, request.content_length)
    return json_response(info, status=201)


@bp.get("/v1/datasets")
def list_view() -> Response:
    return json_response(DatasetList(datasets=list_datasets(services().settings.datasets_dir)))


@bp.get("/v1/datasets/<dataset>")
def show(dataset: str) -> Response:
    return json_response(describe_dataset(services(), dataset))


@bp.delete("/v1/datasets/<dataset>")
def delete(dataset: str) -> Response:
    """Delete a stored dataset; 409 `dataset_in_use` while a queued or running job trains on it."""
    svc = services()
    root = svc.settings.datasets_dir
    path = dataset_file(root, dataset)
    with svc.sessions.begin() as session:
        lock_admissions(session)  # no admission commits a job naming the file while it goes
        readers = jobs_reading(session, root, path)
        if readers:
            raise dataset_error(DATASET_IN_USE, f"job {readers[0]} trains on dataset {dataset!r}")
        remove_dataset(root, path)
    return json_response(DeletedDataset(name=dataset, status="deleted"))


@bp.get("/v1/datasets/<dataset>/inspect")
def inspect_stored(dataset: str) -> Response:
    """Every row of a stored dataset as ingestion sees it (a page of them)."""
    svc = services()
    path = dataset_file(svc.settings.datasets_dir, dataset)
    policy = _policy("skip")
    offset, limit = _page()
    tokenizer, label = inspection_tokenizer(svc)
    with admission_slot(svc):
        inspection = inspect_file(path, tokenizer, policy, dataset, PageBudget(offset, limit))
        answer = inspect_response(inspection, tokenizer, label, offset, limit)
    return json_response(answer)


@bp.post("/v1/data/inspect")
def inspect_body() -> Response:
    """Every row of the JSON Lines body as ingestion sees it; nothing is stored."""
    _require_ndjson()
    svc = services()
    policy = _policy("fail")
    offset, limit = _page()
    tokenizer, label = inspection_tokenizer(svc)
    with (
        admission_slot(svc),
        tempfile.TemporaryDirectory(prefix="kiln-inspect-") as scratch,
        spooled_body(request.stream, Path(scratch), request.content_length) as (path, _sha256, _size),
    ):
        inspection = inspect_file(path, tokenizer, policy, "request body", PageBudget(offset, limit))
        answer = inspect_response(inspection, tokenizer, label, offset, limit)
    return json_response(answer)
