"""`POST /v1/train/sft/preflight`: a submission's whole admission, answered as a plan (api.preflight)."""

from __future__ import annotations

from flask import Blueprint, Response

from api.http import json_body, json_response, services
from api.preflight import preflight_sft

bp = Blueprint("preflight", __name__)


@bp.post("/v1/train/sft/preflight")
def preflight() -> Response:
    """The plan a submission of this body would be admitted with, or the error it would get."""
    body, _raw = json_body()
    return json_response(preflight_sft(services(), body))
