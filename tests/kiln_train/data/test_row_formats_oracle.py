"""Kiln's row formats against the Transformers + TRL oracle (qualification/sft_row_formats_oracle.py,
fixture qualification/fixtures/qwen35_row_formats_v1.json), without importing TRL."""

from __future__ import annotations

import pytest

from kiln_train.data.ingestion import iter_example_outcomes
from kiln_train.data.labels import IGNORE_INDEX
from tests.kiln_train.data.reference_fixtures import labels_from, load_fixture


@pytest.fixture(scope="module")
def fixture() -> dict:
    return load_fixture("qwen35_row_formats_v1.json")


@pytest.fixture(scope="module")
def outcomes(qwen_tokenizer, fixture) -> dict:
    rows = [c["row"] for c in fixture["cases"]]
    found = list(iter_example_outcomes(rows, tokenizer=qwen_tokenizer))
    return {c["name"]: o for c, o in zip(fixture["cases"], found, strict=True)}


def test_the_fixture_covers_every_converted_format(fixture):
    assert fixture["schema"] == "kiln.qwen35-sft-row-formats-oracle.v1"
    assert fixture["template"] == "qwen3_5_think_training.jinja" and fixture["eos_token"] == "<|im_end|>"
    formats = [c["format"] for c in fixture["cases"]]
    for name in ("instruction", "prompt_completion", "text_prompt_completion"):
        assert formats.count(name) >= 5, name
    assert any(
        not c["boundary_on_token"] for c in fixture["cases"] if c["format"] == "text_prompt_completion"
    )


def test_template_formats_equal_the_oracle(fixture, outcomes):
    for case in fixture["cases"]:
        if case["format"] == "text_prompt_completion":
            continue
        outcome = outcomes[case["name"]]
        assert outcome.kept and outcome.format == case["format"], (case["name"], outcome.detail)
        assert outcome.rendered.text == case["text"], case["name"]
        assert outcome.tokenized.input_ids == case["input_ids"], case["name"]
        assert outcome.tokenized.labels == labels_from(case["input_ids"], case["supervised_ranges"]), case[
            "name"
        ]


def test_trl_prompt_completion_differs_only_by_the_opening_think_tokens(qwen_tokenizer, fixture):
    """TRL counts the generation prompt's `<think>` (and its newline) as prompt; Kiln supervises the
    whole first completion turn, as in a `messages` row. Everything else is the same."""
    for case in fixture["cases"]:
        if case["format"] != "prompt_completion":
            continue
        trl = case["trl"]
        assert trl["input_ids_equal"], case["name"]
        ours, theirs = case["supervised_ranges"], trl["supervised_ranges"]
        assert ours[1:] == theirs[1:] and ours[0][1] == theirs[0][1], case["name"]
        skipped = case["input_ids"][ours[0][0] : theirs[0][0]]
        assert qwen_tokenizer.decode(skipped, skip_special_tokens=False).startswith("<think>"), (
            case["name"],
            skipped,
        )
        assert 1 <= len(skipped) <= 2, case["name"]


def test_plain_text_rows_equal_trl_where_the_boundary_is_a_token_boundary(fixture, outcomes):
    for case in fixture["cases"]:
        if case["format"] != "text_prompt_completion":
            continue
        outcome = outcomes[case["name"]]
        assert outcome.kept and outcome.format == "text_prompt_completion", (case["name"], outcome.detail)
        assert outcome.rendered.text == case["text"], case["name"]
        assert outcome.tokenized.input_ids == case["input_ids"], case["name"]
        trl_labels = labels_from(case["input_ids"], case["trl_supervised_ranges"])
        if case["boundary_on_token"]:
            assert outcome.tokenized.labels == trl_labels, case["name"]
            continue
        # A token straddling the boundary: TRL supervises it, Kiln does not; nothing else differs.
        k = case["straddling_token"]
        assert trl_labels[k] != IGNORE_INDEX and outcome.tokenized.labels[k] == IGNORE_INDEX, case["name"]
        assert outcome.tokenized.labels[:k] == trl_labels[:k], case["name"]
        assert outcome.tokenized.labels[k + 1 :] == trl_labels[k + 1 :], case["name"]
