"""Request JSON in short steps: the decoder of request bodies.

`json.loads` runs in C holding the interpreter lock throughout: on a body of tens of MiB that is
tens of milliseconds in which no other thread of the worker (a `/health` probe, a status read)
can run. A body is an object whose large members are arrays of rows, so `loads` decodes the
top-level object and its arrays here, member by member and element by element, and the C
decoder gets one row at a time; it gives exactly what the one-call form gives. The canonical
digest of a body (`kiln_train.ground.digest.json_sha256`) is hashed in the same steps.
"""

from __future__ import annotations

import json
import math
import re
from json.decoder import scanstring
from typing import Any

_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf: not a number JSON can carry
        raise ValueError(f"the number {text} is out of range")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:  # which one would win is up to the parser; refuse the ambiguity
            raise ValueError(f"duplicate key {key!r} in one object")
        obj[key] = value
    return obj


# NaN/Infinity and out-of-range floats refused, duplicate keys refused.
DECODER = json.JSONDecoder(
    parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys
)


def _skip(text: str, index: int) -> int:
    return _WHITESPACE.match(text, index).end()  # type: ignore[union-attr]


def _expect(text: str, index: int, what: str) -> json.JSONDecodeError:
    return json.JSONDecodeError(f"Expecting {what}", text, index)


def _array(text: str, index: int) -> tuple[list, int]:
    """The array starting at `text[index] == "["`, its elements decoded one by one."""
    items: list = []
    index = _skip(text, index + 1)
    if text.startswith("]", index):
        return items, index + 1
    while True:
        value, index = DECODER.raw_decode(text, index)
        items.append(value)
        index = _skip(text, index)
        if text.startswith("]", index):
            return items, index + 1
        if not text.startswith(",", index):
            raise _expect(text, index, "',' delimiter")
        index = _skip(text, index + 1)


def _object(text: str, index: int) -> tuple[dict, int]:
    """The object starting at `text[index] == "{"`; member arrays go through `_array`."""
    pairs: list[tuple[str, Any]] = []
    index = _skip(text, index + 1)
    if text.startswith("}", index):
        return _unique_keys(pairs), index + 1
    while True:
        if not text.startswith('"', index):
            raise _expect(text, index, "property name enclosed in double quotes")
        key, index = scanstring(text, index + 1)
        index = _skip(text, index)
        if not text.startswith(":", index):
            raise _expect(text, index, "':' delimiter")
        index = _skip(text, index + 1)
        if text.startswith("[", index):
            value, index = _array(text, index)
        else:
            value, index = DECODER.raw_decode(text, index)
        pairs.append((key, value))
        index = _skip(text, index)
        if text.startswith("}", index):
            return _unique_keys(pairs), index + 1
        if not text.startswith(",", index):
            raise _expect(text, index, "',' delimiter")
        index = _skip(text, index + 1)


def loads(text: str) -> Any:
    """`DECODER.decode(text)`, a top-level object's members and arrays decoded one at a time.
    Raises ValueError (json.JSONDecodeError with the position) or RecursionError."""
    index = _skip(text, 0)
    if text.startswith("{", index):
        value, index = _object(text, index)
    else:
        value, index = DECODER.raw_decode(text, index)
    index = _skip(text, index)
    if index != len(text):
        raise json.JSONDecodeError("Extra data", text, index)
    return value
