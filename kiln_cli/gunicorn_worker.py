"""The gthread worker of `kiln serve`: gunicorn's own errors in the api's envelope, and probes
that keep answering while large submissions are admitted.

gunicorn refuses some requests before the app sees them (a request line over
`limit_request_line`, too many or too large header fields, malformed header lines, broken chunked
framing) and writes an HTML page for them. This worker writes
`{"error": {"code", "message", "hint"}}` instead, with the headers every api answer carries.
"""

from __future__ import annotations

import gc
import json
import ssl
import sys

from gunicorn import util
from gunicorn.http import errors
from gunicorn.workers.gthread import ThreadWorker

SWITCH_INTERVAL_S = 0.0005
MESSAGE_MAX = 300  # gunicorn's messages quote the offending request line or header

# (exception types, status, reason phrase, code), first match wins: subclasses before bases.
_ERRORS: tuple[tuple[tuple[type[BaseException], ...], int, str, str], ...] = (
    (
        (errors.InvalidResponseHeader, errors.InvalidResponseHeaderName, errors.ConfigurationProblem),
        500,
        "Internal Server Error",
        "internal_error",
    ),
    ((errors.LimitRequestLine,), 414, "URI Too Long", "uri_too_long"),
    (
        (errors.LimitRequestHeaders,),
        431,
        "Request Header Fields Too Large",
        "request_header_fields_too_large",
    ),
    ((errors.UnsupportedTransferCoding,), 501, "Not Implemented", "not_implemented"),
    ((errors.ExpectationFailed,), 417, "Expectation Failed", "expectation_failed"),
    ((errors.ForbiddenProxyRequest, ssl.SSLError), 403, "Forbidden", "forbidden"),
    ((errors.ParseException,), 400, "Bad Request", "bad_request"),
)


def classify(exc: BaseException) -> tuple[int, str, str]:
    """(status, reason phrase, code) of the answer to a request gunicorn failed on."""
    for types, status, reason, code in _ERRORS:
        if isinstance(exc, types):
            return status, reason, code
    return 500, "Internal Server Error", "internal_error"


def hint(code: str, cfg) -> str:
    return {
        "bad_request": "The request is not valid HTTP/1.1 (request line, header syntax or chunked framing).",
        "uri_too_long": f"The request line (method, path and query) may be at most {cfg.limit_request_line} "
        "bytes; send large values in a JSON body.",
        "request_header_fields_too_large": f"Send at most {cfg.limit_request_fields} header fields of at most "
        f"{cfg.limit_request_field_size} bytes each.",
        "not_implemented": "Send the body with Content-Length or Transfer-Encoding: chunked.",
        "expectation_failed": "Only `Expect: 100-continue` is understood.",
        "forbidden": "The connection is not accepted by this server.",
    }.get(code, "The server logged the failure; retry, and report it if it persists.")


def error_bytes(status: int, reason: str, code: str, message: str, hint_text: str) -> bytes:
    """A complete HTTP/1.1 answer carrying the envelope; the connection closes after it."""
    from api.response_headers import SECURITY_HEADERS

    body = json.dumps({"error": {"code": code, "message": message, "hint": hint_text}}).encode()
    headers = {
        "Connection": "close",
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        **SECURITY_HEADERS,
    }
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode("latin-1") + b"\r\n" + body


class KilnThreadWorker(ThreadWorker):
    def init_process(self) -> None:
        # A thread busy admitting a large body keeps the interpreter lock for up to the switch
        # interval each time a probe's thread wants it back after I/O (5 ms by default, several
        # times per request); a shorter interval keeps /health and status reads prompt.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        # What start-up built lives as long as the worker: out of the collector's sight, a full
        # collection triggered while a large body is decoded stays short (it walked every object
        # of the app, lock held, for hundreds of milliseconds).
        gc.freeze()

    def handle_error(self, req, client, addr, exc) -> None:
        status, reason, code = classify(exc)
        ip = (addr or ("", -1))[0]
        if status >= 500:
            self.log.exception("Error handling request from ip=%s", ip)
            message = "internal server error"
        else:
            self.log.warning("Invalid request from ip=%s: %s", ip, exc)
            message = str(exc)[:MESSAGE_MAX]
        try:
            util.write_nonblock(client, error_bytes(status, reason, code, message, hint(code, self.cfg)))
        except Exception:
            self.log.debug("Failed to send error message.")
