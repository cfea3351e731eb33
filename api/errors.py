"""The error envelope on every error, any status (docs/errors.md#envelope).

`{"error": {"code", "message", "hint"}}` for contract errors (`KilnError`), for werkzeug's own
HTTP errors (routing 404/405, the 413 of an oversized body), for malformed JSON, for a job
database that cannot be reached (503 `database_unavailable`) and for anything unexpected (500
`internal_error`, logged, never a traceback on the wire). Retryable
503s carry `Retry-After`. Handlers are registered on the app, not on a blueprint: blueprint
handlers never see routing errors.
"""

from __future__ import annotations

import json
import logging

from flask import Flask, Response, jsonify
from sqlalchemy import exc as sa_exc
from werkzeug.exceptions import HTTPException

from api.path_redaction import redact_for_app
from kiln.store.errors import (
    ADAPTER_NOT_FOUND,
    TRAINING_JOB_ALREADY_STARTED,
    TRAINING_JOB_NOT_CANCELLABLE,
    TRAINING_JOB_NOT_FOUND,
)
from kiln_train.errors import (
    ADAPTER_ALREADY_EXISTS,
    INVALID_ADAPTER_NAME,
    TRAINING_BACKEND_UNSUPPORTED,
    TRAINING_INVALID_REQUEST,
    TRAINING_WILL_NOT_FIT,
    KilnError,
)
from kiln_train.interop.errors import (
    HF_EXPORT_ALREADY_EXISTS,
    HF_EXPORT_NOT_FOUND,
    HF_EXPORT_UNSUPPORTED,
    PEFT_IMPORT_INVALID,
    PEFT_IMPORT_MISMATCH,
)

log = logging.getLogger(__name__)

# Contract codes only the service raises (the library's are in kiln_train.errors, the job
# store's in kiln.store.errors).
TRAINING_REQUEST_TOO_LARGE = "training_request_too_large"
TRAINING_QUEUE_FULL = "training_queue_full"
TRAINING_TRACKED_FULL = "training_tracked_full"
TRAINING_ADMISSION_BUSY = "training_admission_busy"
TRAINING_NO_RUNNER = "training_no_runner"
SERVER_SHUTTING_DOWN = "server_shutting_down"
ADAPTER_ACTIVE = "adapter_active"
# Codes the service adds beside the contract's.
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

# code -> (HTTP status, Retry-After seconds or None, static hint); a None hint: the error's own
# (the library's codes carry theirs, kiln_train.errors.ERROR_TEXT). A code not listed is a 500.
API_ERRORS: dict[str, tuple[int, int | None, str | None]] = {
    # raised by the training library
    TRAINING_INVALID_REQUEST: (400, None, None),
    TRAINING_BACKEND_UNSUPPORTED: (501, None, None),
    TRAINING_WILL_NOT_FIT: (413, None, None),
    INVALID_ADAPTER_NAME: (400, None, None),
    ADAPTER_ALREADY_EXISTS: (409, None, None),
    # raised by the HF/TRL interop library (its hints are its own)
    HF_EXPORT_NOT_FOUND: (404, None, None),
    HF_EXPORT_ALREADY_EXISTS: (409, None, None),
    HF_EXPORT_UNSUPPORTED: (400, None, None),
    PEFT_IMPORT_INVALID: (400, None, None),
    PEFT_IMPORT_MISMATCH: (409, None, None),
    # raised by the job store
    TRAINING_JOB_NOT_FOUND: (404, None, "List jobs with GET /v1/train/status."),
    TRAINING_JOB_NOT_CANCELLABLE: (409, None, "The job already finished; nothing to cancel."),
    TRAINING_JOB_ALREADY_STARTED: (
        409,
        None,
        "The job left the queue while the cancel was processed; cancel it again to stop it cooperatively.",
    ),
    ADAPTER_NOT_FOUND: (404, None, "List adapters with GET /v1/adapters."),
    # the rest of the contract's codes, raised by the service
    TRAINING_REQUEST_TOO_LARGE: (
        413,
        None,
        "Send the data as a server-local dataset_path under the storage root's datasets/ directory.",
    ),
    TRAINING_QUEUE_FULL: (503, 30, "The training queue is full; retry after the Retry-After delay."),
    TRAINING_TRACKED_FULL: (503, 30, "Too many tracked jobs; delete finished jobs or retry later."),
    TRAINING_ADMISSION_BUSY: (503, 1, "Another admission is in progress; retry shortly."),
    TRAINING_NO_RUNNER: (
        503,
        10,
        "Start a worker (`kiln worker`); submissions are admitted only against a live runner.",
    ),
    SERVER_SHUTTING_DOWN: (503, 5, "The server is shutting down; retry against the new instance."),
    ADAPTER_ACTIVE: (409, None, "A running job is writing this adapter; wait for it to finish."),
    # the service's own codes
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
_UNLISTED = (500, None, "")


class ApiError(KilnError):
    """An error the service raises with a code of `API_ERRORS`, or with any code and an explicit
    HTTP `status` (werkzeug's own errors, the dataset routes' codes)."""

    def __init__(
        self, code: str, message: str, *, hint: str | None = None, status: int | None = None
    ) -> None:
        super().__init__(code, message, hint=hint)
        if status is None:
            status, retry_after, default_hint = API_ERRORS[code]
        else:
            retry_after, default_hint = None, ""
        self.status = status
        self.retry_after = retry_after
        if self.hint is None:
            self.hint = default_hint


def http_status(error: KilnError) -> int:
    """The HTTP status that answers `error`: an `ApiError`'s own, else its code's."""
    if isinstance(error, ApiError):
        return error.status
    return API_ERRORS.get(error.code, _UNLISTED)[0]


def _retry_after(error: KilnError) -> int | None:
    if isinstance(error, ApiError):
        return error.retry_after
    return API_ERRORS.get(error.code, _UNLISTED)[1]


def _hint(error: KilnError) -> str:
    if error.hint is not None:
        return error.hint
    return API_ERRORS.get(error.code, _UNLISTED)[2] or ""


def error_response(error: KilnError) -> Response:
    """The envelope with the code's status (and Retry-After when the code is retryable)."""
    status = http_status(error)
    message = redact_for_app(error.message)  # no server path in an answer (docs/security.md)
    response = jsonify({"error": {"code": error.code, "message": message, "hint": _hint(error)}})
    response.status_code = status
    retry_after = _retry_after(error)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    if status == 401:
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
    return ApiError(code, exc.description or exc.name or "HTTP error", hint="", status=status)


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
