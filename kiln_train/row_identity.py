"""SFT row identity: the three domain-separated SHA-256 digests of kiln-contract §3.4.

- parsed row: SHA256(b"kiln.sft-parsed-row.v1\\0" + canonical JSON of the normalised example)
- raw row (rows with no parsed form, i.e. `invalid_json`): SHA256(b"kiln.sft-raw-row.v1\\0" + trimmed line)
- kept corpus: SHA256(b"kiln.sft-kept-corpus.v1\\0" + for each kept hash string, in order,
  u64 big-endian length of the string + its ASCII bytes)

Canonical JSON is serde_json's compact form of a key-sorted value: no whitespace, non-ASCII kept
as UTF-8, only `"`, `\\` and control characters escaped (lower-case `\\u00xx`). Python's
`json.dumps(..., sort_keys=True, separators=(",", ":"), ensure_ascii=False)` writes exactly that
for strings, integers, booleans and null; floats inside tool objects are written with Python's
`repr`, which can differ from serde's ryu for exponents (`1e+16` vs `1e16`).

Digests are rendered `sha256:<64 lowercase hex>`.
"""

from __future__ import annotations

import hashlib
import json
import re

PARSED_ROW_DOMAIN = b"kiln.sft-parsed-row.v1"
RAW_ROW_DOMAIN = b"kiln.sft-raw-row.v1"
KEPT_CORPUS_DOMAIN = b"kiln.sft-kept-corpus.v1"
DIGEST_PREFIX = "sha256:"
DIGEST_PATTERN = re.compile(r"sha256:[0-9a-f]{64}")


def domain_digest(domain: bytes, payload: bytes) -> str:
    """`sha256:` + hex SHA-256 over `domain || NUL || payload`."""
    h = hashlib.sha256(domain)
    h.update(b"\0")
    h.update(payload)
    return DIGEST_PREFIX + h.hexdigest()


def canonical_json(obj) -> str:
    """Compact, key-sorted JSON text (see module docstring). Raises ValueError on NaN/Infinity."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def parsed_row_sha256(obj) -> str:
    """Identity of a parsed row; `obj` is the normalised example (`{"messages": [...], ...}`)."""
    return domain_digest(PARSED_ROW_DOMAIN, canonical_json(obj).encode("utf-8"))


def raw_row_sha256(line: bytes) -> str:
    """Identity of a row that has no parsed form; `line` is the trimmed JSONL line."""
    return domain_digest(RAW_ROW_DOMAIN, bytes(line))


def kept_corpus_sha256(hashes: list[str]) -> str:
    """The SFT data identity: digest over the kept row hashes in training order."""
    buf = bytearray()
    for h in hashes:
        raw = h.encode("ascii")
        buf += len(raw).to_bytes(8, "big")
        buf += raw
    return domain_digest(KEPT_CORPUS_DOMAIN, bytes(buf))


def is_digest(value) -> bool:
    """True for a well-formed `sha256:<64 lowercase hex>` string."""
    return isinstance(value, str) and DIGEST_PATTERN.fullmatch(value) is not None
