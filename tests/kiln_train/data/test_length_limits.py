"""`config.max_length` and `config.truncation` (docs/ingestion.md#length-limits): a row exactly at
the limit is untouched; one token over is `too_long` under "error" or cut under "right", which
must leave a supervised target after position 0 (`answer_truncated` otherwise)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kiln_train.data.ingestion import LengthRule, ingest_examples, ingest_jsonl, iter_example_outcomes
from kiln_train.data.labels import IGNORE_INDEX
from kiln_train.errors import KilnError
from kiln_train.sft_config import SftConfig
from tests.kiln_train.data.ingestion_support import reject_message

SHORT = {
    "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend."}]
}
LONG_PROMPT = {"instruction": "word " * 200, "output": "ok"}


def tokens(tokenizer, row) -> list[int]:
    (outcome,) = list(iter_example_outcomes([row], tokenizer=tokenizer))
    return outcome.tokenized


def test_a_row_at_the_limit_is_untouched_and_one_over_is_too_long(qwen_tokenizer, tmp_path):
    n = tokens(qwen_tokenizer, SHORT).seq_len
    at = ingest_examples([SHORT], tokenizer=qwen_tokenizer, limit=LengthRule.of(n))
    assert at.rows[0].seq_len == n and "row_counts" not in at.receipt  # nothing truncated, all messages

    path = tmp_path / "rows.jsonl"
    path.write_text("\n" + json.dumps(SHORT) + "\n")
    with pytest.raises(KilnError) as err:
        ingest_jsonl(path, tokenizer=qwen_tokenizer, limit=LengthRule.of(n - 1))
    message = reject_message(err.value)
    assert "line 2: SFT row 1 (" in message and "rejected as too_long" in message
    assert f"the row is {n} tokens; config.max_length is {n - 1}" in message
    with pytest.raises(KilnError, match="no trainable rows"):  # skip, and nothing is left
        ingest_jsonl(path, tokenizer=qwen_tokenizer, limit=LengthRule.of(n - 1), policy="skip")


def test_too_long_under_skip_is_skipped_with_its_hash(qwen_tokenizer):
    n = tokens(qwen_tokenizer, SHORT).seq_len
    other = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    result = ingest_examples(
        [SHORT, other], tokenizer=qwen_tokenizer, limit=LengthRule.of(n - 1), policy="skip"
    )
    (entry,) = result.receipt["rejected_rows"]
    assert (entry["row_index"], entry["reason"]) == (1, "too_long")
    assert entry["row_sha256"] == tokens(qwen_tokenizer, SHORT).row_sha256
    assert result.max_seq_len == tokens(qwen_tokenizer, other).seq_len  # admission prices what is left


def test_right_truncation_cuts_and_counts(qwen_tokenizer):
    full = tokens(qwen_tokenizer, SHORT)
    n = full.seq_len
    result = ingest_examples([SHORT], tokenizer=qwen_tokenizer, limit=LengthRule.of(n - 3, "right"))
    (row,) = result.rows
    assert row.input_ids == full.input_ids[: n - 3] and row.labels == full.labels[: n - 3]
    assert row.supervised_tokens == sum(1 for label in row.labels[1:] if label != IGNORE_INDEX)
    assert row.supervised_tokens == full.supervised_tokens - 3
    assert result.max_seq_len == n - 3  # admission and the memory plan see the cut length
    assert result.receipt["row_counts"] == {
        "blank_lines": 0,
        "rows_per_format": {"messages": 1},
        "rows_skipped": 0,
        "rows_truncated": 1,
        "tokens_dropped": 3,
    }
    assert row.row_sha256 == full.row_sha256  # identity is the row, not its cut


def test_right_truncation_that_removes_the_answer_is_answer_truncated(qwen_tokenizer):
    full = tokens(qwen_tokenizer, LONG_PROMPT)
    first_target = next(i for i, label in enumerate(full.labels) if label != IGNORE_INDEX)
    keep = first_target  # everything up to, not including, the first supervised token
    (outcome,) = list(
        iter_example_outcomes([LONG_PROMPT], tokenizer=qwen_tokenizer, limit=LengthRule.of(keep, "right"))
    )
    assert (outcome.kept, outcome.reason) == (False, "answer_truncated")
    assert f"cut to config.max_length {keep} of {full.seq_len} tokens" in outcome.detail
    (kept,) = list(
        iter_example_outcomes([LONG_PROMPT], tokenizer=qwen_tokenizer, limit=LengthRule.of(keep + 1, "right"))
    )
    assert (
        kept.kept and kept.tokenized.supervised_tokens == 1 and kept.dropped_tokens == full.seq_len - keep - 1
    )


def test_config_fields_and_their_rules():
    assert SftConfig().max_length is None and SftConfig().truncation == "error"
    assert SftConfig(max_length=2, truncation="right").to_json()["max_length"] == 2
    with pytest.raises(ValidationError, match="requires max_length"):
        SftConfig(truncation="right")
    with pytest.raises(ValidationError, match="greater than or equal to 2"):
        SftConfig(max_length=1)
    with pytest.raises(ValidationError):
        SftConfig(truncation="left", max_length=8)
    assert LengthRule.of_config(SftConfig()) is None
    assert LengthRule.of_config(SftConfig(max_length=64)) == LengthRule(64, "error")
