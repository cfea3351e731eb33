"""Who may ask: bearer tokens, and the Host names a token-less server answers.

With `server.api_tokens` set, every route but the probes (`/health`, `/v1/health`)
and the browser UI's static files (`/`, `/ui/...`: no data in them) needs
`Authorization: Bearer <token>`; tokens are compared in constant time. A probe answered
without a valid token shows liveness only (`caller_authenticated()`). Without tokens the api is
open, `kiln serve` refuses a non-loopback bind unless explicitly allowed, and only the Host names
of `server.allowed_hosts` are answered: a web page whose own name resolves to 127.0.0.1 (DNS
rebinding) sends its own name as Host and is refused. `/metrics` names jobs, adapters and their
validation losses, so it needs a token like any data route (a Prometheus scrape sends one).

Every valid token is an equal administrator: it sees and acts on every job, dataset, export and
adapter, whoever created them; only an Idempotency-Key is scoped to the token that sent it
(docs/security.md#tokens).
"""

from __future__ import annotations

import hashlib
import hmac

from flask import Flask, g, request

from api.errors import HOST_NOT_ALLOWED, UNAUTHORIZED, ApiError
from api.ui import is_ui_path
from kiln.settings import host_name

# The probes every caller may ask without a token (the OpenAPI document marks the rest secured).
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
# The caller's scope on `flask.g`: "" on a token-less server, a digest of the bearer token otherwise.
_SCOPE = "kiln_caller_scope"


def token_matches(presented: str, tokens: list[str]) -> bool:
    """Constant-time comparison against every configured token (no early exit on a match)."""
    given = presented.encode("utf-8")
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(given, token.encode("utf-8"))
    return matched


def token_scope(token: str) -> str:
    """A stable name for one bearer token that does not reveal it."""
    return hashlib.sha256(b"kiln-caller\0" + token.encode("utf-8")).hexdigest()


def caller_authenticated() -> bool:
    """Whether this request may see everything: a valid token, or a server without tokens."""
    return _SCOPE in g


def caller_scope() -> str:
    """What the caller's Idempotency-Keys are scoped to ("" on a token-less server)."""
    return g.get(_SCOPE, "")


def install_host_check(app: Flask, allowed: frozenset[str] | None) -> None:
    """Refuse (403) a Host outside `allowed`; None answers any Host."""
    if allowed is None:
        return

    @app.before_request
    def _check_host() -> None:
        name = host_name(request.host)
        if name not in allowed:
            raise ApiError(
                HOST_NOT_ALLOWED,
                f"this server does not answer the Host {name[:100]!r} (server.allowed_hosts)",
            )


def install_auth(app: Flask, tokens: list[str]) -> None:
    @app.before_request
    def _authenticate() -> None:
        if not tokens:
            setattr(g, _SCOPE, "")
            return
        header = request.headers.get("Authorization", "")
        scheme, _, presented = header.partition(" ")
        presented = presented.strip() if scheme.lower() == "bearer" else ""
        if presented and token_matches(presented, tokens):
            setattr(g, _SCOPE, token_scope(presented))
            return
        if request.path in PUBLIC_PATHS or is_ui_path(request.path):
            return
        raise ApiError(UNAUTHORIZED, "invalid bearer token" if presented else "missing bearer token")
