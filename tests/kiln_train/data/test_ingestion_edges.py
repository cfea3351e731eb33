"""Edge inputs through SFT ingestion: every one gets a contract rejection reason and its 1-based row
number (fail policy) or is skipped and recorded (skip policy) -- never a traceback, never a silent
mis-render, never a truncated row (docs/ingestion.md#validation, docs/ingestion.md#invalid-row-policy,
docs/tokenization.md#no-truncation)."""

from __future__ import annotations

import json

import pytest

from kiln_train.data.conversation import MAX_JSON_DEPTH, decode_json, json_depth, parse_example
from kiln_train.data.ingestion import ingest_examples, ingest_jsonl, iter_jsonl_outcomes
from kiln_train.data.labels import IGNORE_INDEX
from kiln_train.data.row_identity import parsed_row_sha256, raw_row_sha256
from kiln_train.data.tokenizer import load_tokenizer
from kiln_train.errors import TRAINING_INVALID_REQUEST, KilnError

U = {"role": "user", "content": "Q"}
A = {"role": "assistant", "content": "A"}
GOOD = {"messages": [U, A]}


def call(name="f", arguments='{"x": 1}'):
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


def asst_calls(*calls):
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


TOOL = {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "r"}


def line(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def nested(depth: int) -> str:
    """A JSON text of `depth` nested arrays."""
    return "[" * depth + "]" * depth


# (name, JSONL line, reason, detail fragment)
EDGES = [
    ("messages_object", line({"messages": {"role": "user"}}), "invalid_json", "messages: expected an array"),
    (
        "message_string",
        line({"messages": ["hi", A]}),
        "invalid_json",
        "messages[0]: expected a message object",
    ),
    ("missing_role", line({"messages": [{"content": "x"}, A]}), "invalid_json", "messages[0].role"),
    (
        "unknown_role",
        line({"messages": [{"role": "developer", "content": "x"}, A]}),
        "invalid_role",
        "'developer'",
    ),
    (
        "content_number",
        line({"messages": [U, {"role": "assistant", "content": 5}]}),
        "invalid_json",
        "content",
    ),
    (
        "content_object",
        line({"messages": [U, {"role": "assistant", "content": {"text": "x"}}]}),
        "invalid_json",
        "messages[1].content",
    ),
    (
        "image_url_part",
        line(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}, A]}
        ),
        "tokenization_error",
        "image/video part",
    ),
    (
        "audio_part",
        line({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, A]}),
        "tokenization_error",
        "only text parts are rendered",
    ),
    (
        "tool_calls_object",
        line({"messages": [U, {"role": "assistant", "tool_calls": {"function": {"name": "f"}}}]}),
        "invalid_json",
        "messages[1].tool_calls: expected an array",
    ),
    (
        "function_name_missing",
        line({"messages": [U, asst_calls({"function": {"arguments": "{}"}})]}),
        "invalid_json",
        "messages[1].tool_calls[0].function.name",
    ),
    (
        "function_name_empty",
        line({"messages": [U, asst_calls(call(name=""))]}),
        "tokenization_error",
        "messages[1].tool_calls[0].function.name is empty",
    ),
    (
        "arguments_invalid_json",
        line({"messages": [U, asst_calls(call(arguments="{x"))]}),
        "tokenization_error",
        "function.arguments is not valid JSON",
    ),
    (
        "arguments_empty_string",
        line({"messages": [U, asst_calls(call(arguments=""))]}),
        "tokenization_error",
        "function.arguments is not valid JSON",
    ),
    (
        "arguments_not_object",
        line({"messages": [U, asst_calls(call(arguments='"text"'))]}),
        "tokenization_error",
        "must encode a JSON object, got string",
    ),
    (
        "arguments_duplicate_key",
        line({"messages": [U, asst_calls(call(arguments='{"a": 1, "a": 2}'))]}),
        "tokenization_error",
        "duplicate object key 'a'",
    ),
    (
        "arguments_too_deep",
        line({"messages": [U, asst_calls(call(arguments='{"a": ' + nested(5000) + "}"))]}),
        "tokenization_error",
        f"nested deeper than {MAX_JSON_DEPTH}",
    ),
    (
        "tool_first",
        line({"messages": [TOOL, U, A]}),
        "tokenization_error",
        "messages[0] is a tool result at the start",
    ),
    (
        "tool_after_system",
        line({"messages": [{"role": "system", "content": "S"}, TOOL, U, A]}),
        "tokenization_error",
        "messages[1] is a tool result after a system message",
    ),
    (
        "tool_after_user",
        line({"messages": [U, TOOL, A]}),
        "tokenization_error",
        "messages[1] is a tool result after a user message",
    ),
    (
        "tool_after_assistant_without_calls",
        line({"messages": [U, A, TOOL, A]}),
        "tokenization_error",
        "messages[2] is a tool result after an assistant message without tool calls",
    ),
    (
        "tool_after_empty_tool_calls",
        line({"messages": [U, {"role": "assistant", "content": "A", "tool_calls": []}, TOOL, A]}),
        "tokenization_error",
        "after an assistant message without tool calls",
    ),
    (
        "legacy_function_call",
        line(
            {
                "messages": [
                    U,
                    {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
                ]
            }
        ),
        "tokenization_error",
        "messages[1].function_call is set, but the Qwen template does not render it",
    ),
    (
        "refusal",
        line({"messages": [U, {"role": "assistant", "content": None, "refusal": "I can't help with that."}]}),
        "tokenization_error",
        "messages[1].refusal is set",
    ),
    ("only_user", line({"messages": [U]}), "tokenization_error", "no supervised assistant token"),
    (
        "only_system",
        line({"messages": [{"role": "system", "content": "S"}]}),
        "tokenization_error",
        "No user query",
    ),
    (
        "row_array",
        b'[{"role": "user", "content": "Q"}]',
        "invalid_json",
        "example: expected an object, got array",
    ),
    ("row_string", b'"hello"', "invalid_json", "example: expected an object, got string"),
    ("row_null", b"null", "invalid_json", "example: expected an object, got null"),
    (
        "duplicate_messages",
        b'{"messages": [], "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}',
        "invalid_json",
        "duplicate object key 'messages'",
    ),
    (
        "duplicate_role",
        b'{"messages": [{"role": "user", "content": "Q"}, {"role": "user", "role": "assistant", "content": "A"}]}',
        "invalid_json",
        "duplicate object key 'role'",
    ),
    (
        "too_deep_for_python",
        b'{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "x": '
        + nested(100_000).encode()
        + b"}",
        "invalid_json",
        f"nested deeper than {MAX_JSON_DEPTH}",
    ),
    (
        "too_deep_for_serde",
        b'{"tools": [' + b'{"a": ' * 126 + b"1" + b"}" * 126 + b'], "messages": []}',
        "invalid_json",
        f"nested deeper than {MAX_JSON_DEPTH}",
    ),
    (
        "utf8_bom",
        b"\xef\xbb\xbf" + line(GOOD),
        "invalid_json",
        "starts with a UTF-8 byte-order mark",
    ),
    ("invalid_utf8", b'{"messages": "\xff\xfe"}', "invalid_json", "invalid UTF-8 byte 0xff at byte 14"),
    ("nan", b'{"messages": [], "w": NaN}', "invalid_json", "NaN is not a JSON value"),
]


@pytest.mark.parametrize(("name", "raw", "reason", "detail"), EDGES, ids=[e[0] for e in EDGES])
def test_edge_row_reason_and_row_number_under_both_policies(
    qwen_tokenizer, tmp_path, name, raw, reason, detail
):
    path = tmp_path / f"{name}.jsonl"
    # row 1 and row 3 are good; the edge row is row 2, after a blank line (blank lines are not rows)
    path.write_bytes(line(GOOD) + b"\n\n" + raw + b"\n" + line(GOOD))
    outcomes = list(iter_jsonl_outcomes(path, tokenizer=qwen_tokenizer))
    assert [o.row_index for o in outcomes] == [1, 2, 3]
    bad = outcomes[1]
    assert (bad.kept, bad.reason) == (False, reason), bad.detail
    assert detail in bad.detail
    if reason == "invalid_json":
        assert bad.row_sha256 == raw_row_sha256(raw)
    else:
        assert bad.row_sha256 == parsed_row_sha256(parse_example(json.loads(raw)))

    with pytest.raises(KilnError) as err:
        ingest_jsonl(path, tokenizer=qwen_tokenizer)
    assert err.value.code == TRAINING_INVALID_REQUEST
    assert f"line 3: SFT row 2 ({bad.row_sha256}) rejected as {reason}: " in err.value.message
    assert detail in err.value.message

    result = ingest_jsonl(path, tokenizer=qwen_tokenizer, policy="skip")
    receipt = result.receipt
    assert (receipt["rows_read"], receipt["rows_kept"], receipt["rows_rejected"]) == (3, 2, 1)
    assert receipt["rejected_rows"] == [
        {"row_index": 2, "row_sha256": bad.row_sha256, "reason": reason, "line": 3}
    ]
    assert [r.row_index for r in result.rows] == [1, 3]


def test_a_tool_run_answering_a_call_is_kept_and_later_queries_may_follow(qwen_tokenizer):
    row = {"messages": [U, asst_calls(call(), call()), TOOL, TOOL, A, U, asst_calls(call()), TOOL, A]}
    result = ingest_examples([row], tokenizer=qwen_tokenizer)
    assert result.receipt["rows_kept"] == 1


def test_a_call_written_as_qwen_xml_in_content_may_be_answered(qwen_tokenizer):
    xml = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
    inline = {"messages": [U, {"role": "assistant", "content": xml}, TOOL, A]}
    structured = {"messages": [U, asst_calls(call()), TOOL, A]}
    result = ingest_examples([inline, structured], tokenizer=qwen_tokenizer)
    assert result.rows[0].input_ids == result.rows[1].input_ids
    assert result.rows[0].labels == result.rows[1].labels


def test_turns_after_the_last_assistant_are_unsupervised_context(qwen_tokenizer):
    """The contract requires a supervised token, not a final assistant turn; the trailing turn is
    rendered and masked."""
    result = ingest_examples(
        [{"messages": [U, A, {"role": "user", "content": "more"}]}], tokenizer=qwen_tokenizer
    )
    row = result.rows[0]
    text = qwen_tokenizer.decode(row.input_ids, skip_special_tokens=False)
    assert text.endswith("A<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n")
    tail = qwen_tokenizer.encode("<|im_start|>user\nmore<|im_end|>\n", add_special_tokens=False).ids
    assert row.input_ids[-len(tail) :] == tail
    assert row.labels[-len(tail) :] == [IGNORE_INDEX] * len(tail)
    assert (
        row.labels[-len(tail) - 2 :][:2] == row.input_ids[-len(tail) - 2 :][:2]
    )  # "<|im_end|>\n" supervised


def test_null_openai_export_fields_are_fine(qwen_tokenizer):
    exported = {"role": "assistant", "content": "A", "refusal": None, "function_call": None, "audio": None}
    result = ingest_examples([{"messages": [U, exported]}, GOOD], tokenizer=qwen_tokenizer)
    assert result.rows[0].input_ids == result.rows[1].input_ids
    assert result.rows[0].row_sha256 == parsed_row_sha256(GOOD)


def test_inline_unrenderable_field_is_a_row_rejection_not_a_transport_error(qwen_tokenizer):
    bad = {"messages": [U, {"role": "assistant", "content": None, "refusal": "no"}]}
    result = ingest_examples([GOOD, bad], tokenizer=qwen_tokenizer, policy="skip")
    assert result.receipt["rejected_rows"] == [
        {"row_index": 2, "row_sha256": parsed_row_sha256(parse_example(bad)), "reason": "tokenization_error"}
    ]


def test_null_arguments_render_a_call_without_parameters(qwen_tokenizer):
    result = ingest_examples([{"messages": [U, asst_calls(call(arguments=None))]}], tokenizer=qwen_tokenizer)
    text = qwen_tokenizer.decode(result.rows[0].input_ids, skip_special_tokens=False)
    assert text.endswith("<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>\n")


def test_inline_rows_too_deep_are_transport_errors_without_recursion(qwen_tokenizer):
    deep: list = []
    for _ in range(20_000):  # far beyond Python's recursion limit
        deep = [deep]
    example = {"messages": [U, A], "extra": deep}
    for policy in ("fail", "skip"):
        with pytest.raises(KilnError) as err:
            ingest_examples([GOOD, example], tokenizer=qwen_tokenizer, policy=policy)
        assert err.value.code == TRAINING_INVALID_REQUEST
        assert f"examples[1]: example: nested deeper than {MAX_JSON_DEPTH}" in err.value.message


def test_depth_limit_is_serde_json_s():
    """127 nested arrays/objects parse, 128 do not (serde_json's recursion limit of 128)."""
    assert json_depth(decode_json(nested(MAX_JSON_DEPTH))) == 127
    with pytest.raises(ValueError, match="nested deeper than 127"):
        decode_json(nested(MAX_JSON_DEPTH + 1))
    ok = {"messages": [U, A], "tools": [json.loads('{"a":' * 125 + "1" + "}" * 125)]}
    assert json_depth(ok) == 127
    parse_example(ok)


def test_crlf_blank_lines_and_a_last_line_without_newline(qwen_tokenizer, tmp_path):
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b"\r\n" + line(GOOD) + b"\r\n \t\r\n" + line({"messages": [U]}) + b"\r\n" + line(GOOD))
    result = ingest_jsonl(path, tokenizer=qwen_tokenizer, policy="skip")
    assert [r.row_index for r in result.rows] == [1, 3]
    assert result.receipt["rejected_rows"][0]["row_index"] == 2
    assert result.rows[0].input_ids == result.rows[1].input_ids
    assert result.rows[0].row_sha256 == parsed_row_sha256(GOOD)


def test_crlf_inside_content_is_kept_verbatim(qwen_tokenizer):
    row = {
        "messages": [{"role": "user", "content": "a\r\nb\r\n"}, {"role": "assistant", "content": "c\r\nd\td"}]
    }
    result = ingest_examples([row], tokenizer=qwen_tokenizer)
    text = qwen_tokenizer.decode(result.rows[0].input_ids, skip_special_tokens=False)
    assert "user\na\r\nb<|im_end|>" in text  # trailing CRLF trimmed like any whitespace
    assert "</think>\n\nc\r\nd\td<|im_end|>\n" in text


def test_very_long_row_is_never_truncated(qwen_tokenizer, tmp_path):
    answer = " ".join(f"w{i}" for i in range(60_000))
    row = {"messages": [U, {"role": "assistant", "content": answer}]}
    path = tmp_path / "long.jsonl"
    path.write_bytes(line(row))  # ~400 KB on one line, no trailing newline
    result = ingest_jsonl(path, tokenizer=qwen_tokenizer)
    ids = result.rows[0].input_ids
    expected = qwen_tokenizer.encode(
        f"<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{answer}<|im_end|>\n",
        add_special_tokens=False,
    ).ids
    assert ids == expected
    assert result.max_seq_len == len(ids) > 100_000


def test_a_checkpoint_tokenizer_json_cannot_truncate_or_pad(qwen_tokenizer, tmp_path):
    """Hugging Face saves enabled truncation/padding into tokenizer.json; SFT must ignore both."""
    from tokenizers import Tokenizer

    qwen_tokenizer.save(str(tmp_path / "tokenizer.json"))
    saved = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    saved.enable_truncation(16)
    saved.enable_padding(length=64, pad_id=248044, pad_token="<|endoftext|>")
    saved.save(str(tmp_path / "tokenizer.json"))
    assert json.loads((tmp_path / "tokenizer.json").read_text())["truncation"]["max_length"] == 16

    loaded = load_tokenizer(tmp_path)
    assert loaded.truncation is None and loaded.padding is None
    long_row = {"messages": [U, {"role": "assistant", "content": "one two three four five six seven eight"}]}
    reference = ingest_examples([long_row, GOOD], tokenizer=qwen_tokenizer)
    result = ingest_examples([long_row, GOOD], tokenizer=loaded)
    assert [r.input_ids for r in result.rows] == [r.input_ids for r in reference.rows]
    assert result.rows[0].seq_len > 16 and result.rows[1].seq_len < 64
