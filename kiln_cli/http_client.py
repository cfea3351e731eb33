"""The HTTP client behind the `kiln train|jobs|adapters` commands: where the api is, the bearer
token, one JSON request, and the error envelope as an exception (docs/errors.md#envelope).

Stdlib `urllib` only (the `kiln` command imports this module; it must stay light and torch-free).

Connection rules:
- base URL: `--url` (or `KILN_API_URL`), else `http://<server.host>:<server.port>` from the
  settings (a wildcard bind such as 0.0.0.0 is reached on loopback);
- token: `--token` (or `KILN_API_TOKEN`), else the first of `server.api_tokens`, but only when the
  URL also came from the settings: a local server's secret is never sent to a URL typed by hand.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from kiln.settings import load_settings

URL_ENV = "KILN_API_URL"
TOKEN_ENV = "KILN_API_TOKEN"
DEFAULT_TIMEOUT_S = 30.0
DOWNLOAD_CHUNK = 1 << 20
ERROR_BODY_MAX = 500

# Exit statuses of every client command.
EXIT_API_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class ApiError(Exception):
    """The server answered with an error: the envelope's code, message and hint."""

    def __init__(
        self, status: int, code: str, message: str, hint: str = "", retry_after: str | None = None
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.hint = hint
        self.retry_after = retry_after
        self.notes: list[str] = []  # client-side context added by the command (e.g. a file's line)


class LocalFileError(Exception):
    """A download could not be written or unpacked locally (nothing is left behind)."""


class ApiUnreachable(Exception):
    """No HTTP answer at all: refused, unresolvable, timed out, or cut off mid-response."""

    def __init__(self, url: str, reason: str, base_url: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason
        self.base_url = base_url


@dataclass(frozen=True)
class Connection:
    base_url: str
    token: str | None = None


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: Any = field(default=None)


def settings_url(host: str, port: int) -> str:
    """The URL a client uses to reach a server bound to host:port."""
    host = _WILDCARD_HOSTS.get(host, host)
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}"


class BadUrl(ValueError):
    """--url (or KILN_API_URL) is not an http(s) base URL."""


def normalize_url(url: str) -> str:
    """An api base URL as typed: `host:port` gets `http://`; only http and https are spoken."""
    url = url.strip()
    if not url:
        raise BadUrl("is empty")
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise BadUrl(f"{url!r}: only http:// and https:// URLs are supported")
    if not parts.hostname:
        raise BadUrl(f"{url!r} names no host")
    try:
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number in 0..65535)
    except ValueError as exc:
        raise BadUrl(f"{url!r}: {exc}") from None
    if parts.query or parts.fragment:
        raise BadUrl(f"{url!r}: a base URL has no query or fragment")
    return url.rstrip("/")


def resolve_connection(url: str | None, token: str | None, config_file: str | None) -> Connection:
    """Where to send requests and with which token (module docstring). Raises ConfigError when
    the settings are needed and cannot be loaded, BadUrl for an unusable URL."""
    if url is not None:
        return Connection(normalize_url(url), token or None)
    server = load_settings(config_file).settings.server
    if token is None and server.api_tokens:
        token = server.api_tokens[0]
    return Connection(settings_url(server.host, server.port), token or None)


def quote_segment(value: str) -> str:
    """One path segment, escaped so a `/` or `..` in an id cannot change the route."""
    return urllib.parse.quote(value, safe="")


class ApiClient:
    """JSON requests against one Kiln api."""

    def __init__(self, connection: Connection, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.connection = connection
        self.timeout = timeout

    @property
    def base_url(self) -> str:
        return self.connection.base_url

    def get(self, path: str, query: Mapping[str, Any] | None = None) -> Any:
        return self.request("GET", path, query=query).body

    def post(self, path: str, body: Any, **kwargs: Any) -> Any:
        return self.request("POST", path, body=body, **kwargs).body

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path).body

    def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        raw: tuple[bytes, str] | None = None,
    ) -> Reply:
        """Send one request; the decoded JSON reply, ApiError for an error status, ApiUnreachable
        when no answer came back. `raw` is a body sent as it is: (bytes, content type)."""
        data = None
        all_headers = {"Accept": "application/json", **(headers or {})}
        if raw is not None:
            data, all_headers["Content-Type"] = raw
        elif body is not None:
            # allow_nan=False: NaN/Infinity are not JSON and the server refuses them anyway.
            data = json.dumps(body, allow_nan=False).encode("utf-8")
            all_headers["Content-Type"] = "application/json"
        url = self._url(path, query)
        try:
            with self._open(method, url, data, all_headers, timeout) as response:
                raw = response.read()
                status, reply_headers = response.status, response.headers
        except http.client.HTTPException as exc:
            raise self._unreachable(url, f"the connection broke mid-response ({exc!r})") from None
        except OSError as exc:
            raise self._unreachable(url, _reason(exc)) from None
        return Reply(status, reply_headers, _decode_json(raw, status, url))

    @contextmanager
    def stream(self, path: str) -> Iterator[Iterator[bytes]]:
        """A binary response body as chunks. The request is answered before the caller sees the
        iterator, so an error status raises here and nothing local need exist yet."""
        url = self._url(path, None)
        try:
            response = self._open("GET", url, None, {"Accept": "application/gzip"}, None)
        except http.client.HTTPException as exc:
            raise self._unreachable(url, f"no valid HTTP answer ({exc!r})") from None
        except OSError as exc:
            raise self._unreachable(url, _reason(exc)) from None

        def chunks() -> Iterator[bytes]:
            try:
                while chunk := response.read(DOWNLOAD_CHUNK):
                    yield chunk
            except http.client.HTTPException as exc:
                raise self._unreachable(url, f"the connection broke mid-download ({exc!r})") from None
            except OSError as exc:
                raise self._unreachable(url, _reason(exc)) from None

        with response:
            yield chunks()

    def _unreachable(self, url: str, reason: str) -> ApiUnreachable:
        return ApiUnreachable(url, reason, self.base_url)

    def _url(self, path: str, query: Mapping[str, Any] | None) -> str:
        url = self.base_url + path
        params = {k: v for k, v in (query or {}).items() if v is not None}
        return f"{url}?{urllib.parse.urlencode(params)}" if params else url

    def _open(self, method: str, url: str, data: bytes | None, headers: dict, timeout: float | None):
        """urlopen with the bearer token; an HTTP error status becomes ApiError here, before the
        caller's OSError handler could mistake it for a connection failure."""
        if self.connection.token:
            headers = {**headers, "Authorization": f"Bearer {self.connection.token}"}
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=timeout or self.timeout)  # noqa: S310 (operator-given URL)
        except urllib.error.HTTPError as exc:
            raise api_error_from(exc, url) from None


def api_error_from(exc: urllib.error.HTTPError, url: str) -> ApiError:
    """The envelope of an error response; a body that is not one (a proxy's page, another
    service) is reported with its status and the start of its text."""
    try:
        raw = exc.read()
    except (OSError, http.client.HTTPException):
        raw = b""
    retry_after = exc.headers.get("Retry-After") if exc.headers else None
    try:
        envelope = json.loads(raw.decode("utf-8"))
        error = envelope["error"]
        return ApiError(
            exc.code, str(error["code"]), str(error["message"]), str(error.get("hint") or ""), retry_after
        )
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        text = raw.decode("utf-8", errors="replace").strip()[:ERROR_BODY_MAX] or (exc.reason or "")
        return ApiError(
            exc.code,
            f"http_{exc.code}",
            f"{url} answered HTTP {exc.code} without a Kiln error envelope: {text}",
            "Check that the URL points at a Kiln api (`kiln serve`).",
            retry_after,
        )


def _decode_json(raw: bytes, status: int, url: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8")) if raw.strip() else None
    except (UnicodeDecodeError, ValueError):
        raise ApiError(
            status,
            "invalid_response",
            f"{url} answered HTTP {status} with a body that is not JSON",
            "Check that the URL points at a Kiln api (`kiln serve`).",
        ) from None


def _reason(exc: OSError) -> str:
    reason = getattr(exc, "reason", None) or exc
    if isinstance(reason, TimeoutError):
        return "timed out"
    return str(reason.strerror if isinstance(reason, OSError) and reason.strerror else reason)


# ----- adapter archives ---------------------------------------------------------------------


def download_archive(client: ApiClient, path: str, target: Path, force: bool) -> int:
    """Save a download at `target`: written beside it, then renamed, so an error reply or a broken
    transfer leaves no file (a partial archive is never mistaken for an adapter)."""
    if target.is_dir():
        raise LocalFileError(f"{target} is a directory; pass a file name such as {target / 'NAME.tar.gz'}")
    if target.exists() and not force:
        raise LocalFileError(f"{target} exists; pass --force to overwrite it")
    _check_writable_dir(target.parent, target)
    size = 0
    with client.stream(path) as chunks:
        try:
            fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
        except OSError as exc:
            raise LocalFileError(f"cannot write {target}: {exc.strerror or exc}") from None
        try:
            with os.fdopen(fd, "wb") as sink:
                for chunk in chunks:
                    sink.write(chunk)
                    size += len(chunk)
            os.replace(partial, target)
        except OSError as exc:
            Path(partial).unlink(missing_ok=True)
            raise LocalFileError(f"cannot write {target}: {exc.strerror or exc}") from None
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
    return size


def _check_writable_dir(directory: Path, target: Path) -> None:
    """Before anything is downloaded: the directory that will hold `target` exists and is one."""
    if not directory.exists():
        raise LocalFileError(f"cannot write {target}: directory {directory} does not exist")
    if not directory.is_dir():
        raise LocalFileError(f"cannot write {target}: {directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise LocalFileError(f"cannot write {target}: directory {directory} is not writable")


def extract_archive(client: ApiClient, path: str, name: str, directory: Path) -> tuple[Path, list[str]]:
    """Download the adapter's tar.gz and unpack it as `directory/<name>/` (members must all lie
    under `<name>/`; tarfile's `data` filter refuses links out, devices and absolute paths)."""
    target = directory / name
    if target.exists():
        raise LocalFileError(f"{target} exists; remove it or choose another --extract directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LocalFileError(f"cannot create {directory}: {exc.strerror or exc}") from None
    _check_writable_dir(directory, target)
    with client.stream(path) as chunks, tempfile.TemporaryFile() as archive:
        for chunk in chunks:
            archive.write(chunk)
        archive.seek(0)
        try:
            return _unpack(archive, name, directory, target)
        except OSError as exc:
            raise LocalFileError(f"cannot unpack into {directory}: {exc.strerror or exc}") from None


def _unpack(archive: BinaryIO, name: str, directory: Path, target: Path) -> tuple[Path, list[str]]:
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=directory))
    try:
        with tarfile.open(fileobj=archive, mode="r:gz") as tar:
            members = tar.getmembers()
            strays = [m.name for m in members if m.name != name and not m.name.startswith(f"{name}/")]
            if strays:
                raise LocalFileError(f"the archive holds paths outside {name}/: {strays[:3]}")
            tar.extractall(staging, filter="data")
        files = sorted(m.name.removeprefix(f"{name}/") for m in members if m.isfile())
        os.replace(staging / name, target)
    except tarfile.TarError as exc:
        raise LocalFileError(f"the downloaded archive of {name!r} is not a readable tar.gz: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target, files
