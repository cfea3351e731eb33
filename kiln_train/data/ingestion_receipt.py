"""The SFT ingestion receipt `kiln.sft-ingestion.v1`: build and validate.

docs/ingestion.md#ingestion-receipt.

Stored at `train_receipt.json -> data.sft_ingestion`. Invariants (enforced on write and read):
schema exact; source in the enum; `source_locator` non-blank when present (omitted for inline);
`rows_read == rows_kept + rows_rejected`; `rows_kept > 0`; list lengths equal the counts;
rejected `row_index` 1-based among non-blank rows, strictly increasing, <= rows_read; every hash
`sha256:<64 lowercase hex>`; rejection reasons from the contract enum; `kept_corpus_sha256`
recomputes from `kept_row_hashes`; unknown fields rejected. One implied invariant is also
enforced: a `fail`-policy receipt records no rejected rows (any rejection aborts the ingestion).

A run with held-out validation adds one member, `validation` (absent otherwise, so a receipt
without validation is byte-identical to one written before validation existed): the held-out
rows' own counts, hashes and corpus digest (docs/validation.md). Its `source` is `inline` or
`dataset_path` (rows of their own, ingested under the same policy) or `holdout` (rows taken out of
the submitted ones after the policy: then `holdout_percent` is present, nothing is rejected in the
part, and the top level's `rows_read` counts them: `rows_read == rows_kept + rows_rejected +
validation.rows_kept`).
"""

from __future__ import annotations

from kiln_train.data.conversation import REJECTION_REASONS
from kiln_train.data.row_identity import is_digest, kept_corpus_sha256
from kiln_train.errors import KilnError, invalid_request

INGESTION_SCHEMA = "kiln.sft-ingestion.v1"
SOURCES = ("inline", "dataset_path", "named_dataset", "corrections", "recipe", "rust_api")
POLICIES = ("fail", "skip")
# The row accounting the receipt and its `validation` part both end with (`_row_accounting`).
ROW_ACCOUNTING_FIELDS = (
    "rows_read",
    "rows_kept",
    "rows_rejected",
    "kept_row_hashes",
    "rejected_rows",
    "kept_corpus_sha256",
)
RECEIPT_FIELDS = ("schema", "source", "source_locator", "invalid_row_policy", *ROW_ACCOUNTING_FIELDS)
REJECTED_ROW_FIELDS = ("row_index", "row_sha256", "reason")
REJECTED_ROW_OPTIONAL = ("line",)  # the physical line of a JSONL row (blank lines counted)
# What reading counted besides kept/rejected rows (absent from receipts written before it existed).
ROW_COUNTS_KEY = "row_counts"
ROW_COUNTS_FIELDS = ("blank_lines", "rows_per_format", "rows_skipped", "rows_truncated", "tokens_dropped")
VALIDATION_KEY = "validation"
VALIDATION_SOURCES = ("inline", "dataset_path", "holdout")
VALIDATION_PART_FIELDS = ("source", "source_locator", "holdout_percent", *ROW_ACCOUNTING_FIELDS)


def build_ingestion_receipt(
    source: str,
    source_locator: str | None,
    policy: str,
    rows_read: int,
    kept_row_hashes: list[str],
    rejected_rows: list[dict],
    *,
    row_counts: dict | None = None,
) -> dict:
    """The `kiln.sft-ingestion.v1` object, validated before it is returned."""
    receipt: dict = {"schema": INGESTION_SCHEMA, "source": source}
    if source_locator is not None:
        receipt["source_locator"] = source_locator
    receipt["invalid_row_policy"] = policy
    receipt.update(_row_accounting(rows_read, kept_row_hashes, rejected_rows))
    if row_counts is not None:
        receipt[ROW_COUNTS_KEY] = dict(row_counts)
    validate_ingestion_receipt(receipt)
    return receipt


def _row_accounting(rows_read: int, kept_row_hashes: list[str], rejected_rows: list[dict]) -> dict:
    """The `ROW_ACCOUNTING_FIELDS` members, in that order."""
    return {
        "rows_read": rows_read,
        "rows_kept": len(kept_row_hashes),
        "rows_rejected": len(rejected_rows),
        "kept_row_hashes": list(kept_row_hashes),
        "rejected_rows": [dict(r) for r in rejected_rows],
        "kept_corpus_sha256": kept_corpus_sha256(kept_row_hashes),
    }


def build_validation_part(
    source: str,
    source_locator: str | None,
    holdout_percent: int | None,
    rows_read: int,
    kept_row_hashes: list[str],
    rejected_rows: list[dict],
) -> dict:
    """The receipt's `validation` member (validated with its receipt by `with_validation_part`)."""
    part: dict = {"source": source}
    if source_locator is not None:
        part["source_locator"] = source_locator
    if holdout_percent is not None:
        part["holdout_percent"] = holdout_percent
    part.update(_row_accounting(rows_read, kept_row_hashes, rejected_rows))
    return part


def with_validation_part(receipt: dict, part: dict) -> dict:
    """`receipt` with its `validation` member (last), validated as a whole."""
    out = {k: v for k, v in receipt.items() if k != VALIDATION_KEY}
    out[VALIDATION_KEY] = part
    validate_ingestion_receipt(out)
    return out


def _bad(why: str) -> KilnError:
    return invalid_request(f"invalid {INGESTION_SCHEMA} receipt: {why}")


def validate_ingestion_receipt(obj) -> None:
    """Enforce every `kiln.sft-ingestion.v1` invariant; KilnError if one fails."""
    bad = _bad
    if not isinstance(obj, dict):
        raise bad("expected an object")
    unknown = sorted(set(obj) - set(RECEIPT_FIELDS) - {VALIDATION_KEY, ROW_COUNTS_KEY})
    if unknown:
        raise bad(f"unknown field(s) {', '.join(unknown)}")
    missing = [k for k in RECEIPT_FIELDS if k != "source_locator" and k not in obj]
    if missing:
        raise bad(f"missing field(s) {', '.join(missing)}")
    if obj["schema"] != INGESTION_SCHEMA:
        raise bad(f"schema is {obj['schema']!r}")
    if obj["source"] not in SOURCES:
        raise bad(f"source {obj['source']!r} is not one of {', '.join(SOURCES)}")
    if "source_locator" in obj:
        locator = obj["source_locator"]
        if not isinstance(locator, str) or not locator.strip():
            raise bad("source_locator must be a non-blank string when present")
    if obj["invalid_row_policy"] not in POLICIES:
        raise bad(f"invalid_row_policy {obj['invalid_row_policy']!r} is not one of {', '.join(POLICIES)}")
    part = obj.get(VALIDATION_KEY)
    holdout = isinstance(part, dict) and part.get("source") == "holdout"
    held_out = part.get("rows_kept") if holdout else 0
    _check_rows(obj, obj["invalid_row_policy"], RECEIPT_FIELDS, "", held_out=held_out)
    if ROW_COUNTS_KEY in obj:
        _check_row_counts(obj[ROW_COUNTS_KEY], obj, held_out if isinstance(held_out, int) else 0)
    if VALIDATION_KEY in obj:
        _check_rows(part, obj["invalid_row_policy"], VALIDATION_PART_FIELDS, "validation.")
        if part["source"] not in VALIDATION_SOURCES:
            raise bad(f"validation.source {part['source']!r} is not one of {', '.join(VALIDATION_SOURCES)}")
        if holdout:
            percent = part.get("holdout_percent")
            if not isinstance(percent, int) or isinstance(percent, bool) or not 1 <= percent <= 50:
                raise bad("validation.holdout_percent must be an integer in 1..=50 for a holdout")
            if "source_locator" in part or part["rows_rejected"]:
                raise bad("a holdout part has no source_locator and rejects nothing")
        elif "holdout_percent" in part:
            raise bad("validation.holdout_percent is recorded only for a holdout")


def _check_rows(obj, policy: str, fields: tuple[str, ...], where: str, held_out: int = 0) -> None:
    """The row accounting shared by the receipt and its `validation` part (field names prefixed
    with `where`). `held_out` rows (a holdout's) were read at the top level but kept elsewhere."""
    bad = _bad
    if not isinstance(obj, dict):
        raise bad(f"{where or 'receipt '}must be an object")
    unknown = sorted(set(obj) - set(fields) - ({VALIDATION_KEY, ROW_COUNTS_KEY} if not where else set()))
    if unknown:
        raise bad(f"unknown field(s) {', '.join(where + k for k in unknown)}")
    optional = ("source_locator", "holdout_percent", "schema", "invalid_row_policy")
    missing = [where + k for k in fields if k not in optional and k not in obj]
    if missing:
        raise bad(f"missing field(s) {', '.join(missing)}")
    if "source_locator" in obj:
        locator = obj["source_locator"]
        if not isinstance(locator, str) or not locator.strip():
            raise bad(f"{where}source_locator must be a non-blank string when present")
    counts = {}
    for key in ("rows_read", "rows_kept", "rows_rejected"):
        value = obj[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad(f"{where}{key} must be a non-negative integer")
        counts[key] = value
    if not isinstance(held_out, int) or isinstance(held_out, bool) or held_out < 0:
        raise bad("validation.rows_kept must be a non-negative integer")
    if counts["rows_read"] != counts["rows_kept"] + counts["rows_rejected"] + held_out:
        raise bad(
            f"{where}rows_read != {where}rows_kept + {where}rows_rejected"
            + (" + validation.rows_kept" if held_out else "")
        )
    if counts["rows_kept"] <= 0:
        raise bad(f"{where}rows_kept must be > 0")
    kept, rejected = obj["kept_row_hashes"], obj["rejected_rows"]
    if not isinstance(kept, list) or len(kept) != counts["rows_kept"]:
        raise bad(f"{where}kept_row_hashes length differs from {where}rows_kept")
    if not isinstance(rejected, list) or len(rejected) != counts["rows_rejected"]:
        raise bad(f"{where}rejected_rows length differs from {where}rows_rejected")
    for h in kept:
        if not is_digest(h):
            raise bad(f"kept row hash {h!r} is not sha256:<64 lowercase hex>")
    if policy == "fail" and rejected:
        raise bad("a fail-policy ingestion cannot record rejected rows")
    previous = 0
    for entry in rejected:
        if not isinstance(entry, dict) or not set(REJECTED_ROW_FIELDS) <= set(entry) <= {
            *REJECTED_ROW_FIELDS,
            *REJECTED_ROW_OPTIONAL,
        }:
            raise bad(
                f"rejected row entries have the fields {', '.join(REJECTED_ROW_FIELDS)} "
                f"(and {', '.join(REJECTED_ROW_OPTIONAL)} for a file's row)"
            )
        line = entry.get("line", 1)
        if not isinstance(line, int) or isinstance(line, bool) or line < 1:
            raise bad("rejected row line must be a 1-based integer")
        index = entry["row_index"]
        if not isinstance(index, int) or isinstance(index, bool) or index < 1:
            raise bad("rejected row_index must be a 1-based integer")
        if index <= previous:
            raise bad("rejected row_index values must be strictly increasing")
        if index > counts["rows_read"]:
            raise bad(f"rejected row_index {index} exceeds {where}rows_read")
        previous = index
        if not is_digest(entry["row_sha256"]):
            raise bad(f"rejected row_sha256 {entry['row_sha256']!r} is not sha256:<64 lowercase hex>")
        if entry["reason"] not in REJECTION_REASONS:
            raise bad(f"rejection reason {entry['reason']!r} is not one of {', '.join(REJECTION_REASONS)}")
    if not is_digest(obj["kept_corpus_sha256"]):
        raise bad(f"{where}kept_corpus_sha256 is not sha256:<64 lowercase hex>")
    if kept_corpus_sha256(kept) != obj["kept_corpus_sha256"]:
        raise bad(f"{where}kept_corpus_sha256 does not recompute from {where}kept_row_hashes")


def _check_row_counts(counts, receipt: dict, held_out: int) -> None:
    """`row_counts`: non-negative integers; kept rows per format sum to the rows kept (a holdout's
    rows included: they were kept before the split); skipped rows
    are the rejected ones; dropped tokens only with truncated rows."""
    bad = _bad
    if not isinstance(counts, dict) or set(counts) != set(ROW_COUNTS_FIELDS):
        raise bad(f"row_counts has exactly the fields {', '.join(ROW_COUNTS_FIELDS)}")

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    for key in ROW_COUNTS_FIELDS:
        if key != "rows_per_format" and not count(counts[key]):
            raise bad(f"row_counts.{key} must be a non-negative integer")
    per_format = counts["rows_per_format"]
    if not isinstance(per_format, dict) or not all(count(v) for v in per_format.values()):
        raise bad("row_counts.rows_per_format maps format names to non-negative integers")
    if sum(per_format.values()) != receipt["rows_kept"] + held_out:
        raise bad("row_counts.rows_per_format does not add up to the rows kept")
    if counts["rows_skipped"] != receipt["rows_rejected"]:
        raise bad("row_counts.rows_skipped differs from rows_rejected")
    if counts["rows_truncated"] > receipt["rows_kept"] + held_out or (counts["tokens_dropped"] > 0) != (
        counts["rows_truncated"] > 0
    ):
        raise bad("row_counts: tokens_dropped and rows_truncated disagree")
