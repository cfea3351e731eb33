"""Held-out validation rows: where they come from, the deterministic holdout split, and the
identity a run binds (docs/validation.md). Torch-free: the api prices and pins them at
admission, the worker re-derives them at dequeue, the trainer evaluates them.

A request's `validation` names exactly one source:

- `examples`: inline rows of their own, ingested exactly like training rows (same template,
  labels, row formats, the same length rule, same `invalid_row_policy`, same row hashes); a malformed example is
  `validation.examples[<i>]`, a rejected row `SFT validation row <n>`.
- `dataset_path`: a JSONL file under the server's datasets directory, same rules.
- `holdout_percent` P (1..=50): the submitted rows are ingested once, then the kept rows are split
  by `kiln.sft-holdout.v1` (`holdout_split`): rows with one row hash stay together, and the
  choice depends only on the row hashes and the run's effective seed.

The training ingestion receipt then carries a `validation` part (kiln_train.data.ingestion_receipt)
and the trainer gets a `ValidationSet`: the rows, that part, and the evaluation interval.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

from kiln_train.data.chat_template import ChatTemplate
from kiln_train.data.ingestion import (
    IngestionResult,
    LengthRule,
    TokenizedRow,
    TokenStats,
    ingestion_result,
    iter_example_outcomes,
    iter_jsonl_outcomes,
    resolve_dataset_path,
    select_rows,
)
from kiln_train.data.ingestion_receipt import VALIDATION_KEY, build_validation_part, with_validation_part
from kiln_train.data.row_identity import kept_corpus_sha256
from kiln_train.errors import KilnError, invalid_request
from kiln_train.sft_config import ValidationSpec

VALIDATION_SCHEMA = "kiln.sft-validation.v1"
HOLDOUT_ALGORITHM = "kiln.sft-holdout.v1"
HOLDOUT_DOMAIN = b"kiln.sft-holdout.v1"
VALIDATION_ROW_LABEL = "SFT validation row"
VALIDATION_EMPTY = "validation corpus contains no usable rows"


@dataclass(frozen=True)
class ValidationSet:
    """The held-out rows of a run, their receipt part and when to evaluate them."""

    rows: list[TokenizedRow]
    part: dict  # the training receipt's `validation` member
    interval_steps: int | None = None

    @property
    def source(self) -> str:
        return self.part["source"]

    @property
    def corpus_sha256(self) -> str:
        return self.part["kept_corpus_sha256"]

    @property
    def stats(self) -> TokenStats:
        """Lengths and supervised counts of the held-out rows (memory admission prices the longest)."""
        return TokenStats.of(self.rows)

    def identity(self) -> dict:
        """What a checkpoint binds (a resume must bring the same) and the receipt section opens
        with: the corpus and the schedule, never the results."""
        return {
            "schema": VALIDATION_SCHEMA,
            "source": self.source,
            "rows": len(self.rows),
            "supervised_tokens": self.stats.total_supervised_tokens,
            "corpus_sha256": self.corpus_sha256,
            "interval_steps": self.interval_steps,
        }

    def check(self) -> None:
        """The rows match their part (the trainer's re-check before any work); ValueError if not."""
        hashes = [r.row_sha256 for r in self.rows]
        if not self.rows or hashes != self.part["kept_row_hashes"]:
            raise ValueError("the validation rows do not match their receipt part")
        if kept_corpus_sha256(hashes) != self.corpus_sha256:
            raise ValueError("the validation corpus digest does not recompute")
        if self.interval_steps is not None and self.interval_steps < 1:
            raise ValueError("validation interval_steps must be >= 1")


# --------------------------------------------------------------------------- the holdout


def holdout_key(seed: int, row_sha256: str) -> bytes:
    """The sort key of one row hash: SHA-256 over `kiln.sft-holdout.v1`, NUL, the seed as 8 bytes
    big-endian, and the hash string's ASCII bytes."""
    h = hashlib.sha256(HOLDOUT_DOMAIN)
    h.update(b"\0")
    h.update(int(seed).to_bytes(8, "big"))
    h.update(row_sha256.encode("ascii"))
    return h.digest()


def holdout_split(row_hashes: list[str], percent: int, seed: int) -> list[bool]:
    """`kiln.sft-holdout.v1`: which of the kept rows (by their hashes, in order) are held out.

    target = ceil(n x percent / 100) rows. The distinct hashes are ordered by `holdout_key(seed,
    hash)` (then by the hash); whole groups of equal hashes are taken in that order while fewer
    than `target` rows are held out. At least one row must stay on each side (400 naming
    `validation.holdout_percent` otherwise).
    """
    if isinstance(percent, bool) or not isinstance(percent, int) or not 1 <= percent <= 50:
        raise invalid_request(f"validation.holdout_percent must be an integer in 1..=50, got {percent!r}")
    n = len(row_hashes)
    target = math.ceil(n * percent / 100)
    counts: dict[str, int] = {}
    for h in row_hashes:
        counts[h] = counts.get(h, 0) + 1
    held: set[str] = set()
    taken = 0
    for h in sorted(counts, key=lambda h: (holdout_key(seed, h), h)):
        if taken >= target:
            break
        held.add(h)
        taken += counts[h]
    if taken == 0 or taken >= n:
        raise invalid_request(
            f"validation.holdout_percent {percent}: {n} kept row(s) in {len(counts)} distinct row hash(es) "
            f"cannot be split with at least one row on each side (rows with the same hash stay together); "
            "send more rows or give validation rows of their own"
        )
    return [h in held for h in row_hashes]


def split_holdout(
    ingestion: IngestionResult, percent: int, seed: int, interval_steps: int | None = None
) -> tuple[IngestionResult, ValidationSet]:
    """The training rows and the held-out rows of one ingestion (submission order kept on both
    sides); the training receipt keeps the top-level counts and gains the holdout part."""
    receipt = ingestion.receipt
    held = holdout_split([r.row_sha256 for r in ingestion.rows], percent, seed)
    train = [r for r, h in zip(ingestion.rows, held, strict=True) if not h]
    valid = [r for r, h in zip(ingestion.rows, held, strict=True) if h]
    hashes = [r.row_sha256 for r in train]
    base = {k: v for k, v in receipt.items() if k != VALIDATION_KEY}
    base.update(
        rows_kept=len(train),
        kept_row_hashes=hashes,
        kept_corpus_sha256=kept_corpus_sha256(hashes),
    )
    part = build_validation_part("holdout", None, percent, len(valid), [r.row_sha256 for r in valid], [])
    return (
        ingestion_result(with_validation_part(base, part), train),
        ValidationSet(valid, part, interval_steps),
    )


# --------------------------------------------------------------------------- rows of their own


def ingest_validation_rows(
    spec: ValidationSpec,
    *,
    tokenizer,
    template: ChatTemplate | None = None,
    policy: str = "fail",
    datasets_root: Path | None = None,
    limit: LengthRule | None = None,
) -> tuple[list[TokenizedRow], dict]:
    """Ingest `validation.examples` or `validation.dataset_path` (not a holdout): the kept rows
    and the receipt part. Errors name the validation field or row."""
    if spec.examples is not None:
        outcomes = iter_example_outcomes(
            list(spec.examples),
            tokenizer=tokenizer,
            template=template,
            field="validation.examples",
            limit=limit,
        )
        rows, rejected, read = select_rows(
            outcomes, policy, row_label=VALIDATION_ROW_LABEL, empty=VALIDATION_EMPTY
        )
        return rows, build_validation_part("inline", None, None, read, [r.row_sha256 for r in rows], rejected)
    if spec.dataset_path is None:
        raise ValueError("a holdout has no rows of its own to ingest")
    if datasets_root is None:
        raise invalid_request("validation.dataset_path needs the server's datasets directory")
    try:
        path = resolve_dataset_path(spec.dataset_path, datasets_root)
    except KilnError as exc:
        raise invalid_request(f"validation.{exc.detail}") from None
    outcomes = iter_jsonl_outcomes(path, tokenizer=tokenizer, template=template, limit=limit)
    try:
        rows, rejected, read = select_rows(
            outcomes, policy, row_label=VALIDATION_ROW_LABEL, empty=VALIDATION_EMPTY
        )
    except OSError as exc:
        raise invalid_request(
            f"validation.dataset_path: cannot read dataset {spec.dataset_path!r}: {exc.strerror or exc}"
        ) from None
    part = build_validation_part(
        "dataset_path", spec.dataset_path, None, read, [r.row_sha256 for r in rows], rejected
    )
    return rows, part


def prepare_validation(
    spec: ValidationSpec | None,
    ingestion: IngestionResult,
    *,
    tokenizer,
    template: ChatTemplate | None = None,
    policy: str = "fail",
    seed: int | None = None,
    datasets_root: Path | None = None,
    limit: LengthRule | None = None,
) -> tuple[IngestionResult, ValidationSet | None]:
    """The run's training ingestion and validation set for a request's `validation` (None: the
    ingestion unchanged, no validation). A holdout needs the run's effective `seed`; rows of their
    own are held to the same length rule (`limit`) as the training rows."""
    if spec is None:
        return ingestion, None
    if spec.holdout_percent is not None:
        if seed is None:
            raise ValueError("a holdout split needs the run's effective seed")
        return split_holdout(ingestion, spec.holdout_percent, seed, spec.interval_steps)
    rows, part = ingest_validation_rows(
        spec, tokenizer=tokenizer, template=template, policy=policy, datasets_root=datasets_root, limit=limit
    )
    receipt = with_validation_part(ingestion.receipt, part)
    return ingestion_result(receipt, ingestion.rows), ValidationSet(rows, part, spec.interval_steps)
