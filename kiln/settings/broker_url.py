"""The broker URL as kombu reads it (docs/configuration.md): settings validation refuses a URL
kombu would choke on at start-up, and the broker client connects with the same form."""

from __future__ import annotations

from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

_FAILOVER = ";"


def kombu_url(url: str) -> str:
    """`url` as kombu reads it: a `password` query parameter moves into the userinfo.

    kombu hands query parameters to the transport as keyword arguments beside the password it
    took from the userinfo, so `redis://host:6379/0?password=pw` (a form people write, and one
    `kiln config show` redacts) would stop the worker with a TypeError. Raises ValueError, without
    the URL in the message, when the password is given twice.
    """
    return _FAILOVER.join(_kombu_one(part) for part in url.split(_FAILOVER))


def _kombu_one(url: str) -> str:
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    passwords = [value for key, value in query if key == "password"]
    if not passwords:
        return url
    userinfo, at, host = parts.netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if len(passwords) > 1 or colon:
        raise ValueError("the broker password is given twice (in the userinfo and as ?password=); keep one")
    netloc = f"{user}:{quote(passwords[0], safe='')}@{host}"
    rest = urlencode([(key, value) for key, value in query if key != "password"])
    return urlunsplit((parts.scheme, netloc, parts.path, rest, parts.fragment))
