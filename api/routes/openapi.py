"""`GET /openapi.json`: the OpenAPI 3.1 document of this api."""

from __future__ import annotations

import json
from functools import lru_cache

from flask import Blueprint, Response

from api.http import services
from api.openapi import build_document

bp = Blueprint("openapi", __name__)


@lru_cache(maxsize=2)
def _document_text(auth: bool) -> str:
    return json.dumps(build_document(auth), indent=2)


@bp.get("/openapi.json")
def openapi_document() -> Response:
    auth = bool(services().settings.server.api_tokens)
    return Response(_document_text(auth), mimetype="application/json")
