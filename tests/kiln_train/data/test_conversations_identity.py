"""Row identity of conversations holding numbers: the parsed-row hash is over serde_json's
compact encoding (kiln-contract §3.4), so f64 numbers are written as serde_json (ryu) writes them."""

from __future__ import annotations

import hashlib
import json

import pytest

from kiln_train.data.conversation import parse_example
from kiln_train.data.ingestion import iter_jsonl_outcomes
from kiln_train.data.row_identity import parsed_row_sha256, raw_row_sha256, serde_canonical_json, serde_f64

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
