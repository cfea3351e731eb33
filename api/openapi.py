"""The OpenAPI 3.1 document served at `GET /openapi.json`.

Built from a hand-written route table (method, path, summary, body, responses) and the pydantic
models' JSON Schemas; `tests/api/test_openapi.py` keeps the table equal to the app's routes.

The document states what the server accepts, not only the shapes: path parameters carry their
patterns, query integers their bounds, and the request body the ranges its validators enforce
(`api.openapi_constraints`), so a client that follows the document is refused only for what a schema
cannot say (alpha/rank, the runner's rank range, memory, names already taken).
`tests/api/test_openapi_edges.py` holds the parser to these constraints at their edges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from api import schemas
from api.auth import PUBLIC_PATHS
from api.datasets import (
    DATASET_NAME_MAX,
    DATASET_NAME_PATTERN,
    INSPECT_PAGE_MAX,
    NDJSON,
    DatasetInfo,
    DatasetList,
    DeletedDataset,
    InspectResponse,
)
from api.hf import (
    GZIP_TYPES,
    HfDeletedExport,
    HfExportInfo,
    HfExportList,
    HfImportResponse,
    HfSftExportRequest,
)
from api.http import MAX_JSON_DEPTH
from api.openapi_constraints import constrain
from api.preflight import PreflightResponse
from api.ui import is_ui_path
from kiln.store.events import MAX_EVENT_PAGE
from kiln.store.jobs import JOB_ID_MAX
from kiln_train.interop.bundle import EXPORT_NAME_PATTERN
from kiln_train.sft_config import SftRequest

OPENAPI_VERSION = "3.1.0"
REF = "#/components/schemas/{model}"
# Event ids are a 32-bit autoincrement on Postgres; a larger cursor is garbage, not a page.
MAX_EVENT_ID = 2**31 - 1

# What a path parameter must look like to name anything (api.routes.adapters.check_adapter_name,
# kiln.store.possible_job_id); anything else is answered 400 invalid_adapter_name / 404.
PATH_PARAMETERS: dict[str, dict] = {
    "job_id": {"type": "string", "minLength": 1, "maxLength": JOB_ID_MAX},
    "name": {
        "type": "string",
        "pattern": "^[A-Za-z0-9._-]{1,255}$",
        "not": {"anyOf": [{"enum": [".", ".."]}, {"pattern": "\\.kiln-checkpoint$"}]},
    },
    "dataset": {"type": "string", "pattern": DATASET_NAME_PATTERN, "maxLength": DATASET_NAME_MAX},
    "filename": {"type": "string", "minLength": 1},
}

# The HF interop routes' names: an export bundle's (kiln_train.interop.bundle.check_export_name) and
# the name an imported adapter is registered under (kiln_train.artifacts.adapter.check_adapter_name,
# stricter than the adapter routes': it must start with a letter or digit).
EXPORT_NAME: dict = {"type": "string", "pattern": EXPORT_NAME_PATTERN}
IMPORT_NAME: dict = {
    "type": "string",
    "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$",
    "not": {"anyOf": [{"pattern": "\\.kiln-checkpoint$"}, {"pattern": "-checkpoint-step-"}]},
}


# Request headers (api.admission_checks.check_idempotency_key: 1..=255 printable ASCII; HTTP drops the
# whitespace around a header value, so the key neither starts nor ends with a space).
HEADER_SCHEMAS: dict[str, dict] = {
    "Idempotency-Key": {
        "type": "string",
        "minLength": 1,
        "maxLength": 255,
        "pattern": "^[!-~]([ -~]*[!-~])?$",
    },
}


@dataclass(frozen=True)
class QueryInt:
    """An integer query parameter and the bounds `api.http.query_int` enforces."""

    description: str
    minimum: int
    maximum: int | None = None

    def schema(self) -> dict:
        bounds = {"minimum": self.minimum}
        if self.maximum is not None:
            bounds["maximum"] = self.maximum
        return {"type": "integer", **bounds}


@dataclass(frozen=True)
class QueryStr:
    """A string query parameter and what the route accepts."""

    description: str
    schema_: dict
    required: bool = False

    def schema(self) -> dict:
        return self.schema_


POLICY_QUERY = QueryStr(
    "invalid_row_policy applied to the rows.", {"type": "string", "enum": ["fail", "skip"]}
)
PAGE_QUERY = {
    "offset": QueryInt("Rows to skip before the page.", 0, MAX_EVENT_ID),
    "limit": QueryInt("Rows in the page.", 1, INSPECT_PAGE_MAX),
}


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # OpenAPI form: /v1/train/status/{job_id}
    summary: str
    ok: type[BaseModel] | str | None  # model, a media type (raw body), or None
    body: type[BaseModel] | None = None
    query: dict[str, QueryInt | QueryStr] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # request headers -> description
    ok_is_list: bool = False
    raw_body: str | None = None  # media type of a body that is not JSON (JSON Lines uploads)
    ok_status: str = "200"
    ok_alternatives: tuple[type[BaseModel], ...] = ()  # other 200 bodies (oneOf)
    params: dict[str, dict] = field(default_factory=dict)  # path parameters unlike PATH_PARAMETERS


ROUTES: tuple[Route, ...] = (
    Route(
        "post",
        "/v1/train/sft",
        "Submit a native SFT job",
        schemas.TrainingResponse,
        body=SftRequest,
        headers={"Idempotency-Key": "Same key and body: the same job; same key, other body: 422."},
    ),
    Route("get", "/v1/train/status", "Every retained job", schemas.TrainingStatus, ok_is_list=True),
    Route("get", "/v1/train/status/{job_id}", "One job's status", schemas.TrainingStatus),
    Route(
        "get",
        "/v1/train/jobs/{job_id}",
        "Job detail: loss curve, receipt, checkpoint",
        schemas.TrainingJobDetail,
    ),
    Route("delete", "/v1/train/jobs/{job_id}", "Delete a finished job", schemas.DeletedJob),
    Route(
        "get",
        "/v1/train/jobs/{job_id}/events",
        "A page of the job's events",
        schemas.EventPage,
        query={
            "after": QueryInt(
                "Return events with id > after (the previous page's last_id).", 0, MAX_EVENT_ID
            ),
            "limit": QueryInt("Events per page.", 1, MAX_EVENT_PAGE),
        },
    ),
    Route("get", "/v1/train/queue", "The queue", schemas.QueueResponse),
    Route("delete", "/v1/train/queue/{job_id}", "Cancel a job", schemas.CancelResponse),
    Route(
        "get", "/v1/config", "Effective settings and the runner's training support", schemas.ConfigResponse
    ),
    Route(
        "get",
        "/health",
        "Readiness (liveness only without a token when api tokens are set)",
        schemas.HealthResponse,
        ok_alternatives=(schemas.HealthLiveness,),
    ),
    Route(
        "get",
        "/v1/health",
        "Readiness (liveness only without a token when api tokens are set)",
        schemas.HealthResponse,
        ok_alternatives=(schemas.HealthLiveness,),
    ),
    Route("get", "/v1/adapters", "Published adapters", schemas.AdapterList),
    Route("get", "/v1/adapters/{name}/download", "The adapter directory as tar.gz", "application/gzip"),
    Route("get", "/v1/adapters/{name}/receipt", "The adapter's train_receipt.json", "application/json"),
    Route(
        "delete", "/v1/adapters/{name}", "Delete an idle adapter and its checkpoints", schemas.DeletedAdapter
    ),
    Route("get", "/metrics", "Prometheus metrics", "text/plain"),
    Route("get", "/openapi.json", "This document", "application/json"),
    # ----- the browser UI and the routes it brought -----
    Route(
        "post",
        "/v1/train/sft/preflight",
        "A submission's whole admission without the job: the plan, or the error it would get",
        PreflightResponse,
        body=SftRequest,
    ),
    Route(
        "post",
        "/v1/datasets",
        "Validate and store a JSON Lines dataset under a new name",
        DatasetInfo,
        query={
            "name": QueryStr(
                "The dataset's name (never overwritten).",
                {"type": "string", "pattern": DATASET_NAME_PATTERN, "maxLength": DATASET_NAME_MAX},
                required=True,
            ),
            "invalid_row_policy": POLICY_QUERY,
        },
        raw_body=NDJSON,
        ok_status="201",
    ),
    Route("get", "/v1/datasets", "Stored datasets", DatasetList),
    Route("get", "/v1/datasets/{dataset}", "A stored dataset: rows, tokens, rejections", DatasetInfo),
    Route(
        "delete", "/v1/datasets/{dataset}", "Delete a dataset no queued or running job uses", DeletedDataset
    ),
    Route(
        "get",
        "/v1/datasets/{dataset}/inspect",
        "A stored dataset's rows as ingestion sees them",
        InspectResponse,
        query={"invalid_row_policy": POLICY_QUERY, **PAGE_QUERY},
    ),
    Route(
        "post",
        "/v1/data/inspect",
        "JSON Lines rows as ingestion sees them (nothing stored)",
        InspectResponse,
        query={"invalid_row_policy": POLICY_QUERY, **PAGE_QUERY},
        raw_body=NDJSON,
    ),
    Route(
        "get",
        "/v1/checkpoints",
        "Exact checkpoints in the adapter registry",
        schemas.CheckpointList,
        query={
            "adapter": QueryStr(
                "Only this adapter's checkpoints.", {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,255}$"}
            )
        },
    ),
    # ----- HF/TRL interop (api.hf) -----
    Route(
        "post",
        "/v1/train/hf/sft/exports",
        "Export admitted rows as a bundle for the pinned TRL runner",
        HfExportInfo,
        body=HfSftExportRequest,
        ok_status="201",
    ),
    Route("get", "/v1/train/hf/exports", "SFT export bundles", HfExportList),
    Route(
        "get", "/v1/train/hf/exports/{name}", "One export bundle", HfExportInfo, params={"name": EXPORT_NAME}
    ),
    Route(
        "delete",
        "/v1/train/hf/exports/{name}",
        "Delete an export bundle",
        HfDeletedExport,
        params={"name": EXPORT_NAME},
    ),
    Route(
        "get",
        "/v1/train/hf/exports/{name}/download",
        "The export bundle as tar.gz",
        "application/gzip",
        params={"name": EXPORT_NAME},
    ),
    Route(
        "post",
        "/v1/train/hf/peft/imports/{name}",
        "Check a PEFT LoRA adapter against the resident model and register it",
        HfImportResponse,
        raw_body=GZIP_TYPES[0],
        ok_status="201",
        params={"name": IMPORT_NAME},
    ),
    Route("get", "/", "The browser UI", "text/html"),
    Route("get", "/ui/defaults.json", "The SFT form's defaults (the server's)", "application/json"),
    Route("get", "/ui/{filename}", "A file of the browser UI", "application/octet-stream"),
)

MODELS: tuple[tuple[type[BaseModel], str], ...] = (
    (SftRequest, "validation"),
    (HfSftExportRequest, "validation"),
    (schemas.ErrorEnvelope, "serialization"),
    *((r.ok, "serialization") for r in ROUTES if isinstance(r.ok, type) and issubclass(r.ok, BaseModel)),
    *((m, "serialization") for r in ROUTES for m in r.ok_alternatives),
)


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def _path_parameters(path: str, overrides: dict[str, dict]) -> list[dict]:
    names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
    return [
        {"name": n, "in": "path", "required": True, "schema": overrides.get(n, PATH_PARAMETERS.get(n))}
        for n in names
    ]


def _raw_schema(media_type: str) -> dict:
    # A file served as it is on disk: JSON files are objects (serializers.read_json_file checks it).
    if media_type == "application/json":
        return {"type": "object"}
    return {"type": "string", "format": "binary"}


def _operation(route: Route, auth: bool) -> dict:
    params = _path_parameters(route.path, route.params)
    params += [
        {
            "name": n,
            "in": "query",
            "required": getattr(q, "required", False),
            "description": q.description,
            "schema": q.schema(),
        }
        for n, q in route.query.items()
    ]
    params += [
        {"name": n, "in": "header", "required": False, "description": d, "schema": HEADER_SCHEMAS[n]}
        for n, d in route.headers.items()
    ]
    if isinstance(route.ok, str):
        content = {route.ok: {"schema": _raw_schema(route.ok)}}
    elif route.ok is not None:
        schema = {"type": "array", "items": _ref(route.ok)} if route.ok_is_list else _ref(route.ok)
        if route.ok_alternatives:
            schema = {"oneOf": [schema, *(_ref(m) for m in route.ok_alternatives)]}
        content = {"application/json": {"schema": schema}}
    error = {
        "description": "Error envelope",
        "content": {"application/json": {"schema": _ref(schemas.ErrorEnvelope)}},
    }
    op: dict = {
        "summary": route.summary,
        "operationId": f"{route.method}_{route.path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
        "responses": {route.ok_status: {"description": "OK", "content": content}, "default": error},
    }
    if params:
        op["parameters"] = params
    if route.body is not None:
        op["requestBody"] = {
            "required": True,
            "description": f"JSON (Content-Type: application/json) of at most server.max_request_mb MiB "
            f"(larger: 413), arrays and objects nested at most {MAX_JSON_DEPTH} levels deep (deeper: 400).",
            "content": {"application/json": {"schema": _ref(route.body)}},
        }
    if route.raw_body is not None:
        op["requestBody"] = {
            "required": True,
            "description": "at most server.max_request_mb MiB (larger: 413)",
            "content": {route.raw_body: {"schema": {"type": "string"}}},
        }
    if auth and route.path not in PUBLIC_PATHS and not is_ui_path(route.path):
        op["security"] = [{"bearer": []}]
    return op


def build_document(auth: bool) -> dict:
    """The OpenAPI 3.1 document; `auth` marks the token-protected operations."""
    _, top = models_json_schema(list(MODELS), ref_template=REF)
    paths: dict[str, dict] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method] = _operation(route, auth)
    document = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "Kiln",
            "version": "1",
            "description": "Turn conversations into LoRA adapters for Qwen3.5.",
        },
        "paths": paths,
        "components": {
            "schemas": constrain(top.get("$defs", {})),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    return document
