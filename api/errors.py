"""The error envelope on every error, any status (DESIGN.md §7, kiln-contract §1.6).

`{"error": {"code", "message", "hint"}}` for contract errors (`KilnError`), for werkzeug's own
HTTP errors (routing 404/405, the 413 of an oversized body), for malformed JSON, for a job
database that cannot be reached (503 `database_unavailable`) and for anything unexpected (500
`internal_error`, logged, never a traceback on the wire). Retryable
503s carry `Retry-After`. Handlers are registered on the app, not on a blueprint: blueprint
handlers never see routing errors (peers.md §4.1).
"""

from __future__ import annotations

import json
import logging

from flask import Flask, Response, jsonify
from sqlalchemy import exc as sa_exc
from werkzeug.exceptions import HTTPException

from kiln_train.errors import TRAINING_REQUEST_TOO_LARGE, KilnError

log = logging.getLogger(__name__)

# Codes the service adds beside the contract's (kiln_train.errors.ERROR_CATALOG).
UNAUTHORIZED = "unauthorized"
NOT_FOUND = "not_found"
METHOD_NOT_ALLOWED = "method_not_allowed"
INTERNAL_ERROR = "internal_error"
IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
DATABASE_UNAVAILABLE = "database_unavailable"
TRAINING_JOB_ACTIVE = "training_job_active"
UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
HOST_NOT_ALLOWED = "host_not_allowed"
ADMISSION_BUSY = "admission_busy"

MEMORY_BREAKDOWN_HEADER = "Kiln-Memory-Breakdown"

# code -> (status, Retry-After seconds or None, static hint)
API_ERRORS: dict[str, tuple[int, int | None, str]] = {
    UNAUTHORIZED: (401, None, "Send `Authorization: Bearer <token>` with a token from server.api_tokens."),
    NOT_FOUND: (404, None, "GET /openapi.json lists every route."),
    METHOD_NOT_ALLOWED: (405, None, "GET /openapi.json lists the methods each route accepts."),
    INTERNAL_ERROR: (500, None, "The server logged the failure; retry, and report it if it persists."),
    IDEMPOTENCY_KEY_REUSED: (
        422,
        None,
        "An Idempotency-Key names exactly one request body; use a new key for a different request.",
    ),
    DATABASE_UNAVAILABLE: (503, 5, "The job database is unreachable; retry after the Retry-After delay."),
    UNSUPPORTED_MEDIA_TYPE: (
        415,
        None,
        "Send the body as JSON with `Content-Type: application/json` (curl: -H 'Content-Type: application/json').",
    ),
    TRAINING_JOB_ACTIVE: (
        409,
        None,
        "Only finished jobs can be deleted; cancel it with DELETE /v1/train/queue/{job_id} first.",
    ),
    HOST_NOT_ALLOWED: (
        403,
        None,
        "A server without api tokens answers only the Host names in server.allowed_hosts "
        "(KILN_SERVER_ALLOWED_HOSTS); use one of them, add yours, or set server.api_tokens.",
    ),
    ADMISSION_BUSY: (
        503,
        2,
        "Other submissions are being validated and tokenized (server.max_concurrent_admissions at "
        "once); retry after the Retry-After delay.",
    ),
}


class ApiError(KilnError):
    """A service-level error (auth, routing, idempotency, ...) shaped like a contract error."""

    def __init__(self, code: str, message: str, *, hint: str | None = None) -> None:
        super().__init__(code, message, hint=hint)
        status, retry_after, default_hint = API_ERRORS[code]
        self.status = status
        self.retry_after = retry_after
        self.hint = hint if hint is not None else default_hint


def error_response(error: KilnError) -> Response:
    """The envelope with the code's status (and Retry-After when the code is retryable)."""
    response = jsonify(error.envelope())
    response.status_code = error.status
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(error.retry_after)
    if error.status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="kiln"'
    breakdown = getattr(error, "breakdown", None)
    if breakdown is not None:  # a 413 training_will_not_fit: its numbers, exact, beside the envelope
        response.headers[MEMORY_BREAKDOWN_HEADER] = json.dumps(breakdown, separators=(",", ":"))
    return response


def http_error(exc: HTTPException) -> KilnError:
    """Translate one of werkzeug's HTTP errors into an envelope-carrying error."""
    status = exc.code or 500
    if status == 413:
        return KilnError(
            TRAINING_REQUEST_TOO_LARGE, "the request body is larger than the server's server.max_request_mb"
        )
    if status == 404:
        return ApiError(NOT_FOUND, "no such route")
    if status == 405:
        return ApiError(METHOD_NOT_ALLOWED, "the route does not accept this method")
    code = (exc.name or "http_error").lower().replace(" ", "_").replace("'", "")
    error = KilnError(code, exc.description or exc.name or "HTTP error", hint="")
    error.status = status
    return error


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(KilnError)
    def _kiln(exc: KilnError) -> Response:
        return error_response(exc)

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException) -> Response:
        response = error_response(http_error(exc))
        if exc.code == 405 and exc.valid_methods:  # type: ignore[attr-defined]
            response.headers["Allow"] = ", ".join(sorted(exc.valid_methods))  # type: ignore[attr-defined]
        return response

    @app.errorhandler(sa_exc.OperationalError)
    @app.errorhandler(sa_exc.InterfaceError)
    def _store_unavailable(exc: sa_exc.DBAPIError) -> Response:
        # The connection failed (server down, restarting, SQLite busy past its timeout): the
        # transaction rolled back, nothing was written, and retrying later is the answer.
        log.warning("the job database is unavailable: %s", exc)
        return error_response(
            ApiError(DATABASE_UNAVAILABLE, "the job database is unavailable; nothing was changed")
        )

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error while serving a request")
        return error_response(ApiError(INTERNAL_ERROR, "internal server error"))
