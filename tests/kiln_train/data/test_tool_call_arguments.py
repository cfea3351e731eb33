"""Tool-call arguments whose JSON escapes decode to something the row itself could not hold.

A `function.arguments` string is kept verbatim in the row (and its hash), so the row-level checks
see `"\\ud800"`, `1e400` or `"\\ufdd0"` only as escape text. Kiln parses the string into the object
the template renders and checks the decoded value: such a row fails alone, naming the arguments
field, and the file's other rows (and `kiln data inspect`) go on.

Deliberate differences from TRL (qualification/fixtures/qwen35_sft_probe2_v1.json records what
Transformers + TRL do with each of these rows):

- a lone surrogate: TRL's own tokenizer call fails too (TypeError), so both refuse; Kiln names the
  field and rejects only that row as `tokenization_error`.
- `1e400` (beyond f64): Python's JSON parser reads it as infinity, so TRL trains the call as
  `inf` / `[Infinity]` -- a different text from the data, and not JSON. Kiln refuses the number
  ("number out of range"), as it does anywhere else in a row, and rejects the row as
  `tokenization_error` rather than train a silently changed call.
- a span marker written as an escape: TRL renders the noncharacter; Kiln fails the row closed,
  naming the arguments field (docs/tokenization.md#span-markers).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kiln_cli.main import cli
from kiln_train.data.chat_template import ChatTemplate
from kiln_train.data.conversation import parse_example
from kiln_train.data.ingestion import (
    ingest_examples,
    ingest_jsonl,
    iter_example_outcomes,
    iter_jsonl_outcomes,
)
from kiln_train.data.row_identity import parsed_row_sha256
from kiln_train.errors import TRAINING_INVALID_REQUEST, KilnError

U = {"role": "user", "content": "Q"}
GOOD = {"messages": [U, {"role": "assistant", "content": "A"}]}
WHERE = "messages[1].tool_calls[0].function.arguments"


def calling(arguments: str) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"messages": [U, {"role": "assistant", "content": None, "tool_calls": [call]}]}


# (name, arguments string as it stands in the JSON row, detail fragment)
CASES = [
    ("lone_high_surrogate_value", '{"x": "\\ud800"}', "decodes to a lone UTF-16 surrogate"),
    ("lone_low_surrogate_key", '{"\\udc00": 1}', "decodes to a lone UTF-16 surrogate"),
    ("reversed_pair_nested", '{"x": [{"y": "\\ude00\\ud83d"}]}', "decodes to a lone UTF-16 surrogate"),
    ("number_beyond_f64", '{"x": 1e400}', "holds a number out of range"),
    ("negative_number_beyond_f64_nested", '{"x": {"y": [-1e400]}}', "holds a number out of range"),
    ("span_open_marker_escape", '{"x": "\\ufdd0"}', "contains an internal span marker"),
    ("span_close_marker_escape", '{"x": "a\\ufdd1b"}', "contains an internal span marker"),
    ("span_markers_in_key", '{"\\ufdd1\\ufdd0": 1}', "contains an internal span marker"),
]


@pytest.mark.parametrize(("name", "arguments", "detail"), CASES, ids=[c[0] for c in CASES])
def test_decoded_arguments_fail_only_their_row_with_the_field_named(
    qwen_tokenizer, tmp_path, name, arguments, detail
):
    bad = calling(arguments)
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (GOOD, bad, GOOD)) + "\n", encoding="utf-8")

    outcomes = list(iter_jsonl_outcomes(path, tokenizer=qwen_tokenizer))
    assert [(o.row_index, o.kept) for o in outcomes] == [(1, True), (2, False), (3, True)]
    assert outcomes[1].reason == "tokenization_error"
    assert outcomes[1].detail.startswith(f"{WHERE} {detail}")
    assert outcomes[1].row_sha256 == parsed_row_sha256(parse_example(bad))  # the arguments string, verbatim

    with pytest.raises(KilnError) as err:
        ingest_jsonl(path, tokenizer=qwen_tokenizer)
    assert err.value.code == TRAINING_INVALID_REQUEST
    assert (
        f"SFT row 2 ({parsed_row_sha256(parse_example(bad))}) rejected as tokenization_error: {WHERE} {detail}"
        in (err.value.message)
    )

    skipped = ingest_jsonl(path, tokenizer=qwen_tokenizer, policy="skip").receipt
    assert skipped["rejected_rows"] == [
        {
            "row_index": 2,
            "row_sha256": parsed_row_sha256(parse_example(bad)),
            "reason": "tokenization_error",
            "line": 2,
        }
    ]
    assert skipped["kept_row_hashes"] == [parsed_row_sha256(GOOD)] * 2

    inline = ingest_examples([GOOD, bad], tokenizer=qwen_tokenizer, policy="skip").receipt
    assert (
        inline["rejected_rows"]
        == [  # an inline row has no line
            {k: v for k, v in r.items() if k != "line"} for r in skipped["rejected_rows"][:1]
        ]
    )


def test_kiln_data_inspect_json_reports_the_row_instead_of_a_traceback(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [GOOD, calling('{"x": "\\ud800"}'), calling('{"x": 1e400}'), GOOD]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    result = CliRunner().invoke(cli, ["data", "inspect", str(path), "--policy", "skip", "--json"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    *shown, receipt = [json.loads(line) for line in result.output.splitlines()]
    assert [r["row_index"] for r in shown] == [1, 2, 3, 4]
    assert [r.get("rejection") for r in shown] == [None, "tokenization_error", "tokenization_error", None]
    assert "lone UTF-16 surrogate" in shown[1]["detail"]
    assert "number out of range" in shown[2]["detail"]
    assert (receipt["rows_read"], receipt["rows_kept"], receipt["rows_rejected"]) == (4, 2, 2)
    assert [r["row_index"] for r in receipt["rejected_rows"]] == [2, 3]


def test_arguments_that_fit_are_rendered_exactly_as_python_reads_them(qwen_tokenizer):
    """The boundary of these checks: paired surrogates, the largest f64, -0.0, big integers and
    NUL are all representable and render as TRL renders them (the corner-case fixture pins the ids)."""
    row = calling(
        '{"e": "\\ud83d\\ude00", "m": 1.7976931348623157e308, "z": -0.0, "b": 123456789012345678901234567890, '
        '"n": "a\\u0000b"}'
    )
    (outcome,) = list(iter_example_outcomes([row], tokenizer=qwen_tokenizer))
    assert outcome.kept, outcome.detail
    assert outcome.rendered.text.endswith(
        "<tool_call>\n<function=f>\n<parameter=e>\n😀\n</parameter>\n<parameter=m>\n1.7976931348623157e+308\n"
        "</parameter>\n<parameter=z>\n-0.0\n</parameter>\n<parameter=b>\n123456789012345678901234567890\n"
        "</parameter>\n<parameter=n>\na\x00b\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    )


# A training template that writes a lone surrogate into one rendering: the real tokenizer refuses
# that text, which no normalised row can reach -- the backstop must still hold.
SURROGATE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
    "{{ '%c' | format(55296) if m.content == 'bad' else '' }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
)


def test_a_tokenizer_failure_rejects_that_row_only(qwen_tokenizer):
    template = ChatTemplate(SURROGATE_TEMPLATE, "surrogate")
    bad = {"messages": [U, {"role": "assistant", "content": "bad"}]}
    outcomes = list(iter_example_outcomes([GOOD, bad, GOOD], tokenizer=qwen_tokenizer, template=template))
    assert [o.kept for o in outcomes] == [True, False, True]
    assert outcomes[1].reason == "tokenization_error"
    assert outcomes[1].detail.startswith("tokenizer: TypeError: ")
    assert outcomes[0].tokenized.input_ids == outcomes[2].tokenized.input_ids
    expected = qwen_tokenizer.encode(
        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n", add_special_tokens=False
    ).ids
    assert outcomes[0].tokenized.input_ids == expected

    with pytest.raises(KilnError) as err:
        ingest_examples([GOOD, bad], tokenizer=qwen_tokenizer, template=template)
    assert "SFT row 2 (" in err.value.message and "rejected as tokenization_error: tokenizer: " in (
        err.value.message
    )


ASSISTANT = {"role": "assistant", "content": "A"}


@pytest.mark.parametrize(
    "example",
    [
        {"tools": [{1: "a", "b": 2}], "messages": [U, ASSISTANT]},
        {
            "messages": [
                U,
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": {1: "a", "b": 2}}}],
                },
            ]
        },
        {"tools": [{"x": {1, 2}}], "messages": [U, ASSISTANT]},
    ],
    ids=["tools_mixed_key_types", "arguments_mixed_key_types", "tools_set_value"],
)
def test_python_callers_non_json_values_are_transport_errors_not_tracebacks(qwen_tokenizer, example):
    """Objects handed to `ingest_examples` by Python code (not decoded from JSON) can hold what JSON
    cannot: the example is refused like any undeserialisable inline example (400, naming it), and no
    error from hashing it escapes."""
    for policy in ("fail", "skip"):
        with pytest.raises(KilnError) as err:
            ingest_examples([GOOD, example], tokenizer=qwen_tokenizer, policy=policy)
        assert err.value.code == TRAINING_INVALID_REQUEST
        assert "examples[1]: example: not representable as JSON: " in err.value.message
