"""Headers on every answer: `X-Content-Type-Options: nosniff` (a browser never guesses another type
than the one sent, e.g. HTML out of a JSON error echoing a request) and `Cache-Control: no-store`
(job state, configuration and errors are answers of the moment, never reused from a cache).
A response that chose its own Cache-Control keeps it."""

from __future__ import annotations

from flask import Flask, Response

SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"}


def install_response_headers(app: Flask) -> None:
    @app.after_request
    def _headers(response: Response) -> Response:
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        return response
