"""SFT row identity: three domain-separated SHA-256 digests (docs/ingestion.md#row-identity).

- parsed row: SHA256(b"kiln.sft-parsed-row.v1\\0" + canonical JSON of the normalised example)
- raw row (rows with no parsed form, i.e. `invalid_json`): SHA256(b"kiln.sft-raw-row.v1\\0" + trimmed line)
- kept corpus: SHA256(b"kiln.sft-kept-corpus.v1\\0" + for each kept hash string, in order,
  u64 big-endian length of the string + its ASCII bytes)

The row's canonical JSON (`serde_canonical_json`) is serde_json's compact form of a key-sorted
value: no whitespace, non-ASCII kept as UTF-8, only `"`, `\\` and control characters escaped (lower-case `\\u00xx`). Python's
`json.dumps(..., sort_keys=True, separators=(",", ":"), ensure_ascii=False)` writes exactly that
for strings, integers, booleans and null. Numbers that serde_json holds as f64 are written the way
serde_json writes them (ryu's shortest round-trip digits in ryu's layout: `1.5`, `100.0`,
`0.00001`, `1e-7`, `1e16`, `2.5e20`), not with Python's `repr` (`1e-05`, `1e+16`, `2.5e+20`): every
JSON float, and integers outside u64/i64 (serde_json without `arbitrary_precision` parses those
as f64: `18446744073709551616` -> `1.8446744073709552e19`). Rows without such numbers take the
plain `json.dumps` path. Known residue: `-0` (serde_json keeps it as the float `-0.0`, Python's
parser returns the integer 0).

Digests are rendered `sha256:<64 lowercase hex>`.
"""

from __future__ import annotations

import hashlib
import json
import re

from kiln_train.ground.digest import DIGEST_PREFIX

PARSED_ROW_DOMAIN = b"kiln.sft-parsed-row.v1"
RAW_ROW_DOMAIN = b"kiln.sft-raw-row.v1"
KEPT_CORPUS_DOMAIN = b"kiln.sft-kept-corpus.v1"
DIGEST_PATTERN = re.compile(r"sha256:[0-9a-f]{64}")


def domain_digest(domain: bytes, payload: bytes) -> str:
    """`sha256:` + hex SHA-256 over `domain || NUL || payload`."""
    h = hashlib.sha256(domain)
    h.update(b"\0")
    h.update(payload)
    return DIGEST_PREFIX + h.hexdigest()


I64_MIN, U64_MAX = -(2**63), 2**64 - 1


def serde_canonical_json(obj) -> str:
    """Compact, key-sorted JSON text as serde_json writes it (see module docstring). Raises ValueError on NaN/Infinity."""
    if not _has_serde_float(obj):
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return "".join(_serde_pieces(obj))


def _has_serde_float(obj) -> bool:
    """True when `obj` holds a number serde_json would write as f64 (checked without recursion)."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, float) or (
            isinstance(item, int) and not isinstance(item, bool) and not I64_MIN <= item <= U64_MAX
        ):
            return True
    return False


def _serde_pieces(obj):
    if isinstance(obj, str):
        yield json.dumps(obj, ensure_ascii=False)
    elif obj is None or isinstance(obj, bool):
        yield "null" if obj is None else ("true" if obj else "false")
    elif isinstance(obj, int):
        yield str(obj) if I64_MIN <= obj <= U64_MAX else serde_f64(_int_as_f64(obj))
    elif isinstance(obj, float):
        yield serde_f64(obj)
    elif isinstance(obj, dict):
        yield "{"
        for n, key in enumerate(sorted(obj)):
            if not isinstance(key, str):
                raise ValueError(f"object key {key!r} is not a string")
            yield ("," if n else "") + json.dumps(key, ensure_ascii=False) + ":"
            yield from _serde_pieces(obj[key])
        yield "}"
    elif isinstance(obj, list | tuple):
        yield "["
        for n, item in enumerate(obj):
            if n:
                yield ","
            yield from _serde_pieces(item)
        yield "]"
    else:
        raise ValueError(f"{type(obj).__name__} is not JSON")


def _int_as_f64(value: int) -> float:
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"number out of range: an integer of {len(str(abs(value)))} digits") from None


def serde_f64(value: float) -> str:
    """`value` as serde_json writes an f64 (ryu's `format64`); ValueError for NaN and infinities."""
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError("Out of range float values are not JSON compliant")
    text = repr(value)  # shortest round-trip digits, the same digits ryu chooses
    sign = "-" if text.startswith("-") else ""
    text = text.lstrip("-")
    mantissa, _, exponent = text.partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    if not digits:
        return sign + "0.0"
    # value = 0.<digits> x 10^kk, with `digits` significant (no leading or trailing zeros)
    kk = len(whole) + int(exponent or 0) - (len(whole + fraction) - len((whole + fraction).lstrip("0")))
    digits = digits.rstrip("0")
    length = len(digits)
    if kk - length >= 0 and kk <= 16:
        body = digits + "0" * (kk - length) + ".0"
    elif 0 < kk <= 16:
        body = digits[:kk] + "." + digits[kk:]
    elif -5 < kk <= 0:
        body = "0." + "0" * (-kk) + digits
    elif length == 1:
        body = f"{digits}e{kk - 1}"
    else:
        body = f"{digits[0]}.{digits[1:]}e{kk - 1}"
    return sign + body


def parsed_row_sha256(obj) -> str:
    """Identity of a parsed row; `obj` is the normalised example (`{"messages": [...], ...}`)."""
    return domain_digest(PARSED_ROW_DOMAIN, serde_canonical_json(obj).encode("utf-8"))


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
