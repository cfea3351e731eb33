"""Small HTTP helpers shared by the blueprints: the JSON body, query integers, the services."""

from __future__ import annotations

import re
from typing import Any

from flask import Response, current_app, request
from pydantic import BaseModel
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from api import json_text
from api.errors import UNSUPPORTED_MEDIA_TYPE, ApiError
from api.services import Services
from kiln_train.errors import invalid_request

# Deepest nesting of arrays and objects in a request body (the body itself is level 1); a chat
# row with tool calls and their JSON arguments needs well under half of it.
MAX_JSON_DEPTH = 64


def services() -> Services:
    """The app's services (settings, database, broker, caches)."""
    return current_app.extensions["kiln"]


def _child(path: str, step: str | int) -> str:
    if isinstance(step, int):
        return f"{path}[{step}]"
    return f"{path}.{step}" if path else step


def unstorable_value(value: Any) -> str | None:
    """Why `value` (decoded JSON) cannot be stored and processed as given, naming the path, or None.

    Arrays and objects nest at most `MAX_JSON_DEPTH` deep: validation, the request fingerprint
    and the job store all recurse through the body. Strings must be valid Unicode (no lone
    surrogates from `\\ud800` escapes) without U+0000: the job store keeps request fields
    verbatim and Postgres text/JSONB cannot hold NUL.
    """
    stack: list[tuple[str, Any, int]] = [("", value, 1)]
    while stack:
        path, item, depth = stack.pop()
        if isinstance(item, dict | list) and depth > MAX_JSON_DEPTH:
            return (
                f"the request body is nested too deeply at {path}: at most {MAX_JSON_DEPTH} levels of "
                "arrays and objects are accepted"
            )
        if isinstance(item, dict):
            for key, child in item.items():
                where = _child(path, key)
                problem = _string_problem(key)
                if problem is not None:
                    return f"a key of {path or 'the body'} {problem}"
                stack.append((where, child, depth + 1))
        elif isinstance(item, list):
            stack.extend((_child(path, i), child, depth + 1) for i, child in enumerate(item))
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


def read_body() -> bytes:
    """The raw request body; 413 (werkzeug's) when it is over `MAX_CONTENT_LENGTH`.

    A body without Content-Length (`Transfer-Encoding: chunked`) is read through werkzeug's
    limit, which stops at the limit without a word: one more byte from the server's stream
    tells a body of exactly the limit from a longer one, which is refused, never parsed cut.
    """
    try:
        raw = request.get_data(cache=True)
        limit = current_app.config["MAX_CONTENT_LENGTH"]
        cut = request.content_length is None and limit is not None and len(raw) >= limit
        if cut and request.environ["wsgi.input"].read(1):
            raise RequestEntityTooLarge()
    except HTTPException:
        raise
    except Exception as exc:  # the server's body reader: malformed chunked framing, a client gone
        raise invalid_request(f"the request body could not be read: {exc}") from None
    return raw


def discard_body() -> None:
    """Read and drop the rest of the request body (at most the size limit): a refusal given
    before reading it then reaches the client, where gunicorn, which drains only 64 KiB itself,
    would reset the connection under a client still sending."""
    try:
        while request.stream.read(1 << 16):
            pass
    except Exception:  # over the limit or broken framing: the connection closes after the answer
        pass


def json_body() -> tuple[Any, bytes]:
    """The decoded request body and its raw bytes; 400 `training_invalid_request` when it is not
    JSON (NaN/Infinity, out-of-range numbers, duplicate keys, nesting deeper than
    `MAX_JSON_DEPTH`) or holds a string the job store cannot keep (NUL, lone surrogates), naming
    where. An oversized body is 413 before any of it is parsed."""
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
    raw = read_body()
    if not raw.strip():
        raise invalid_request("the request body is empty; send a JSON object")
    try:
        body = json_text.loads(raw.decode("utf-8"))
    except RecursionError:
        raise invalid_request(
            f"the request body is nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays and "
            "objects are accepted"
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}") from None
    problem = unstorable_value(body)
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
