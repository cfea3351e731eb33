"""Strict JSON for checkpoint files (docs/checkpoints.md#manifest).

Checkpoint JSON is read strictly: UTF-8 only, one top-level object, no duplicate keys (a second
value must not silently win), no NaN/Infinity and no number that overflows to infinity. Written
pretty (two-space indent) with Python's shortest round-trip float repr, so every f64 survives a
write/read bit-exactly.
"""

from __future__ import annotations

import json
import math
from typing import Any

from kiln_train.checkpoint.errors import CheckpointError


def _no_duplicates(what: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise CheckpointError(f"{what}: duplicate JSON key {key!r}")
            out[key] = value
        return out

    return hook


def _finite_float(what: str):
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise CheckpointError(f"{what}: number {text} is not a finite f64")
        return value

    return parse


def _reject_constant(what: str):
    def parse(text: str) -> Any:
        raise CheckpointError(f"{what}: {text} is not valid JSON (non-finite numbers are not allowed)")

    return parse


def load_strict_json(data: bytes, what: str) -> dict[str, Any]:
    """Parse `data` as one JSON object; `what` names the file in every error."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{what}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        value = json.loads(
            text,
            object_pairs_hook=_no_duplicates(what),
            parse_float=_finite_float(what),
            parse_constant=_reject_constant(what),
        )
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{what}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{what}: the top-level JSON value must be an object")
    return value


def dump_pretty_json(value: Any) -> bytes:
    """Pretty UTF-8 JSON with a trailing newline; non-finite floats raise ValueError."""
    return (json.dumps(value, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
