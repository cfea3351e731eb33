"""Stored SFT datasets and the data inspector.

A dataset is one JSONL file directly under `<storage.root>/datasets/`; its name is its file name,
and a submission names it as `dataset_path`. Uploads (`application/x-ndjson` bodies) are
streamed to a hidden temporary file, hashed, validated as an SFT dataset exactly as admission
ingests a `dataset_path` (the invalid-row policy applied, row-numbered errors), and only then
linked into place under their name: a name is never overwritten and a refused upload leaves no
file. Beside each uploaded file a hidden `.<name>.kiln-dataset.json` keeps what validation found
(rows, tokens, supervised tokens, rejections, sha256), so listing needs no tokenizing. Files an
operator copied in are datasets too; their facts are computed when asked for.

Rows are tokenized with the live runner's tokenizer (the one admission uses) or, with no live
runner, the packaged Qwen3.5 tokenizer (what `kiln data inspect` uses without `--model`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.errors import ApiError
from api.request_bounds import LineMeter, PageBudget, shows_pieces, slim, yielding
from api.runner_gate import check_training_template, runner_target
from api.schemas import ErrorBody
from api.services import Services
from kiln.store import Admission, Job, live_runner, states
from kiln_train.data.ingestion import (
    RowOutcome,
    apply_invalid_row_policy,
    iter_jsonl_outcomes,
    resolve_dataset_path,
)
from kiln_train.data.ingestion_receipt import POLICIES
from kiln_train.data.inspect import row_facts, token_pieces
from kiln_train.errors import KilnError, invalid_request
from kiln_train.ground import json_bounded
from kiln_train.ground.digest import file_digest

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
# One path segment that is not hidden, short enough that its sidecar's name fits a segment too.
DATASET_NAME_MAX = 200
DATASET_NAME_PATTERN = f"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{DATASET_NAME_MAX - 1}}}$"
DATASET_NAME_RE = re.compile(DATASET_NAME_PATTERN[1:-1])  # used with fullmatch
SIDECAR_SUFFIX = ".kiln-dataset.json"
UPLOAD_PREFIX = ".upload-"
CHUNK = 1 << 20
INSPECT_PAGE_MAX = 1000
INSPECT_PAGE_DEFAULT = 100

DATASET_NOT_FOUND = "dataset_not_found"
DATASET_ALREADY_EXISTS = "dataset_already_exists"
DATASET_IN_USE = "dataset_in_use"
INVALID_DATASET_NAME = "invalid_dataset_name"

# code -> (status, hint)
DATASET_ERRORS: dict[str, tuple[int, str]] = {
    DATASET_NOT_FOUND: (404, "List stored datasets with GET /v1/datasets."),
    DATASET_ALREADY_EXISTS: (409, "Dataset names are never overwritten; upload under a new name."),
    DATASET_IN_USE: (409, "Wait for the queued or running jobs that train on it, or cancel them."),
    INVALID_DATASET_NAME: (
        400,
        f"Dataset names are one path segment of [A-Za-z0-9._-] starting with a letter or digit "
        f"(at most {DATASET_NAME_MAX} characters).",
    ),
}


def dataset_error(code: str, message: str) -> KilnError:
    status, hint = DATASET_ERRORS[code]
    return ApiError(code, message, hint=hint, status=status)


# ----- response bodies ----------------------------------------------------------------------


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetRejection(_Out):
    row_index: int
    row_sha256: str
    reason: str
    detail: str | None
    line: int | None = Field(default=None, description="The row's line in the file (blank lines counted).")


class DatasetStats(_Out):
    invalid_row_policy: Literal["fail", "skip"]
    rows_read: int
    rows_kept: int
    rows_rejected: int
    tokens: int = Field(description="Tokens of the kept rows.")
    supervised_tokens: int = Field(description="Supervised (trained) tokens of the kept rows.")
    max_seq_len: int
    kept_corpus_sha256: str
    rejections: list[DatasetRejection]
    tokenizer: str = Field(description="Which tokenizer counted the tokens.")
    rows_per_format: dict[str, int] | None = Field(
        default=None, description="Kept rows per row format (docs/ingestion.md#row-formats)."
    )
    blank_lines: int | None = Field(default=None, description="Blank lines in the file (not rows).")


class DatasetInfo(_Out):
    name: str
    dataset_path: str = Field(description="What a submission sends as dataset_path.")
    bytes: int
    sha256: str | None = Field(description="sha256:<hex> of the file; null in listings of copied-in files.")
    created_at: str
    stats: DatasetStats | None = Field(
        description="What validation found; null in listings of copied-in files."
    )


class DatasetList(_Out):
    datasets: list[DatasetInfo]


class DeletedDataset(_Out):
    name: str
    status: Literal["deleted"]


class TokenPiece(_Out):
    text: str
    token: int | None = Field(description="Token index in input_ids; null for text no token covers.")
    supervised: bool


class InspectedRow(_Out):
    facts: dict[str, Any] = Field(description="The row's line of `kiln data inspect --json`.")
    text: str | None = Field(description="The rendering (training template); null when never rendered.")
    pieces: list[TokenPiece] | None = Field(description="The rendering cut at token offsets.")


class InspectResponse(_Out):
    rows: list[InspectedRow] = Field(description="The requested page of rows (offset, limit).")
    offset: int
    rows_read: int = Field(description="Every non-blank row of the data.")
    has_more: bool
    invalid_row_policy: Literal["fail", "skip"]
    receipt: dict[str, Any] | None = Field(
        description="The ingestion receipt when the policy admits the data."
    )
    error: ErrorBody | None = Field(description="Why the policy refuses the data (the submission's 400).")
    tokens: int
    supervised_tokens: int
    tokenizer: str


# ----- names and files ----------------------------------------------------------------------


def check_dataset_name(name: str) -> str:
    if not DATASET_NAME_RE.fullmatch(name):
        raise dataset_error(INVALID_DATASET_NAME, f"{name[:80]!r} is not a dataset name")
    return name


def sidecar_path(datasets_dir: Path, name: str) -> Path:
    return datasets_dir / f".{name}{SIDECAR_SUFFIX}"


def dataset_file(datasets_dir: Path, name: str) -> Path:
    """The stored file of dataset `name` (404 when there is none)."""
    check_dataset_name(name)
    path = datasets_dir / name
    if not path.is_file() or path.is_symlink():
        raise dataset_error(DATASET_NOT_FOUND, f"no dataset named {name!r}")
    return path


def _rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


def _read_sidecar(datasets_dir: Path, name: str, size: int) -> dict | None:
    """The recorded facts of an uploaded file, or None when absent, unreadable or stale."""
    try:
        record = json_bounded.loads(sidecar_path(datasets_dir, name).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("bytes") != size or record.get("name") != name:
        return None
    return record


def _info(path: Path, record: dict | None, sha256: str | None, stats: DatasetStats | None) -> DatasetInfo:
    st = path.stat()
    if record is not None:
        return DatasetInfo.model_validate({**record, "dataset_path": record["name"]})
    return DatasetInfo(
        name=path.name,
        dataset_path=path.name,
        bytes=st.st_size,
        sha256=sha256,
        created_at=_rfc3339(st.st_mtime),
        stats=stats,
    )


def list_datasets(datasets_dir: Path) -> list[DatasetInfo]:
    """Every dataset file, by name (uploaded ones with their recorded facts)."""
    found = []
    if datasets_dir.is_dir():
        for path in sorted(datasets_dir.iterdir(), key=lambda p: p.name):
            if not DATASET_NAME_RE.fullmatch(path.name) or path.is_symlink() or not path.is_file():
                continue
            found.append(_info(path, _read_sidecar(datasets_dir, path.name, path.stat().st_size), None, None))
    return found


# ----- tokenizing -----------------------------------------------------------------------------


@lru_cache(maxsize=1)
def packaged_tokenizer():
    from kiln_train.data.packaged_tokenizer import cached_tokenizer

    return cached_tokenizer()


def inspection_tokenizer(svc: Services) -> tuple[Any, str]:
    """(tokenizer, where it came from): the live runner's, or the packaged Qwen3.5 one."""
    with svc.sessions() as session:
        runner = live_runner(session, svc.settings.training.runner_stale_seconds)
    if runner is None:
        return packaged_tokenizer(), "packaged Qwen3.5 tokenizer (no live runner)"
    target = runner_target(runner)
    check_training_template(target)
    tokenizer = svc.tokenizers.get(target.model_path, target.identity.get("tokenizer_vocab_sha256"))
    return tokenizer, f"runner {target.runner_id} ({target.model_path})"


def _quiet_ingestion() -> None:
    # Skipped rows are part of the answer here, not something to log on every look.
    logging.getLogger("kiln_train.data.ingestion").setLevel(logging.ERROR)


@dataclass(frozen=True)
class Inspection:
    outcomes: list[RowOutcome]
    policy: str
    receipt: dict | None
    error: KilnError | None
    tokens: int
    supervised_tokens: int
    max_seq_len: int
    shown: tuple[int, ...] = ()  # the rows an answer shows, held in full (the rest are slim)


def inspect_file(
    path: Path, tokenizer, policy: str, locator: str, page: PageBudget | None = None
) -> Inspection:
    """Every row's outcome and the policy's verdict, as `kiln data inspect` computes them. Only
    the rows `page` takes keep their ids and rendering (docs/security.md#what-a-request-may-cost)."""
    if policy not in POLICIES:
        raise invalid_request(f"invalid_row_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    _quiet_ingestion()
    try:
        stream = iter_jsonl_outcomes(path, tokenizer=tokenizer)
        outcomes = [
            o if page is not None and page.take(i, o) else slim(o) for i, o in enumerate(yielding(stream))
        ]
    except OSError as exc:
        raise invalid_request(f"cannot read dataset {locator!r}: {exc.strerror or exc}") from None
    try:
        result = apply_invalid_row_policy(
            outcomes, policy, "dataset_path", locator, blank_lines=stream.blank_lines
        )
    except KilnError as exc:
        kept = [o.tokenized for o in outcomes if o.kept]
        return Inspection(
            outcomes,
            policy,
            None,
            exc,
            sum(r.seq_len for r in kept),
            sum(r.supervised_tokens for r in kept),
            max((r.seq_len for r in kept), default=0),
            tuple(page.shown) if page is not None else (),
        )
    return Inspection(
        outcomes,
        policy,
        result.receipt,
        None,
        result.total_tokens,
        result.total_supervised_tokens,
        result.max_seq_len,
        tuple(page.shown) if page is not None else (),
    )


def inspect_response(
    inspection: Inspection, tokenizer, tokenizer_label: str, offset: int, limit: int
) -> InspectResponse:
    page = [inspection.outcomes[i] for i in inspection.shown]
    error = inspection.error
    return InspectResponse(
        rows=[
            InspectedRow(
                facts=row_facts(o),
                text=o.rendered.text if o.rendered is not None else None,
                pieces=token_pieces(o, tokenizer) if shows_pieces(o) else None,
            )
            for o in page
        ],
        offset=offset,
        rows_read=len(inspection.outcomes),
        has_more=offset + len(page) < len(inspection.outcomes),
        invalid_row_policy=inspection.policy,  # type: ignore[arg-type]
        receipt=inspection.receipt,
        error=None if error is None else ErrorBody(code=error.code, message=error.message, hint=error.hint),
        tokens=inspection.tokens,
        supervised_tokens=inspection.supervised_tokens,
        tokenizer=tokenizer_label,
    )


def dataset_stats(inspection: Inspection, tokenizer_label: str) -> DatasetStats:
    """What a stored dataset's page shows; only for data the policy admits."""
    assert inspection.receipt is not None
    receipt = inspection.receipt
    return DatasetStats(
        invalid_row_policy=inspection.policy,  # type: ignore[arg-type]
        rows_read=receipt["rows_read"],
        rows_kept=receipt["rows_kept"],
        rows_rejected=receipt["rows_rejected"],
        tokens=inspection.tokens,
        supervised_tokens=inspection.supervised_tokens,
        max_seq_len=inspection.max_seq_len,
        kept_corpus_sha256=receipt["kept_corpus_sha256"],
        rejections=[
            DatasetRejection(
                row_index=o.row_index, row_sha256=o.row_sha256, reason=o.reason, detail=o.detail, line=o.line
            )
            for o in inspection.outcomes
            if not o.kept
        ],
        tokenizer=tokenizer_label,
        rows_per_format=_kept_per_format(inspection.outcomes),
        blank_lines=(receipt.get("row_counts") or {}).get("blank_lines", 0),
    )


def _kept_per_format(outcomes) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outcomes:
        if o.kept:
            counts[o.format] = counts.get(o.format, 0) + 1
    return dict(sorted(counts.items()))


# ----- uploads ----------------------------------------------------------------------------------


@contextlib.contextmanager
def spooled_body(stream, directory: Path, length: int | None = None) -> Iterator[tuple[Path, str, int]]:
    """The request body written to a hidden file in `directory`: (path, sha256, bytes). The file
    is removed on the way out, whatever happens (a stored upload is a hard link to it). A line
    longer than MAX_LINE_BYTES is a 400 as soon as it is seen (docs/security.md). With the body's
    `length` (Content-Length) no read goes past it: under gunicorn the stream is limited to
    `server.max_request_mb`, and one read beyond a body of exactly that size would be a 413."""
    meter = LineMeter()
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=UPLOAD_PREFIX, suffix=".tmp", dir=directory)
    path = Path(name)
    try:
        h = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "wb") as out:
            while length is None or size < length:
                chunk = stream.read(CHUNK if length is None else min(CHUNK, length - size))
                if not chunk:
                    break
                meter.feed(chunk)
                h.update(chunk)
                size += len(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        yield path, "sha256:" + h.hexdigest(), size
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def store_upload(svc: Services, name: str, stream, policy: str, length: int | None = None) -> DatasetInfo:
    """Validate and store an upload under `name`; nothing is left behind when it is refused."""
    check_dataset_name(name)
    root = svc.settings.datasets_dir
    if (root / name).exists() or (root / name).is_symlink():
        raise dataset_error(DATASET_ALREADY_EXISTS, f"dataset {name!r} already exists")
    with spooled_body(stream, root, length) as (path, sha256, size):
        if size == 0:
            raise invalid_request("the request body is empty; send the dataset as JSON Lines, one row a line")
        tokenizer, label = inspection_tokenizer(svc)
        inspection = inspect_file(path, tokenizer, policy, name)
        if inspection.error is not None:
            raise inspection.error
        record = DatasetInfo(
            name=name,
            dataset_path=name,
            bytes=size,
            sha256=sha256,
            created_at=_rfc3339(datetime.now(UTC).timestamp()),
            stats=dataset_stats(inspection, label),
        ).model_dump(mode="json")
        record.pop("dataset_path")
        sidecar = sidecar_path(root, name)
        staging = root / f"{UPLOAD_PREFIX}{uuid.uuid4().hex}.json"
        try:
            staging.write_text(json.dumps(record), encoding="utf-8")
            try:
                os.link(path, root / name)  # fails when the name exists: never an overwrite
            except FileExistsError:
                raise dataset_error(DATASET_ALREADY_EXISTS, f"dataset {name!r} already exists") from None
            try:
                os.replace(staging, sidecar)
                _fsync_dir(root)
            except OSError:
                with contextlib.suppress(FileNotFoundError):
                    (root / name).unlink()
                raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                staging.unlink()
    return DatasetInfo.model_validate({**record, "dataset_path": name})


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_dataset(svc: Services, name: str) -> DatasetInfo:
    """A dataset with its facts: recorded at upload, or computed now for a copied-in file."""
    root = svc.settings.datasets_dir
    path = dataset_file(root, name)
    sha256 = file_digest(path)
    record = _read_sidecar(root, name, path.stat().st_size)
    if record is not None and record.get("sha256") == sha256:
        return _info(path, record, sha256, None)
    tokenizer, label = inspection_tokenizer(svc)
    policy = (record or {}).get("stats", {}).get("invalid_row_policy", "skip")
    inspection = inspect_file(path, tokenizer, policy, name)
    stats = dataset_stats(inspection, label) if inspection.error is None else None
    return _info(path, None, sha256, stats)


def jobs_reading(session: Session, datasets_dir: Path, path: Path) -> list[str]:
    """Queued or running jobs whose dataset_path is this file (the worker re-reads it)."""
    rows = session.execute(
        select(Job.id, Admission.dataset_path)
        .join(Admission, Admission.job_id == Job.id)
        .where(
            Admission.data_source == states.SOURCE_DATASET_PATH,
            Job.state.in_((states.QUEUED, states.RUNNING)),
            Job.deleted_at.is_(None),
        )
        .order_by(Job.queue_seq)
    )
    target = path.resolve()
    readers = []
    for job_id, dataset_path in rows:
        try:
            if resolve_dataset_path(dataset_path, datasets_dir) == target:
                readers.append(job_id)
        except KilnError:
            continue
    return readers


def remove_dataset(datasets_dir: Path, path: Path) -> None:
    path.unlink()
    with contextlib.suppress(FileNotFoundError):
        sidecar_path(datasets_dir, path.name).unlink()
