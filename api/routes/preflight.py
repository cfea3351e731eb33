"""`POST /v1/train/sft/preflight`: a submission's whole admission, answered as a plan (api.preflight)."""

from __future__ import annotations

from flask import Blueprint, Response

from api.http import json_body, json_response, services
from api.preflight import preflight_sft
from api.routes.training import admission_slot

bp = Blueprint("preflight", __name__)


@bp.post("/v1/train/sft/preflight")
def preflight() -> Response:
    """The plan a submission of this body would be admitted with, or the error it would get."""
    svc = services()
    with admission_slot(svc):  # the whole admission but the commit: a submission's cost
        body, _raw = json_body()
        answer = preflight_sft(svc, body)
    return json_response(answer)
