"""`POST /v1/train/sft`: submit a native SFT job (admission in api.admission; docs/ARCHITECTURE.md#routes)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

from flask import Blueprint, Response, request
from werkzeug.exceptions import HTTPException

from api.admission import admit_sft
from api.auth import caller_scope
from api.errors import ADMISSION_BUSY, ApiError, http_error
from api.http import discard_body, json_body, json_response, services
from api.serializers import training_response
from api.services import Services
from kiln_train.errors import KilnError

bp = Blueprint("training", __name__)

REPLAY_HEADER = "Idempotent-Replayed"
BUSY_RESEND_BYTES_PER_S = 4 << 20


@contextmanager
def admission_slot(svc: Services) -> Iterator[None]:
    """One of the server's `server.max_concurrent_admissions` slots, or 503 `admission_busy` at once.

    Taken before the body is read: parsing, validating and tokenizing a large body is the costly
    part, and submissions beyond the slots must not queue behind it (nor starve /health and the
    status reads of the server's threads and cores)."""
    slot = svc.admission_slots.try_acquire()
    if slot is None:
        discard_body()
        busy = ApiError(
            ADMISSION_BUSY,
            f"{svc.admission_slots.count} submission(s) are already being admitted by this server",
        )
        # Each refusal costs the server a read of the whole body, and a client that obeys
        # Retry-After sends it again: paced by its size, a client's resends stay under
        # BUSY_RESEND_BYTES_PER_S however large the body (docs/security.md#health-under-load).
        resend = math.ceil((request.content_length or 0) / BUSY_RESEND_BYTES_PER_S)
        busy.retry_after = max(busy.retry_after or 0, resend)
        raise busy
    try:
        yield
    finally:
        svc.admission_slots.release(slot)


@bp.post("/v1/train/sft")
def submit_sft() -> Response:
    """Admit an SFT job: 200 TrainingResponse, or the envelope of the first gate that refused it."""
    svc = services()
    started = time.perf_counter()
    try:
        with admission_slot(svc):  # admission step (1)
            body, _raw = json_body()  # (2)
            admitted = admit_sft(svc, body, request.headers.get("Idempotency-Key"), caller_scope())
    except KilnError as exc:
        svc.metrics.observe_admission("rejected", exc.code, time.perf_counter() - started)
        raise
    except HTTPException as exc:
        svc.metrics.observe_admission("rejected", http_error(exc).code, time.perf_counter() - started)
        raise
    outcome = "replayed" if admitted.replayed else "admitted"
    response = json_response(training_response(admitted.job, admitted.summary, admitted.message))
    if admitted.replayed:
        response.headers[REPLAY_HEADER] = "true"
    svc.metrics.observe_admission(outcome, "", time.perf_counter() - started)
    return response
