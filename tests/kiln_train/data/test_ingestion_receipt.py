"""The ingestion receipt's reader checks: every broken field or binding is named
(docs/ingestion.md#ingestion-receipt)."""

from __future__ import annotations

import copy

import pytest

from kiln_train.data.ingestion import build_ingestion_receipt, validate_ingestion_receipt
from kiln_train.errors import KilnError
from tests.kiln_train.data.ingestion_support import PLAIN_SHA, RAW_SHA, TOOL_SHA, reject_message


def _receipt():
    return build_ingestion_receipt(
        "dataset_path",
        "d.jsonl",
        "skip",
        3,
        [PLAIN_SHA, TOOL_SHA],
        [{"row_index": 2, "row_sha256": RAW_SHA, "reason": "invalid_json"}],
    )


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda r: r.update(extra=1), "unknown field"),
        (lambda r: r.pop("rows_read"), "missing field"),
        (lambda r: r.update(schema="kiln.sft-ingestion.v2"), "schema"),
        (lambda r: r.update(source="ftp"), "source"),
        (lambda r: r.update(source_locator="  "), "source_locator"),
        (lambda r: r.update(invalid_row_policy="drop"), "invalid_row_policy"),
        (lambda r: r.update(rows_read=4), "rows_read != rows_kept + rows_rejected"),
        (lambda r: r.update(rows_read=True), "non-negative integer"),
        (
            lambda r: r.update(rows_read=1, rows_kept=0, rows_rejected=1, kept_row_hashes=[]),
            "rows_kept must be > 0",
        ),
        (lambda r: r["kept_row_hashes"].append(PLAIN_SHA), "kept_row_hashes length"),
        (lambda r: r["kept_row_hashes"].__setitem__(0, "sha256:ABC"), "is not sha256"),
        (lambda r: r["kept_row_hashes"].__setitem__(0, PLAIN_SHA + "\n"), "is not sha256"),
        (lambda r: r["rejected_rows"][0].update(row_index=0), "1-based"),
        (lambda r: r["rejected_rows"][0].update(row_index=9), "exceeds rows_read"),
        (lambda r: r["rejected_rows"][0].update(reason="too_short"), "rejection reason"),
        (lambda r: r["rejected_rows"][0].update(detail="x"), "rejected row entries have the fields"),
        (lambda r: r["rejected_rows"][0].update(line=0), "line must be a 1-based"),
        (lambda r: r.update(row_counts={"blank_lines": 0}), "row_counts has exactly"),
        (lambda r: r["rejected_rows"][0].update(row_sha256="sha256:0"), "row_sha256"),
        (lambda r: r.update(kept_corpus_sha256=PLAIN_SHA), "does not recompute"),
        (lambda r: r.update(kept_row_hashes=[TOOL_SHA, PLAIN_SHA]), "does not recompute"),
        (lambda r: r.update(invalid_row_policy="fail"), "fail-policy"),
    ],
)
def test_receipt_validator_rejects(mutate, why):
    receipt = _receipt()
    validate_ingestion_receipt(copy.deepcopy(receipt))
    mutate(receipt)
    with pytest.raises(KilnError) as err:
        validate_ingestion_receipt(receipt)
    assert why in reject_message(err.value)


def test_receipt_validator_requires_increasing_row_indexes():
    receipt = build_ingestion_receipt(
        "inline",
        None,
        "skip",
        4,
        [PLAIN_SHA, TOOL_SHA],
        [
            {"row_index": 1, "row_sha256": RAW_SHA, "reason": "invalid_json"},
            {"row_index": 3, "row_sha256": RAW_SHA, "reason": "invalid_json"},
        ],
    )
    assert "source_locator" not in receipt
    receipt["rejected_rows"].reverse()
    with pytest.raises(KilnError) as err:
        validate_ingestion_receipt(receipt)
    assert "strictly increasing" in reject_message(err.value)
