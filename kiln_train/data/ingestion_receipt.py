"""The SFT ingestion receipt `kiln.sft-ingestion.v1`: build and validate.

docs/ingestion.md#ingestion-receipt.

Stored at `train_receipt.json -> data.sft_ingestion`. Invariants (enforced on write and read):
schema exact; source in the enum; `source_locator` non-blank when present (omitted for inline);
`rows_read == rows_kept + rows_rejected`; `rows_kept > 0`; list lengths equal the counts;
rejected `row_index` 1-based among non-blank rows, strictly increasing, <= rows_read; every hash
`sha256:<64 lowercase hex>`; rejection reasons from the contract enum; `kept_corpus_sha256`
recomputes from `kept_row_hashes`; unknown fields rejected. One implied invariant is also
enforced: a `fail`-policy receipt records no rejected rows (any rejection aborts the ingestion).
"""

from __future__ import annotations

from kiln_train.data.conversation import REJECTION_REASONS
from kiln_train.data.row_identity import is_digest, kept_corpus_sha256
from kiln_train.errors import KilnError, invalid_request

INGESTION_SCHEMA = "kiln.sft-ingestion.v1"
SOURCES = ("inline", "dataset_path", "named_dataset", "corrections", "recipe", "rust_api")
POLICIES = ("fail", "skip")
RECEIPT_FIELDS = (
    "schema",
    "source",
    "source_locator",
    "invalid_row_policy",
    "rows_read",
    "rows_kept",
    "rows_rejected",
    "kept_row_hashes",
    "rejected_rows",
    "kept_corpus_sha256",
)
REJECTED_ROW_FIELDS = ("row_index", "row_sha256", "reason")


def build_ingestion_receipt(
    source: str,
    source_locator: str | None,
    policy: str,
    rows_read: int,
    kept_row_hashes: list[str],
    rejected_rows: list[dict],
) -> dict:
    """The `kiln.sft-ingestion.v1` object, validated before it is returned."""
    receipt: dict = {"schema": INGESTION_SCHEMA, "source": source}
    if source_locator is not None:
        receipt["source_locator"] = source_locator
    receipt.update(
        invalid_row_policy=policy,
        rows_read=rows_read,
        rows_kept=len(kept_row_hashes),
        rows_rejected=len(rejected_rows),
        kept_row_hashes=list(kept_row_hashes),
        rejected_rows=[dict(r) for r in rejected_rows],
        kept_corpus_sha256=kept_corpus_sha256(kept_row_hashes),
    )
    validate_ingestion_receipt(receipt)
    return receipt


def validate_ingestion_receipt(obj) -> None:
    """Enforce every `kiln.sft-ingestion.v1` invariant; KilnError if one fails."""

    def bad(why: str) -> KilnError:
        return invalid_request(f"invalid {INGESTION_SCHEMA} receipt: {why}")

    if not isinstance(obj, dict):
        raise bad("expected an object")
    unknown = sorted(set(obj) - set(RECEIPT_FIELDS))
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
    counts = {}
    for key in ("rows_read", "rows_kept", "rows_rejected"):
        value = obj[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise bad(f"{key} must be a non-negative integer")
        counts[key] = value
    if counts["rows_read"] != counts["rows_kept"] + counts["rows_rejected"]:
        raise bad("rows_read != rows_kept + rows_rejected")
    if counts["rows_kept"] <= 0:
        raise bad("rows_kept must be > 0")
    kept, rejected = obj["kept_row_hashes"], obj["rejected_rows"]
    if not isinstance(kept, list) or len(kept) != counts["rows_kept"]:
        raise bad("kept_row_hashes length differs from rows_kept")
    if not isinstance(rejected, list) or len(rejected) != counts["rows_rejected"]:
        raise bad("rejected_rows length differs from rows_rejected")
    for h in kept:
        if not is_digest(h):
            raise bad(f"kept row hash {h!r} is not sha256:<64 lowercase hex>")
    if obj["invalid_row_policy"] == "fail" and rejected:
        raise bad("a fail-policy ingestion cannot record rejected rows")
    previous = 0
    for entry in rejected:
        if not isinstance(entry, dict) or set(entry) != set(REJECTED_ROW_FIELDS):
            raise bad(f"rejected row entries have exactly the fields {', '.join(REJECTED_ROW_FIELDS)}")
        index = entry["row_index"]
        if not isinstance(index, int) or isinstance(index, bool) or index < 1:
            raise bad("rejected row_index must be a 1-based integer")
        if index <= previous:
            raise bad("rejected row_index values must be strictly increasing")
        if index > counts["rows_read"]:
            raise bad(f"rejected row_index {index} exceeds rows_read")
        previous = index
        if not is_digest(entry["row_sha256"]):
            raise bad(f"rejected row_sha256 {entry['row_sha256']!r} is not sha256:<64 lowercase hex>")
        if entry["reason"] not in REJECTION_REASONS:
            raise bad(f"rejection reason {entry['reason']!r} is not one of {', '.join(REJECTION_REASONS)}")
    if not is_digest(obj["kept_corpus_sha256"]):
        raise bad("kept_corpus_sha256 is not sha256:<64 lowercase hex>")
    if kept_corpus_sha256(kept) != obj["kept_corpus_sha256"]:
        raise bad("kept_corpus_sha256 does not recompute from kept_row_hashes")
