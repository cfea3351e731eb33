"""The OpenAPI 3.1 document served at `GET /openapi.json`.

Built from a hand-written route table (method, path, summary, body, responses) and the pydantic
models' JSON Schemas; `tests/api/test_openapi.py` keeps the table equal to the app's routes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from api import schemas
from kiln_train.sft_config import SftRequest

OPENAPI_VERSION = "3.1.0"
REF = "#/components/schemas/{model}"
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/metrics"})


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # OpenAPI form: /v1/train/status/{job_id}
    summary: str
    ok: type[BaseModel] | str | None  # model, a media type (raw body), or None
    body: type[BaseModel] | None = None
    query: dict[str, str] = field(default_factory=dict)  # name -> description (integers)
    headers: dict[str, str] = field(default_factory=dict)  # request headers -> description
    ok_is_list: bool = False


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
        query={"after": "Return events with id > after (the previous page's last_id).", "limit": "1..=1000"},
    ),
    Route("get", "/v1/train/queue", "The queue", schemas.QueueResponse),
    Route("delete", "/v1/train/queue/{job_id}", "Cancel a job", schemas.CancelResponse),
    Route(
        "get", "/v1/config", "Effective settings and the runner's training support", schemas.ConfigResponse
    ),
    Route("get", "/health", "Readiness", schemas.HealthResponse),
    Route("get", "/v1/health", "Readiness", schemas.HealthResponse),
    Route("get", "/v1/adapters", "Published adapters", schemas.AdapterList),
    Route("get", "/v1/adapters/{name}/download", "The adapter directory as tar.gz", "application/gzip"),
    Route("get", "/v1/adapters/{name}/receipt", "The adapter's train_receipt.json", "application/json"),
    Route(
        "delete", "/v1/adapters/{name}", "Delete an idle adapter and its checkpoints", schemas.DeletedAdapter
    ),
    Route("get", "/metrics", "Prometheus metrics", "text/plain"),
    Route("get", "/openapi.json", "This document", "application/json"),
)

MODELS: tuple[tuple[type[BaseModel], str], ...] = (
    (SftRequest, "validation"),
    (schemas.ErrorEnvelope, "serialization"),
    *((r.ok, "serialization") for r in ROUTES if isinstance(r.ok, type) and issubclass(r.ok, BaseModel)),
)


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def _path_parameters(path: str) -> list[dict]:
    names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
    return [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names]


def _operation(route: Route, auth: bool) -> dict:
    params = _path_parameters(route.path)
    params += [
        {"name": n, "in": "query", "required": False, "description": d, "schema": {"type": "integer"}}
        for n, d in route.query.items()
    ]
    params += [
        {"name": n, "in": "header", "required": False, "description": d, "schema": {"type": "string"}}
        for n, d in route.headers.items()
    ]
    if isinstance(route.ok, str):
        content = {route.ok: {"schema": {"type": "string", "format": "binary"}}}
    elif route.ok is not None:
        schema = {"type": "array", "items": _ref(route.ok)} if route.ok_is_list else _ref(route.ok)
        content = {"application/json": {"schema": schema}}
    error = {
        "description": "Error envelope",
        "content": {"application/json": {"schema": _ref(schemas.ErrorEnvelope)}},
    }
    op: dict = {
        "summary": route.summary,
        "operationId": f"{route.method}_{route.path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}",
        "responses": {"200": {"description": "OK", "content": content}, "default": error},
    }
    if params:
        op["parameters"] = params
    if route.body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(route.body)}}}
    if auth and route.path not in PUBLIC_PATHS:
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
            "schemas": top.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    return document
