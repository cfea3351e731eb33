"""Bearer-token auth (DESIGN.md §1; kiln-contract §1 has none: loopback was the boundary).

With `server.api_tokens` set, every route but the probes (`/health`, `/v1/health`, `/metrics`)
and the browser UI's static files (`/`, `/ui/...`: no data in them) needs `Authorization: Bearer <token>`; tokens are compared in constant time. Without tokens the
api is open, and `kiln serve` refuses a non-loopback bind unless explicitly allowed.
"""

from __future__ import annotations

import hmac

from flask import Flask, request

from api.errors import UNAUTHORIZED, ApiError
from api.openapi import PUBLIC_PATHS
from api.ui import is_ui_path


def token_matches(presented: str, tokens: list[str]) -> bool:
    """Constant-time comparison against every configured token (no early exit on a match)."""
    given = presented.encode("utf-8")
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(given, token.encode("utf-8"))
    return matched


def install_auth(app: Flask, tokens: list[str]) -> None:
    if not tokens:
        return

    @app.before_request
    def _require_bearer() -> None:
        if request.path in PUBLIC_PATHS or is_ui_path(request.path):
            return
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            raise ApiError(UNAUTHORIZED, "missing bearer token")
        if not token_matches(presented.strip(), tokens):
            raise ApiError(UNAUTHORIZED, "invalid bearer token")
