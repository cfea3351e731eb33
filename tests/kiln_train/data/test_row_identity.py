"""Row identity of conversations holding numbers: the parsed-row hash is over serde_json's
compact encoding (kiln-contract §3.4), so f64 numbers are written as serde_json (ryu) writes them."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest

from kiln_train.data.conversation import parse_example
from kiln_train.data.ingestion import ingest_examples, iter_jsonl_outcomes, kept_corpus_sha256
from kiln_train.data.row_identity import parsed_row_sha256, raw_row_sha256, serde_canonical_json, serde_f64
from tests.kiln_train.data.ingestion_support import (
    CORPUS_SHA,
    PLAIN,
    PLAIN_CANONICAL,
    PLAIN_SHA,
    RAW_SHA,
    TOOL_CANONICAL,
    TOOL_ROW,
    TOOL_SHA,
    independent_corpus,
    independent_digest,
)

# (Python float, what serde_json / ryu::Buffer::format_finite prints)
RYU = [
    (1.5, "1.5"),
    (100.0, "100.0"),
    (3.0, "3.0"),
    (0.1, "0.1"),
    (-0.25, "-0.25"),
    (0.0, "0.0"),
    (-0.0, "-0.0"),
    (123456.789, "123456.789"),
    (0.0001, "0.0001"),
    (1e-5, "0.00001"),  # Python: 1e-05
    (1.234e-5, "0.00001234"),  # Python: 1.234e-05
    (1e-7, "1e-7"),  # Python: 1e-07
    (1.5e-7, "1.5e-7"),
    (1e15, "1000000000000000.0"),
    (1e16, "1e16"),  # Python: 1e+16
    (12345678901234567.0, "1.2345678901234568e16"),
    (2.5e20, "2.5e20"),
    (1.7976931348623157e308, "1.7976931348623157e308"),
    (5e-324, "5e-324"),
]


@pytest.mark.parametrize(("value", "text"), RYU)
def test_f64_is_written_as_serde_json_writes_it(value, text):
    assert serde_f64(value) == text
    assert float(text) == value


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_are_not_json(value):
    with pytest.raises(ValueError):
        serde_f64(value)


def _digest(canonical: str) -> str:
    return "sha256:" + hashlib.sha256(b"kiln.sft-parsed-row.v1\x00" + canonical.encode("utf-8")).hexdigest()


def test_tool_schemas_with_floats_hash_serde_json_s_encoding():
    line = (
        '{"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
        '"properties": {"x": {"type": "number", "minimum": 1e-05, "maximum": 1E16, "multipleOf": 0.5, '
        '"default": 100.0, "examples": [18446744073709551616, 18446744073709551615, -9223372036854775808]}}}}}], '
        '"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}'
    )
    parsed = parse_example(json.loads(line))
    expected = (
        '{"messages":[{"content":"Q","role":"user"},{"content":"A","role":"assistant"}],'
        '"tools":[{"function":{"name":"f","parameters":{"properties":{"x":{"default":100.0,'
        '"examples":[1.8446744073709552e19,18446744073709551615,-9223372036854775808],'
        '"maximum":1e16,"minimum":0.00001,"multipleOf":0.5,"type":"number"}},"type":"object"}},'
        '"type":"function"}]}'
    )
    assert serde_canonical_json(parsed) == expected
    assert parsed_row_sha256(parsed) == _digest(expected)


def test_rows_without_f64_numbers_keep_the_plain_encoding():
    row = {
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"maxItems": 3, "flag": True}}}
        ],
        "messages": [{"role": "user", "content": 'é "q"\n\x01'}, {"role": "assistant", "content": "A"}],
    }
    parsed = parse_example(row)
    plain = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert serde_canonical_json(parsed) == plain
    assert '"é \\"q\\"\\n\\u0001"' in plain


def test_serde_path_escapes_strings_and_sorts_keys_like_the_plain_path():
    value = {"b": [1.5, {"z": "\x1f\u2028é", "a": None}], "a": False, "ä": "\\"}
    plain = json.dumps(
        {"b": [1.5, {"z": "\x1f\u2028é", "a": None}], "a": False, "ä": "\\"},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    assert serde_canonical_json(value) == plain  # 1.5 prints the same either way


def test_an_integer_too_large_for_f64_is_invalid_json(qwen_tokenizer, tmp_path):
    raw = (
        '{"tools": [{"x": 1' + "0" * 400 + '}], "messages": [{"role": "user", "content": "Q"}, '
        '{"role": "assistant", "content": "A"}]}'
    ).encode()
    path = tmp_path / "big.jsonl"
    path.write_bytes(raw + b"\n")
    (outcome,) = list(iter_jsonl_outcomes(path, tokenizer=qwen_tokenizer))
    assert outcome.reason == "invalid_json"
    assert "number out of range" in outcome.detail
    assert outcome.row_sha256 == raw_row_sha256(raw)


# ----- golden digests of a plain and a tool-calling row -------------------------------------------


def test_golden_hashes_literal_and_independent():
    assert independent_digest(b"kiln.sft-parsed-row.v1", PLAIN_CANONICAL.encode()) == PLAIN_SHA
    assert independent_digest(b"kiln.sft-parsed-row.v1", TOOL_CANONICAL.encode()) == TOOL_SHA
    assert independent_digest(b"kiln.sft-raw-row.v1", b'{"messages": [') == RAW_SHA
    assert independent_corpus([PLAIN_SHA, TOOL_SHA]) == CORPUS_SHA

    assert parsed_row_sha256(parse_example(PLAIN)) == PLAIN_SHA
    assert parsed_row_sha256(parse_example(TOOL_ROW)) == TOOL_SHA
    assert raw_row_sha256(b'{"messages": [') == RAW_SHA
    assert kept_corpus_sha256([PLAIN_SHA, TOOL_SHA]) == CORPUS_SHA
    assert kept_corpus_sha256([TOOL_SHA, PLAIN_SHA]) != CORPUS_SHA  # order is identity


def test_ingestion_uses_golden_hashes(qwen_tokenizer):
    result = ingest_examples([PLAIN, TOOL_ROW], tokenizer=qwen_tokenizer)
    assert result.receipt == {
        "schema": "kiln.sft-ingestion.v1",
        "source": "inline",
        "invalid_row_policy": "fail",
        "rows_read": 2,
        "rows_kept": 2,
        "rows_rejected": 0,
        "kept_row_hashes": [PLAIN_SHA, TOOL_SHA],
        "rejected_rows": [],
        "kept_corpus_sha256": CORPUS_SHA,
    }
    assert [r.row_sha256 for r in result.rows] == [PLAIN_SHA, TOOL_SHA]


def test_hash_ignores_key_order_whitespace_and_unknown_keys_but_not_arguments_text():
    reordered = json.loads(json.dumps(TOOL_ROW, indent=3, sort_keys=True))
    reordered["extra"] = {"anything": 1}
    reordered["messages"][0]["weight"] = 0.5  # unknown message key: ignored
    assert parsed_row_sha256(parse_example(reordered)) == TOOL_SHA
    # null content, missing content and "" are one normalised value
    missing = copy.deepcopy(TOOL_ROW)
    del missing["messages"][1]["content"]
    assert parsed_row_sha256(parse_example(missing)) == TOOL_SHA
    # the arguments JSON string is hashed as written
    spaced = copy.deepcopy(TOOL_ROW)
    spaced["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"city":"Paris"}'
    assert parsed_row_sha256(parse_example(spaced)) != TOOL_SHA
    # reasoning aliases normalise to reasoning_content
    alias = copy.deepcopy(TOOL_ROW)
    alias["messages"][3]["thinking"] = alias["messages"][3].pop("reasoning_content")
    assert parsed_row_sha256(parse_example(alias)) == TOOL_SHA


def test_duplicates_are_kept_as_separate_rows(qwen_tokenizer):
    result = ingest_examples([PLAIN, PLAIN, TOOL_ROW], tokenizer=qwen_tokenizer)
    assert result.receipt["kept_row_hashes"] == [PLAIN_SHA, PLAIN_SHA, TOOL_SHA]
    assert [r.row_index for r in result.rows] == [1, 2, 3]
