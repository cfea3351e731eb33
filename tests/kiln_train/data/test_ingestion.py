"""SFT ingestion: tokens and labels, rejection reasons, policies, JSONL parsing and dataset_path
containment (docs/ingestion.md)."""

from __future__ import annotations

import json
import os

import pytest

from kiln_train.data.conversation import parse_example
from kiln_train.data.ingestion import (
    ingest_examples,
    ingest_jsonl,
    iter_jsonl_outcomes,
    parsed_row_sha256,
    raw_row_sha256,
    resolve_dataset_path,
)
from kiln_train.data.labels import IGNORE_INDEX
from kiln_train.errors import KilnError
from tests.kiln_train.data.ingestion_support import (
    CORPUS_SHA,
    PLAIN,
    PLAIN_SHA,
    TOOL_ROW,
    TOOL_SHA,
    independent_digest,
    reject_message,
    write_jsonl,
)

# --------------------------------------------------------------------------- tokens and labels


def test_rows_are_tokenized_whole_with_assistant_only_labels(qwen_tokenizer):
    long_answer = " ".join(f"word{i}" for i in range(6000))
    rows = [
        TOOL_ROW,
        {"messages": [{"role": "user", "content": "Go"}, {"role": "assistant", "content": long_answer}]},
    ]
    result = ingest_examples(rows, tokenizer=qwen_tokenizer)
    for row in result.rows:
        supervised = [i for i, label in zip(row.input_ids, row.labels, strict=True) if label != IGNORE_INDEX]
        assert all(label in (IGNORE_INDEX, i) for i, label in zip(row.input_ids, row.labels, strict=True))
        assert row.supervised_tokens == sum(1 for label in row.labels[1:] if label != IGNORE_INDEX)
        assert len(supervised) == row.supervised_tokens
    tool = result.rows[0]
    text = qwen_tokenizer.decode(tool.input_ids, skip_special_tokens=False)
    assert qwen_tokenizer.encode(text, add_special_tokens=False).ids == tool.input_ids
    supervised_text = qwen_tokenizer.decode(
        [i for i, label in zip(tool.input_ids, tool.labels, strict=True) if label != IGNORE_INDEX],
        skip_special_tokens=False,
    )
    assert supervised_text == (
        "<think>\n\n</think>\n\n<tool_call>\n<function=w>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<think>\nok\n</think>\n\n21°C.<|im_end|>\n"
    )
    long_row = result.rows[1]
    assert long_row.seq_len > 12000  # no truncation
    assert result.max_seq_len == long_row.seq_len
    assert result.max_supervised_tokens == long_row.supervised_tokens
    assert result.total_tokens == tool.seq_len + long_row.seq_len
    assert result.total_supervised_tokens == tool.supervised_tokens + long_row.supervised_tokens


# --------------------------------------------------------------------------- rejection reasons


def _reject(qwen_tokenizer, tmp_path, line: str):
    path = tmp_path / "one.jsonl"
    write_jsonl(path, [line])
    (outcome,) = list(iter_jsonl_outcomes(path, tokenizer=qwen_tokenizer))
    return outcome


@pytest.mark.parametrize(
    ("line", "reason", "detail"),
    [
        ('{"messages": [', "invalid_json", "not valid JSON"),
        ("[1, 2]", "invalid_json", "example: expected an object"),
        ('{"messages": "hi"}', "invalid_json", "messages: expected an array"),
        ('{"messages": [{"role": 3, "content": "x"}]}', "invalid_json", "messages[0].role"),
        ('{"messages": [{"role": "user", "content": 5}]}', "invalid_json", "messages[0].content"),
        ('{"messages": [{"role": "user", "content": "x", "weight": NaN}]}', "invalid_json", "NaN"),
        (
            '{"messages": [{"role": "assistant", "tool_calls": [{"function": 1}]}]}',
            "invalid_json",
            "function",
        ),
        ('{"messages": []}', "empty_messages", "messages is missing or empty"),
        ('{"conversation": []}', "empty_messages", "messages is missing or empty"),
        (
            '{"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}',
            "invalid_role",
            "'bot'",
        ),
        (
            '{"messages": [{"role": "assistant", "content": "A"}]}',
            "tokenization_error",
            "No user query found",
        ),
        (
            '{"messages": [{"role": "user", "content": "Q"}, {"role": "system", "content": "S"}]}',
            "tokenization_error",
            "System message must be at the beginning",
        ),
        (
            '{"messages": [{"role": "user", "content": "Q"}]}',
            "tokenization_error",
            "no supervised assistant token",
        ),
        (
            '{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": '
            '[{"function": {"name": "f", "arguments": "{not json"}}]}]}',
            "tokenization_error",
            "messages[1].tool_calls[0].function.arguments is not valid JSON",
        ),
        (
            '{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": '
            '[{"function": {"name": "f", "arguments": "[1]"}}]}]}',
            "tokenization_error",
            "must encode a JSON object",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, '
            '{"role": "assistant", "content": "A"}]}',
            "tokenization_error",
            "image/video part",
        ),
        (
            '{"messages": [{"role": "user", "content": "Q\\ufdd0"}, {"role": "assistant", "content": "A"}]}',
            "tokenization_error",
            "internal span marker",
        ),
    ],
)
def test_each_rejection_reason(qwen_tokenizer, tmp_path, line, reason, detail):
    outcome = _reject(qwen_tokenizer, tmp_path, line)
    assert outcome.reason == reason
    assert detail in outcome.detail
    if reason == "invalid_json":
        assert outcome.row_sha256 == raw_row_sha256(line.encode())
    else:
        assert outcome.row_sha256 == parsed_row_sha256(parse_example(json.loads(line)))


def test_invalid_utf8_line_is_invalid_json(qwen_tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"messages": "\xff"}\n')
    (outcome,) = list(iter_jsonl_outcomes(path, tokenizer=qwen_tokenizer))
    assert outcome.reason == "invalid_json"
    assert outcome.row_sha256 == raw_row_sha256(b'{"messages": "\xff"}')


def test_structured_text_parts_are_joined(qwen_tokenizer):
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
            {"role": "assistant", "content": "Hi"},
        ]
    }
    joined = ingest_examples([row], tokenizer=qwen_tokenizer).rows[0]
    plain = ingest_examples(
        [{"messages": [{"role": "user", "content": "Hello"}, row["messages"][1]]}], tokenizer=qwen_tokenizer
    )
    assert joined.input_ids == plain.rows[0].input_ids
    assert joined.row_sha256 != plain.rows[0].row_sha256  # identity is the parsed row, parts included


# --------------------------------------------------------------------------- policies and JSONL parsing


def test_jsonl_blank_lines_crlf_and_fail_policy_message(qwen_tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(
        b"\n  \t\r\n"
        + json.dumps(PLAIN).encode()
        + b"\r\n\n\x0c\n"
        + b'  {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}  \n'
        + json.dumps(TOOL_ROW, ensure_ascii=False).encode()
    )
    with pytest.raises(KilnError) as err:
        ingest_jsonl(path, tokenizer=qwen_tokenizer)
    bad_sha = parsed_row_sha256(
        parse_example(
            json.loads('{"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}')
        )
    )
    # Line 6: two blank lines, the first row (line 3), two more blank lines, then the bad row.
    assert f"line 6: SFT row 2 ({bad_sha}) rejected as invalid_role: messages[1].role is 'bot'" in (
        reject_message(err.value)
    )

    result = ingest_jsonl(path, tokenizer=qwen_tokenizer, policy="skip", source_locator="data.jsonl")
    assert result.receipt == {
        "schema": "kiln.sft-ingestion.v1",
        "source": "dataset_path",
        "source_locator": "data.jsonl",
        "invalid_row_policy": "skip",
        "rows_read": 3,
        "rows_kept": 2,
        "rows_rejected": 1,
        "kept_row_hashes": [PLAIN_SHA, TOOL_SHA],
        "rejected_rows": [{"row_index": 2, "row_sha256": bad_sha, "reason": "invalid_role", "line": 6}],
        "kept_corpus_sha256": CORPUS_SHA,
        "row_counts": {
            "blank_lines": 4,
            "rows_per_format": {"messages": 2},
            "rows_skipped": 1,
            "rows_truncated": 0,
            "tokens_dropped": 0,
        },
    }
    assert [r.row_index for r in result.rows] == [1, 3]


def test_skip_policy_with_nothing_left_names_counts(qwen_tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, ["{", '{"messages": []}'])
    with pytest.raises(KilnError) as err:
        ingest_jsonl(path, tokenizer=qwen_tokenizer, policy="skip")
    assert "no trainable rows: read 2 row(s), rejected 2" in reject_message(err.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n \n")
    with pytest.raises(KilnError) as err:
        ingest_jsonl(empty, tokenizer=qwen_tokenizer, policy="skip")
    assert "read 0 row(s)" in reject_message(err.value)


def test_first_bad_row_fails_even_after_a_later_template_error(qwen_tokenizer):
    rows = [
        PLAIN,
        {"messages": [{"role": "user", "content": "Q"}]},
        {"messages": [{"role": "assistant", "content": "A"}]},
    ]
    with pytest.raises(KilnError) as err:
        ingest_examples(rows, tokenizer=qwen_tokenizer)
    assert "SFT row 2 (" in err.value.message
    assert "no supervised assistant token" in err.value.message


def test_inline_schema_errors_are_transport_errors_under_any_policy(qwen_tokenizer):
    for policy in ("fail", "skip"):
        with pytest.raises(KilnError) as err:
            ingest_examples(
                [PLAIN, {"messages": [{"role": "user", "content": 1}]}],
                tokenizer=qwen_tokenizer,
                policy=policy,
            )
        assert "examples[1]: messages[0].content" in reject_message(err.value)
    # but empty messages and bad roles are ordinary, skippable rows
    result = ingest_examples([{"messages": []}, PLAIN], tokenizer=qwen_tokenizer, policy="skip")
    assert result.receipt["rejected_rows"][0]["reason"] == "empty_messages"
    assert result.receipt["rejected_rows"][0]["row_sha256"] == independent_digest(
        b"kiln.sft-parsed-row.v1", b'{"messages":[]}'
    )


def test_unknown_policy_is_refused(qwen_tokenizer):
    with pytest.raises(KilnError):
        ingest_examples([PLAIN], tokenizer=qwen_tokenizer, policy="drop")


# --------------------------------------------------------------------------- dataset_path containment


@pytest.fixture()
def datasets(tmp_path):
    root = tmp_path / "storage" / "datasets"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.jsonl").write_text("{}\n")
    outside = tmp_path / "secret.jsonl"
    outside.write_text("{}\n")
    os.symlink(outside, root / "escape.jsonl")
    os.symlink(root / "sub" / "a.jsonl", root / "inside.jsonl")
    os.symlink(tmp_path, root / "up")
    return root


def test_dataset_path_resolution(datasets):
    target = (datasets / "sub" / "a.jsonl").resolve()
    assert resolve_dataset_path("sub/a.jsonl", datasets) == target
    assert resolve_dataset_path(str(datasets / "sub" / "a.jsonl"), datasets) == target
    assert resolve_dataset_path("inside.jsonl", datasets) == target


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("", "blank"),
        ("   ", "blank"),
        ("../secret.jsonl", "'..'"),
        ("sub/../../secret.jsonl", "'..'"),
        ("/etc/passwd", "outside"),
        ("escape.jsonl", "resolves outside"),
        ("up/secret.jsonl", "resolves outside"),
        ("missing.jsonl", "does not exist"),
        ("sub", "not a regular file"),
        ("a\0b", "NUL"),
    ],
)
def test_dataset_path_escapes_are_refused(datasets, path, why):
    with pytest.raises(KilnError) as err:
        resolve_dataset_path(path, datasets)
    assert why in reject_message(err.value)


def test_inline_body_is_validated_before_any_row_is_judged(qwen_tokenizer):
    rows = [
        PLAIN,
        {"messages": [{"role": "bot", "content": "x"}]},
        {"messages": [{"role": "user", "content": []}]},
    ]
    rows.append({"messages": "not a list"})
    with pytest.raises(KilnError) as err:
        ingest_examples(rows, tokenizer=qwen_tokenizer)
    assert "examples[3]: messages: expected an array" in reject_message(err.value)


@pytest.mark.parametrize(
    "example",
    [
        {"messages": [{"role": "user", "content": "\ud800"}, {"role": "assistant", "content": "A"}]},
        {
            "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
            "tools": [{"x": float("nan")}],
        },
    ],
)
def test_unhashable_inline_values_are_transport_errors(qwen_tokenizer, example):
    with pytest.raises(KilnError) as err:
        ingest_examples([example], tokenizer=qwen_tokenizer, policy="skip")
    assert "examples[0]: example: not representable as JSON" in reject_message(err.value)


def test_lone_surrogate_in_jsonl_is_invalid_json(qwen_tokenizer, tmp_path):
    line = '{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "A"}]}'
    outcome = _reject(qwen_tokenizer, tmp_path, line)
    assert outcome.reason == "invalid_json"
    assert outcome.row_sha256 == raw_row_sha256(line.encode())


def test_unreadable_dataset_is_a_clear_error(qwen_tokenizer, tmp_path):
    with pytest.raises(KilnError) as err:
        ingest_jsonl(tmp_path / "gone.jsonl", tokenizer=qwen_tokenizer, source_locator="gone.jsonl")
    assert "cannot read dataset 'gone.jsonl'" in reject_message(err.value)
