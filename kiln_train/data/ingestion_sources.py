"""Where SFT rows come from: inline examples and server-local JSONL files (docs/ingestion.md).

Both transports produce `SourceRow`s for the row pipeline in `ingestion`: a decoded object (an
inline example already parsed and checked), or a JSONL line with why it is not JSON. Also the
dataset path rule (`resolve_dataset_path`) and the JSONL line rule (`jsonl_lines`) that the HF
export reads its rows back with.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kiln_train.data.conversation import (
    RowRejection,
    RowSchemaError,
    decode_json,
    parse_example,
    unrenderable_field,
)
from kiln_train.data.row_formats import MESSAGES, detect_format, given_row_sha256
from kiln_train.data.row_identity import serde_canonical_json
from kiln_train.errors import invalid_request

ASCII_WHITESPACE = b" \t\n\x0c\r"  # Rust's u8::is_ascii_whitespace
UTF8_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class SourceRow:
    """A non-blank row before checks: a decoded object (and, for inline rows, its parsed form),
    or the raw line and why it did not parse."""

    row_index: int
    obj: object = None
    raw: bytes | None = None
    parse_error: str | None = None
    parsed: tuple[dict, str, str | None] | None = None  # parse_row's result, already checked
    line: int | None = None  # physical line of a JSONL file (blank lines counted), from 1


def resolve_dataset_path(dataset_path: str, datasets_root: Path) -> Path:
    """The file a `dataset_path` names, which must be a regular file inside `datasets_root`.

    Relative paths are relative to `datasets_root`; absolute paths must point inside it. `..`
    segments are refused outright, and the fully resolved path (symlinks followed) must stay
    inside the resolved root.
    """
    if not isinstance(dataset_path, str) or not dataset_path.strip():
        raise invalid_request("dataset_path must not be blank")
    if "\0" in dataset_path:
        raise invalid_request("dataset_path must not contain NUL bytes")
    candidate = Path(dataset_path)
    if ".." in candidate.parts:
        raise invalid_request(f"dataset_path {dataset_path!r} must not contain '..' segments")
    try:
        root = Path(datasets_root).resolve(strict=True)
    except OSError:
        raise invalid_request(
            f"dataset_path {dataset_path!r}: the server's datasets directory {datasets_root} does not exist"
        ) from None
    full = candidate if candidate.is_absolute() else root / candidate
    if candidate.is_absolute() and not (
        full.is_relative_to(root) or full.is_relative_to(Path(os.path.abspath(datasets_root)))
    ):
        raise invalid_request(f"dataset_path {dataset_path!r} is outside the server's datasets directory")
    try:
        resolved = full.resolve(strict=True)
    except (OSError, RuntimeError):
        raise invalid_request(
            f"dataset_path {dataset_path!r} does not exist under the datasets directory"
        ) from None
    if not resolved.is_relative_to(root):
        raise invalid_request(
            f"dataset_path {dataset_path!r} resolves outside the server's datasets directory"
        )
    if not resolved.is_file():
        raise invalid_request(f"dataset_path {dataset_path!r} is not a regular file")
    return resolved


def jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(row index, line) of every row of a JSONL file: lines trimmed of ASCII whitespace, blank
    ones skipped, the others numbered from 1."""
    for index, _line_number, line in numbered_jsonl_lines(path):
        yield index, line


def numbered_jsonl_lines(path: Path, counts: LineCounts | None = None) -> Iterator[tuple[int, int, bytes]]:
    """(row index, physical line number, trimmed line) of every row; blank lines are counted in
    the line numbers (and in `counts.blank_lines`) but are not rows."""
    counts = counts if counts is not None else LineCounts()
    index = 0
    with open(path, "rb") as f:
        for line_number, raw_line in enumerate(f, start=1):
            line = raw_line.strip(ASCII_WHITESPACE)
            if not line:
                counts.blank_lines += 1
                continue
            index += 1
            yield index, line_number, line


@dataclass
class LineCounts:
    """What reading a file saw besides its rows (filled while the rows are read)."""

    blank_lines: int = 0


def jsonl_rows(path: Path, counts: LineCounts | None = None) -> Iterator[SourceRow]:
    """A JSONL file's rows: decoded, or with why they are `invalid_json`."""
    for index, line_number, line in numbered_jsonl_lines(path, counts):
        problem = _undecodable(line)
        if problem is not None:
            yield SourceRow(index, raw=line, parse_error=problem, line=line_number)
            continue
        try:
            obj = decode_json(line.decode("utf-8"))
        except ValueError as exc:
            yield SourceRow(index, raw=line, parse_error=f"not valid JSON: {exc}", line=line_number)
            continue
        yield SourceRow(index, obj=obj, raw=line, line=line_number)


def _undecodable(line: bytes) -> str | None:
    """Why a trimmed line is not UTF-8 JSON text at the byte level, or None."""
    if line.startswith(UTF8_BOM):
        return (
            "not valid JSON: the line starts with a UTF-8 byte-order mark (U+FEFF); "
            "JSONL rows are plain UTF-8 JSON (save the file as UTF-8 without BOM)"
        )
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not valid JSON: invalid UTF-8 byte 0x{line[exc.start]:02x} at byte {exc.start} of the line"
    return None


def parse_row(obj) -> tuple[dict, str, str | None]:
    """(parsed row, canonical JSON, unrenderable field detail or None); RowSchemaError when `obj`
    is not an SFT example."""
    parsed = parse_example(obj)
    try:
        canonical = serde_canonical_json(parsed)
        canonical.encode("utf-8")  # lone surrogates cannot be hashed (nor sent by a JSON encoder)
    except (TypeError, ValueError) as exc:  # TypeError: a Python caller's non-JSON value or key
        raise RowSchemaError("example", f"not representable as JSON: {exc}") from None
    return parsed, canonical, unrenderable_field(obj)


def example_rows(examples: list, field: str = "examples") -> list[SourceRow]:
    """Inline examples are one request body: every example must deserialise before any row is
    processed, so a malformed example is reported as the transport error it is
    (docs/ingestion.md#validation). `field` is the request field the examples came from
    (`validation.examples` for held-out rows). A row of another format (row_formats) is only
    checked to be JSON here; whether it is a valid row of its format is its own row outcome."""
    rows = []
    for i, obj in enumerate(examples):
        try:
            try:
                fmt = detect_format(obj)
            except RowRejection:
                fmt = None
            if fmt == MESSAGES:
                rows.append(SourceRow(i + 1, parsed=parse_row(obj)))
            else:
                given_row_sha256(obj)
                rows.append(SourceRow(i + 1, obj=obj))
        except RowSchemaError as exc:
            raise invalid_request(f"{field}[{i}]: {exc.detail}") from None
    return rows
