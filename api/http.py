"""Small HTTP helpers shared by the blueprints: the JSON body, query integers, the services."""

from __future__ import annotations

import json
from typing import Any

from flask import Response, current_app, request
from pydantic import BaseModel

from api.services import Services
from kiln_train.errors import invalid_request


def services() -> Services:
    """The app's services (settings, database, broker, caches)."""
    return current_app.extensions["kiln"]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def json_body() -> tuple[Any, bytes]:
    """The decoded request body and its raw bytes; 400 `training_invalid_request` when it is not
    JSON (NaN/Infinity included). Reading an oversized body raises werkzeug's 413 first."""
    raw = request.get_data(cache=True)
    if not raw.strip():
        raise invalid_request("the request body is empty; send a JSON object")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant), raw
    except (UnicodeDecodeError, ValueError) as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}") from None


def query_int(name: str, default: int | None, *, minimum: int, maximum: int | None = None) -> int | None:
    """An integer query parameter within [minimum, maximum]; 400 naming it otherwise."""
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        raise invalid_request(f"query parameter {name}={raw!r} is not an integer") from None
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"{minimum}..={maximum}" if maximum is not None else f">= {minimum}"
        raise invalid_request(f"query parameter {name}={value} must be {bound}")
    return value


def json_response(model: BaseModel, status: int = 200) -> Response:
    """A pydantic response model as the JSON body."""
    return current_app.response_class(model.model_dump_json(), status=status, mimetype="application/json")


def json_list_response(models: list[BaseModel]) -> Response:
    """A JSON array of pydantic response models."""
    body = "[" + ",".join(m.model_dump_json() for m in models) + "]"
    return current_app.response_class(body, mimetype="application/json")
