"""Held-out validation rows (kiln_train.data.validation, docs/validation.md): the request field,
the pinned `kiln.sft-holdout.v1` split, ingestion of rows of their own, and the receipt part."""

from __future__ import annotations

import hashlib
import json

import pytest

from kiln_train.data.ingestion import LengthRule, ingest_examples, ingest_jsonl
from kiln_train.data.ingestion_receipt import validate_ingestion_receipt
from kiln_train.data.row_identity import kept_corpus_sha256
from kiln_train.data.validation import (
    HOLDOUT_DOMAIN,
    VALIDATION_SCHEMA,
    holdout_key,
    holdout_split,
    prepare_validation,
)
from kiln_train.errors import KilnError
from kiln_train.sft_config import ValidationSpec, parse_sft_request


def row(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"Question {i}?"},
            {"role": "assistant", "content": f"Answer {i}."},
        ]
    }


NO_TARGET = {"messages": [{"role": "user", "content": "only a question"}]}


@pytest.fixture(scope="module")
def rows14():
    """Twelve distinct rows, then row 3 twice more (row indexes 13 and 14 share its hash)."""
    rows = [row(i) for i in range(12)]
    return [*rows, rows[3], rows[3]]


@pytest.fixture(scope="module")
def ingestion(qwen_tokenizer, rows14):
    return ingest_examples(rows14, tokenizer=qwen_tokenizer)


def _spec(**fields) -> ValidationSpec:
    return ValidationSpec.model_validate(fields)


# ----- the request field -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("validation", "fragment"),
    [
        ({}, "validation: exactly one of examples, dataset_path or holdout_percent is required"),
        (
            {"holdout_percent": 10, "examples": [row(0)]},
            "validation: exactly one of examples, dataset_path or holdout_percent",
        ),
        ({"holdout_percent": 0}, "validation.holdout_percent: Input should be greater than or equal to 1"),
        ({"holdout_percent": 51}, "validation.holdout_percent: Input should be less than or equal to 50"),
        ({"holdout_percent": "10"}, "validation.holdout_percent: Input should be a valid integer"),
        ({"holdout_percent": 10, "interval_steps": 0}, "validation.interval_steps: Input should be greater"),
        ({"holdout_percent": 10, "interval_steps": 2**64}, "validation.interval_steps: Input should be less"),
        ({"examples": []}, "validation: examples must contain at least one example"),
        ({"dataset_path": "  "}, "validation: dataset_path must not be blank"),
        ({"holdout_percent": 10, "seed": 3}, "validation.seed: unknown field"),
        ([1], "validation: Input should be a valid dictionary"),
    ],
)
def test_the_request_field_names_what_is_wrong(validation, fragment):
    with pytest.raises(KilnError) as info:
        parse_sft_request({"examples": [row(0)], "validation": validation})
    assert info.value.code == "training_invalid_request"
    assert fragment in info.value.detail


def test_the_request_field_accepts_each_source_with_or_without_an_interval():
    for fields, source in (
        ({"examples": [row(0)]}, "inline"),
        ({"dataset_path": "held-out.jsonl", "interval_steps": 5}, "dataset_path"),
        ({"holdout_percent": 50, "interval_steps": 2**64 - 1}, "holdout"),
    ):
        request = parse_sft_request({"examples": [row(0)], "validation": fields})
        assert request.validation.source == source
    assert parse_sft_request({"examples": [row(0)]}).validation is None


# ----- the holdout split --------------------------------------------------------------------------


def test_the_holdout_key_is_sha256_of_domain_seed_and_hash():
    h = "sha256:" + "ab" * 32
    expected = hashlib.sha256(HOLDOUT_DOMAIN + b"\0" + (7).to_bytes(8, "big") + h.encode("ascii")).digest()
    assert holdout_key(7, h) == expected
    assert holdout_key(8, h) != expected


def test_a_fixed_seed_and_rows_give_a_fixed_split(qwen_tokenizer, ingestion):
    """The algorithm pinned: these rows and seeds must always hold out exactly these rows."""
    pinned = {
        0: ([3, 4, 6, 13, 14], "sha256:4afbe3e91726fec21bc7222e60936a074c1cecee247e2c57351387aa41d39cc5"),
        1: ([1, 7, 9, 11], "sha256:e584e6a5217d2d137154eed3388bd68f0045be848c8d8381b53f0f76e632bd4b"),
        20260503: ([1, 2, 7, 12], "sha256:adec681a21a9689b6574a33a24d8b1b819e603eaaa086f05fb06cab1f3243e98"),
    }
    for seed, (held, corpus) in pinned.items():
        train, validation = prepare_validation(
            _spec(holdout_percent=25), ingestion, tokenizer=qwen_tokenizer, seed=seed
        )
        assert [r.row_index for r in validation.rows] == held, seed
        assert validation.corpus_sha256 == corpus, seed
        assert [r.row_index for r in train.rows] == [i for i in range(1, 15) if i not in held]


def test_rows_with_one_hash_never_straddle_and_groups_are_taken_whole():
    a, b, c = ("sha256:" + ch * 64 for ch in "abc")
    hashes = [a, b, a, c, a, b]
    for seed in range(40):
        for percent in (1, 10, 34, 50):
            try:
                held = holdout_split(hashes, percent, seed)
            except KilnError:
                continue
            for h in (a, b, c):
                assert len({x for x, y in zip(held, hashes, strict=True) if y == h}) == 1
            target = -(-len(hashes) * percent // 100)
            assert sum(held) >= target  # groups are taken whole, so a split may overshoot
            assert 0 < sum(held) < len(hashes)


def test_the_target_is_the_ceiling_of_the_percentage():
    hashes = [f"sha256:{i:064x}" for i in range(10)]
    assert [sum(holdout_split(hashes, p, 5)) for p in (1, 10, 11, 25, 50)] == [1, 1, 2, 3, 5]


@pytest.mark.parametrize(
    "hashes",
    [["sha256:" + "a" * 64], ["sha256:" + "a" * 64] * 3],
    ids=["one row", "one hash"],
)
def test_a_split_without_a_row_on_each_side_is_refused_naming_the_field(hashes):
    with pytest.raises(KilnError) as info:
        holdout_split(hashes, 50, 1)
    assert info.value.detail.startswith("validation.holdout_percent 50:")
    assert "at least one row on each side" in info.value.detail


def test_the_holdout_receipt_keeps_the_submitted_counts_and_lists_the_held_out_rows(
    qwen_tokenizer, ingestion
):
    train, validation = prepare_validation(
        _spec(holdout_percent=25, interval_steps=3), ingestion, tokenizer=qwen_tokenizer, seed=1
    )
    receipt = train.receipt
    validate_ingestion_receipt(receipt)
    part = receipt["validation"]
    assert list(receipt)[-1] == "validation"
    assert receipt["rows_read"] == 14 == receipt["rows_kept"] + receipt["rows_rejected"] + part["rows_kept"]
    assert receipt["kept_row_hashes"] == [r.row_sha256 for r in train.rows]
    assert receipt["kept_corpus_sha256"] == kept_corpus_sha256(receipt["kept_row_hashes"])
    assert part == {
        "source": "holdout",
        "holdout_percent": 25,
        "rows_read": 4,
        "rows_kept": 4,
        "rows_rejected": 0,
        "kept_row_hashes": [r.row_sha256 for r in validation.rows],
        "rejected_rows": [],
        "kept_corpus_sha256": validation.corpus_sha256,
    }
    assert validation.identity() == {
        "schema": VALIDATION_SCHEMA,
        "source": "holdout",
        "rows": 4,
        "supervised_tokens": sum(r.supervised_tokens for r in validation.rows),
        "corpus_sha256": validation.corpus_sha256,
        "interval_steps": 3,
    }
    for broken in (
        {**receipt, "rows_read": 13},
        {**receipt, "validation": {**part, "holdout_percent": 60}},
        {**receipt, "validation": {**part, "rows_read": 5}},
        {**receipt, "validation": {**part, "kept_corpus_sha256": receipt["kept_corpus_sha256"]}},
        {**receipt, "validation": {**part, "extra": 1}},
        {**receipt, "validation": {**part, "source": "named_dataset"}},
    ):
        with pytest.raises(KilnError):
            validate_ingestion_receipt(broken)


def test_without_validation_the_ingestion_is_returned_unchanged(qwen_tokenizer, ingestion):
    same, validation = prepare_validation(None, ingestion, tokenizer=qwen_tokenizer, seed=1)
    assert same is ingestion and validation is None
    assert "validation" not in ingestion.receipt


# ----- rows of their own --------------------------------------------------------------------------


def test_inline_validation_rows_are_ingested_like_training_rows(qwen_tokenizer, ingestion):
    spec = _spec(examples=[row(40), row(41)], interval_steps=2)
    train, validation = prepare_validation(spec, ingestion, tokenizer=qwen_tokenizer, seed=1)
    assert train.rows == ingestion.rows
    assert {k: v for k, v in train.receipt.items() if k != "validation"} == ingestion.receipt
    reference = ingest_examples([row(40), row(41)], tokenizer=qwen_tokenizer)
    assert [(r.input_ids, r.labels, r.row_sha256) for r in validation.rows] == [
        (r.input_ids, r.labels, r.row_sha256) for r in reference.rows
    ]
    part = train.receipt["validation"]
    assert part["source"] == "inline" and "source_locator" not in part and "holdout_percent" not in part
    assert part["rows_read"] == part["rows_kept"] == 2
    assert validation.interval_steps == 2


def test_validation_rows_may_be_any_row_format_and_obey_the_length_rule(qwen_tokenizer, ingestion, tmp_path):
    alpaca = {"instruction": "Question 40?", "output": "Answer 40."}
    spec = _spec(examples=[alpaca, row(41)])
    _, validation = prepare_validation(spec, ingestion, tokenizer=qwen_tokenizer, seed=1)
    (as_messages,) = ingest_examples([row(40)], tokenizer=qwen_tokenizer).rows
    assert (
        validation.rows[0].input_ids == as_messages.input_ids
        and validation.rows[0].labels == as_messages.labels
    )

    shortest = min(r.seq_len for r in validation.rows)
    with pytest.raises(KilnError) as info:
        prepare_validation(
            spec, ingestion, tokenizer=qwen_tokenizer, seed=1, limit=LengthRule.of(shortest - 1)
        )
    assert (
        "SFT validation row 1 (sha256:" in info.value.detail and "rejected as too_long" in info.value.detail
    )

    data = tmp_path / "valid.jsonl"
    data.write_text(
        "\n" + json.dumps(alpaca) + "\n\n" + json.dumps({"instruction": "x", "output": ""}) + "\n"
    )
    file_spec = _spec(dataset_path="valid.jsonl")
    with pytest.raises(KilnError) as info:
        prepare_validation(file_spec, ingestion, tokenizer=qwen_tokenizer, seed=1, datasets_root=tmp_path)
    assert info.value.detail.startswith("line 4: SFT validation row 2 (sha256:")
    assert "rejected as empty_output" in info.value.detail


def test_a_malformed_validation_example_is_named_by_its_field(qwen_tokenizer, ingestion):
    spec = _spec(examples=[row(40), {"messages": "no"}])
    with pytest.raises(KilnError) as info:
        prepare_validation(spec, ingestion, tokenizer=qwen_tokenizer, seed=1)
    assert info.value.detail.startswith("validation.examples[1]: ")


def test_a_rejected_validation_row_is_named_as_a_validation_row(qwen_tokenizer, ingestion):
    spec = _spec(examples=[row(40), NO_TARGET])
    with pytest.raises(KilnError) as info:
        prepare_validation(spec, ingestion, tokenizer=qwen_tokenizer, seed=1)
    assert info.value.detail.startswith("SFT validation row 2 (sha256:")
    assert "rejected as tokenization_error" in info.value.detail

    skipping = ingest_examples([row(0), row(1)], tokenizer=qwen_tokenizer, policy="skip")
    train, validation = prepare_validation(spec, skipping, tokenizer=qwen_tokenizer, policy="skip", seed=1)
    validate_ingestion_receipt(train.receipt)
    part = validation.part
    assert part["rows_read"] == 2 and part["rows_kept"] == 1 and part["rows_rejected"] == 1
    assert part["rejected_rows"][0]["row_index"] == 2


def test_validation_rows_all_rejected_are_refused(qwen_tokenizer, ingestion):
    spec = _spec(examples=[NO_TARGET, NO_TARGET])
    with pytest.raises(KilnError) as info:
        prepare_validation(spec, ingestion, tokenizer=qwen_tokenizer, policy="skip", seed=1)
    assert info.value.code == "training_invalid_request"
    assert info.value.detail.startswith(
        "validation corpus contains no usable rows: read 2 row(s), rejected 2"
    )


def test_a_validation_dataset_path_is_read_under_the_datasets_directory(qwen_tokenizer, ingestion, tmp_path):
    datasets = tmp_path / "datasets"
    datasets.mkdir()
    (datasets / "held-out.jsonl").write_text("".join(json.dumps(row(i)) + "\n\n" for i in (50, 51, 52)))
    (tmp_path / "outside.jsonl").write_text(json.dumps(row(1)) + "\n")
    spec = _spec(dataset_path="held-out.jsonl")
    train, validation = prepare_validation(
        spec, ingestion, tokenizer=qwen_tokenizer, seed=1, datasets_root=datasets
    )
    part = train.receipt["validation"]
    assert part["source"] == "dataset_path" and part["source_locator"] == "held-out.jsonl"
    reference = ingest_jsonl(datasets / "held-out.jsonl", tokenizer=qwen_tokenizer)
    assert [r.row_sha256 for r in validation.rows] == reference.receipt["kept_row_hashes"]
    for path, fragment in (
        ("missing.jsonl", "validation.dataset_path 'missing.jsonl' does not exist"),
        ("../outside.jsonl", "validation.dataset_path '../outside.jsonl' must not contain '..'"),
    ):
        with pytest.raises(KilnError) as info:
            prepare_validation(
                _spec(dataset_path=path), ingestion, tokenizer=qwen_tokenizer, seed=1, datasets_root=datasets
            )
        assert fragment in info.value.detail


def test_a_holdout_of_converted_rows_keeps_their_format_counts(qwen_tokenizer):
    rows = [{"instruction": f"Question {i}?", "output": f"Answer {i}."} for i in range(10)]
    converted = ingest_examples(rows, tokenizer=qwen_tokenizer)
    train, validation = prepare_validation(
        _spec(holdout_percent=20), converted, tokenizer=qwen_tokenizer, seed=3
    )
    validate_ingestion_receipt(train.receipt)
    assert (train.receipt["rows_kept"], validation.part["rows_kept"]) == (8, 2)
    # counted when the rows were kept, before the split: the format counts cover both sides
    assert train.receipt["row_counts"]["rows_per_format"] == {"instruction": 10}
