"""SHA-256 digests, canonical JSON and time stamps: the one home of the helpers every record uses.

Two renderings of a SHA-256 appear in the records: bare 64 lowercase hex (`*_sha256_hex`,
what checkpoint manifests and qualification receipts store) and `sha256:<hex>` (`*_digest`,
`sha256_prefixed`, `json_sha256`: receipts, adapter manifests, provenance). Canonical JSON here
is Python's key-sorted compact form with non-ASCII kept as UTF-8; the row identity of ingestion
has its own serde_json-compatible form (`kiln_train.data.row_identity.serde_canonical_json`),
which writes floats differently and is a separate rule.

Torch-free and import-light: the api uses it too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DIGEST_PREFIX = "sha256:"
_FILE_CHUNK = 1 << 20


def sha256_hex(data: bytes) -> str:
    """SHA-256 of `data`, 64 lowercase hex."""
    return hashlib.sha256(data).hexdigest()


def text_sha256_hex(text: str) -> str:
    """SHA-256 of `text` encoded as UTF-8, 64 lowercase hex."""
    return sha256_hex(text.encode("utf-8"))


def file_sha256_hex(path: str | Path) -> str:
    """SHA-256 of a file's bytes, read in chunks, 64 lowercase hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_FILE_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_prefixed(data: bytes) -> str:
    """SHA-256 of `data` as `sha256:<hex>`."""
    return DIGEST_PREFIX + sha256_hex(data)


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file's bytes as `sha256:<hex>`."""
    return DIGEST_PREFIX + file_sha256_hex(path)


def canonical_json_bytes(obj: Any) -> bytes:
    """Recursive key sort, compact separators, UTF-8 unescaped: the stable form records digest."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _canonical_chunks(value: Any, levels: int) -> Iterator[bytes]:
    """`canonical_json_bytes(value)` in pieces: the top `levels` of objects and arrays are opened
    here, so a large value is encoded a member and an element at a time (the C encoder holds the
    interpreter lock for a whole call). An object with a non-string key is encoded in one call,
    where json's own key conversion applies."""
    if levels and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        yield b"{"
        for i, key in enumerate(sorted(value)):
            yield (b"," if i else b"") + canonical_json_bytes(key) + b":"
            yield from _canonical_chunks(value[key], levels - 1)
        yield b"}"
    elif levels and isinstance(value, list):
        yield b"["
        for i, item in enumerate(value):
            if i:
                yield b","
            yield from _canonical_chunks(item, levels - 1)
        yield b"]"
    else:
        yield canonical_json_bytes(value)


def json_sha256(obj: Any) -> str:
    """SHA-256 of `canonical_json_bytes(obj)` as `sha256:<hex>`, hashed in pieces (see above)."""
    h = hashlib.sha256()
    for chunk in _canonical_chunks(obj, levels=2):
        h.update(chunk)
    return DIGEST_PREFIX + h.hexdigest()


def utc_now_rfc3339() -> str:
    """The current UTC time as RFC 3339 with milliseconds and a `Z` suffix."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
