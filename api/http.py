"""Small HTTP helpers shared by the blueprints: the JSON body, query integers, the services."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from flask import Response, current_app, request
from pydantic import BaseModel

from api.errors import UNSUPPORTED_MEDIA_TYPE, ApiError
from api.services import Services
from kiln_train.errors import invalid_request


def services() -> Services:
    """The app's services (settings, database, broker, caches)."""
    return current_app.extensions["kiln"]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf: not a number JSON can carry
        raise ValueError(f"the number {text} is out of range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:  # which one would win is up to the parser; refuse the ambiguity
            raise ValueError(f"duplicate key {key!r} in one object")
        obj[key] = value
    return obj


def _child(path: str, step: str | int) -> str:
    if isinstance(step, int):
        return f"{path}[{step}]"
    return f"{path}.{step}" if path else step


def unstorable_string(value: Any) -> str | None:
    """Why `value` (decoded JSON) cannot be stored as given, naming the path, or None.

    Strings must be valid Unicode (no lone surrogates from `\\ud800` escapes) without U+0000:
    the job store keeps request fields verbatim and Postgres text/JSONB cannot hold NUL.
    """
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                where = _child(path, key)
                problem = _string_problem(key)
                if problem is not None:
                    return f"a key of {path or 'the body'} {problem}"
                stack.append((where, child))
        elif isinstance(item, list):
            stack.extend((_child(path, i), child) for i, child in enumerate(item))
        elif isinstance(item, str):
            problem = _string_problem(item)
            if problem is not None:
                return f"{path} {problem}"
    return None


def _string_problem(text: str) -> str | None:
    if "\0" in text:
        return "contains U+0000 (NUL), which the job store cannot hold"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone UTF-16 surrogate escape (not a Unicode character)"
    return None


def json_body() -> tuple[Any, bytes]:
    """The decoded request body and its raw bytes; 400 `training_invalid_request` when it is not
    JSON (NaN/Infinity, out-of-range numbers, duplicate keys, nesting too deep for the parser)
    or holds a string the job store cannot keep (NUL, lone surrogates), naming where. Reading
    an oversized body raises werkzeug's 413 first."""
    mimetype = request.mimetype
    if mimetype != "application/json" and not (
        mimetype.startswith("application/") and mimetype.endswith("+json")
    ):
        # What a browser may send cross-site without a CORS preflight (form, multipart, text) is
        # never a job: with no API tokens on loopback, a web page could otherwise queue one.
        raise ApiError(
            UNSUPPORTED_MEDIA_TYPE,
            f"the request body must be JSON (Content-Type: application/json), not {mimetype or 'unlabelled'}",
        )
    raw = request.get_data(cache=True)
    if not raw.strip():
        raise invalid_request("the request body is empty; send a JSON object")
    try:
        body = json.loads(
            raw.decode("utf-8"),
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            object_pairs_hook=_unique_keys,
        )
    except RecursionError:
        raise invalid_request("the request body is not valid JSON: it is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}") from None
    problem = unstorable_string(body)
    if problem is not None:
        raise invalid_request(problem)
    return body, raw


_DECIMAL = re.compile(r"-?[0-9]+")  # ASCII only: int() also takes "1_0", " 1", "+1", "١"


def query_int(name: str, default: int | None, *, minimum: int, maximum: int | None = None) -> int | None:
    """An integer query parameter within [minimum, maximum]; 400 naming it otherwise."""
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    if not _DECIMAL.fullmatch(raw):
        raise invalid_request(f"query parameter {name}={raw[:40]!r} is not a decimal integer")
    if len(raw.lstrip("-").lstrip("0")) > 20:  # beyond any bound; int() refuses over 4300 digits
        value = -(10**20) if raw.startswith("-") else 10**20
        shown = raw[:20] + "..."
    else:
        value = int(raw, 10)
        shown = str(value)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"{minimum}..={maximum}" if maximum is not None else f">= {minimum}"
        raise invalid_request(f"query parameter {name}={shown} must be {bound}")
    return value


def json_response(model: BaseModel, status: int = 200) -> Response:
    """A pydantic response model as the JSON body."""
    return current_app.response_class(model.model_dump_json(), status=status, mimetype="application/json")


def json_list_response(models: list[BaseModel]) -> Response:
    """A JSON array of pydantic response models."""
    body = "[" + ",".join(m.model_dump_json() for m in models) + "]"
    return current_app.response_class(body, mimetype="application/json")
