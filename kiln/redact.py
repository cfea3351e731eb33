"""Secrets out of connection URLs before they are shown (`GET /v1/config`, `kiln config show`,
`kiln serve` errors): the one redaction every printer of a database or broker URL uses.

The URL is taken apart (scheme, userinfo, host, path, query parameters, fragment), not
pattern-matched: the password of the userinfo (`user:pw@host`, redis' `:pw@host`) and the value
of every secret-looking query parameter (`?password=`, `sslpassword=`, `token=`, ...) become
`***`; everything else is kept as written. The userinfo ends where SQLAlchemy ends it, so a
password holding an unescaped `/` or `?` (which SQLAlchemy accepts) is still found. kombu's
failover lists (`redis://a;redis://b`) are redacted URL by URL.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus

MASK = "***"
# A query parameter whose name (lower case, without "_" and "-") contains one of these holds a secret.
SECRET_KEY_PARTS = ("pass", "pwd", "secret", "token", "apikey", "accesskey", "credential")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_NEXT_URL = re.compile(r";(?=[A-Za-z][A-Za-z0-9+.-]*://)")


def secret_query_key(name: str) -> bool:
    folded = unquote_plus(name).lower().replace("_", "").replace("-", "")
    return any(part in folded for part in SECRET_KEY_PARTS)


def _redact_query(query: str) -> str:
    pieces = []
    for piece in re.split(r"([&;])", query):  # the separators are kept as pieces of their own
        name, sep, _value = piece.partition("=")
        pieces.append(f"{name}={MASK}" if sep and secret_query_key(name) else piece)
    return "".join(pieces)


def _userinfo_end(rest: str) -> int:
    """Where the userinfo of `rest` (the URL after `scheme://`) ends (its `@`), or -1."""
    authority_end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, authority_end)
    if at >= 0:
        return at
    # SQLAlchemy reads `user:pa/ss@host` as password "pa/ss": a `user:` before a later `@`.
    first = rest.find("@")
    user = rest[:first].partition(":")[0]
    if first > 0 and ":" in rest[:first] and not any(c in user for c in "/?#"):
        return first
    return -1


def _redact_one(url: str) -> str:
    scheme = _SCHEME.match(url)
    head, rest = (url[: scheme.end()], url[scheme.end() :]) if scheme else ("", url)
    at = _userinfo_end(rest) if scheme else -1
    if at >= 0:
        user, colon, _password = rest[:at].partition(":")
        head += f"{user}:{MASK}@" if colon else f"{user}@"
        rest = rest[at + 1 :]
    path, question, query = rest.partition("?")
    if not question:
        return head + rest
    query, hash_mark, fragment = query.partition("#")
    return f"{head}{path}?{_redact_query(query)}{hash_mark}{fragment}"


def redact_url(url: str) -> str:
    """`url` with its password and every secret query value replaced by `***`."""
    return ";".join(_redact_one(part) for part in _NEXT_URL.split(url))
