"""`POST /v1/train/sft`: submit a native SFT job (kiln-contract §1.1, admission in api.admission)."""

from __future__ import annotations

import time

from flask import Blueprint, Response, request
from werkzeug.exceptions import HTTPException

from api.admission import admit_sft
from api.errors import http_error
from api.http import json_body, json_response, services
from api.views import training_response
from kiln_train.errors import KilnError

bp = Blueprint("training", __name__)

REPLAY_HEADER = "Idempotent-Replayed"


@bp.post("/v1/train/sft")
def submit_sft() -> Response:
    """Admit an SFT job: 200 TrainingResponse, or the envelope of the first gate that refused it."""
    svc = services()
    started = time.perf_counter()
    try:
        body, _raw = json_body()
        admitted = admit_sft(svc, body, request.headers.get("Idempotency-Key"))
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
