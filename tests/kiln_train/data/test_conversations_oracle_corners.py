"""Kiln against the Transformers + TRL corner-case fixture, exactly and without TRL.

qualification/fixtures/qwen35_sft_probe2_v1.json is written by `qualification/sft_template_oracle.py
--write`: named corner rows and 200 seeded `probe2_rows` conversations aimed at corners the
conversations fixture does not reach (tool-call arguments of every JSON type and spelling --
objects, big integers, -0.0, exponents, escapes, NUL, the largest f64 -- turns after the last
assistant, consecutive assistant or user turns, an assistant turn first, reasoning aliases given
together, reasoning/tool_calls on roles the template ignores, content parts without a type, control
characters, nested or non-OpenAI tools schemas), rendered by `apply_chat_template(...,
return_assistant_tokens_mask=True)` over TRL's `qwen3_5_think_training.jinja` with Kiln's
tokenizer.json.

Where Kiln and TRL agree to drop a field (reasoning or tool_calls on a user/system message; the
template never reads them), Kiln keeps the row as TRL renders it: those fields are context the
template does not show, not assistant output trained as something else (unlike `function_call` and
`refusal`, which Kiln refuses). The rows Kiln refuses although TRL renders them are the fixture's
edge rows, each with its reason.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kiln_cli.main import cli
from kiln_train.data.chat_template import training_chat_template_sha256
from kiln_train.data.conversation import parse_example
from kiln_train.data.ingestion import ingest_examples, iter_example_outcomes, iter_jsonl_outcomes
from kiln_train.data.labels import MASK_CONTRACT
from kiln_train.data.row_identity import parsed_row_sha256
from tests.kiln_train.data import reference_fixtures as rf
from tests.kiln_train.data.reference_fixtures import (
    assert_cases_match_the_oracle,
    holds_empty_answer,
    load_fixture,
)

generators = rf.generators  # shared fixture

FIXTURE_NAME = "qwen35_sft_probe2_v1.json"


@pytest.fixture(scope="module")
def fixture():
    return load_fixture(FIXTURE_NAME)


def test_header_and_rows_are_the_documented_generator_s(fixture, generators):
    assert fixture["schema"] == "kiln.qwen35-sft-probe2.v1"
    assert fixture["mask_contract"] == MASK_CONTRACT
    assert (fixture["versions"]["transformers"], fixture["versions"]["trl"]) == ("5.23.0", "1.16.0")
    assert fixture["artifacts"]["kiln_training_template_sha256"] == training_chat_template_sha256()
    assert "sft_template_oracle.py --write" in fixture["regenerate"]
    generator = fixture["generator"]
    assert generator["function"] == "probe2_rows"
    named = [{"messages": m} for _, m in generators.probe2_named()]
    named += [row for _, row in generators.probe2_tools_rows()]
    rows = generators.probe2_rows(generator["seed"], generator["rows"])
    assert [c["example"] for c in fixture["cases"]] == named + rows
    assert [e["example"] for e in fixture["edges"]] == [e["example"] for e in generators.probe2_edges()]


def test_fixture_reaches_the_corners_it_claims(fixture):
    rows = [c["example"] for c in fixture["cases"]]
    messages = [m for row in rows for m in row["messages"]]
    calls = [c["function"] for m in messages for c in m.get("tool_calls") or []]
    arg_texts = [f["arguments"] for f in calls if isinstance(f.get("arguments"), str)]
    assert sum(isinstance(f.get("arguments"), dict) for f in calls) >= 30
    assert sum("arguments" not in f for f in calls) >= 20
    for spelling in (
        "-0.0",
        "1E2",
        "e-3",
        "18446744073709551616",
        "1.7976931348623157e+308",
        "\\u0000",
        "\\ud83d",
    ):
        assert any(spelling in t for t in arg_texts), spelling
    assert sum(row["messages"][-1]["role"] == "user" for row in rows) >= 20
    assert sum(row["messages"][-1]["role"] == "tool" for row in rows) >= 10
    assert (
        sum(
            any(
                a["role"] == b["role"] == "assistant"
                for a, b in zip(row["messages"], row["messages"][1:], strict=False)
            )
            for row in rows
        )
        >= 30
    )
    assert (
        sum(sum(k in m for k in ("reasoning_content", "thinking", "reasoning")) >= 2 for m in messages) >= 5
    )
    assert sum(m["role"] == "user" and "reasoning_content" in m for m in messages) >= 10
    parts = [p for m in messages if isinstance(m.get("content"), list) for p in m["content"]]
    assert sum("type" not in p for p in parts) >= 20
    assert sum(p.get("type") == "input_text" for p in parts) >= 20
    assert sum(m.get("content") == [] for m in messages) >= 5


def test_every_case_matches_the_oracle_exactly(qwen_tokenizer, fixture):
    cases = fixture["cases"]
    outcomes = list(iter_example_outcomes([c["example"] for c in cases], tokenizer=qwen_tokenizer))
    assert len(outcomes) == len(cases) >= 240
    assert assert_cases_match_the_oracle(cases, outcomes, qwen_tokenizer) < len(cases) // 2


def test_edge_rows_get_the_documented_outcome(qwen_tokenizer, fixture):
    edges = fixture["edges"]
    outcomes = list(iter_example_outcomes([e["example"] for e in edges], tokenizer=qwen_tokenizer))
    for edge, outcome in zip(edges, outcomes, strict=True):
        want = edge["kiln"]
        assert edge["why"], edge["name"]
        assert (outcome.kept, outcome.reason) == (False, want["rejection"]), edge["name"]
        assert want["detail"] in outcome.detail, (edge["name"], outcome.detail)
    oracle = {e["name"]: e["oracle"] for e in edges}
    # what TRL does with the rows it renders (the reason each refusal is documented)
    assert "\ninf\n</parameter>" in oracle["arguments_number_beyond_f64"]["text"]
    assert "[-Infinity]" in oracle["arguments_number_beyond_f64"]["text"]
    assert "\ufdd0" in oracle["arguments_span_marker_escape"]["text"]
    assert "<|image_pad|>" in oracle["image_part_with_text"]["text"]
    assert "TextEncodeInput" in oracle["arguments_lone_surrogate"]["error"]


def _respelled(value, reverse: bool = True):
    """The same JSON value with object keys in the opposite order, except where the order is data:
    inside `tools` and `arguments` objects (see test_object_key_order_is_rendered_but_not_hashed)."""
    if isinstance(value, dict):
        items = list(value.items())
        return {
            k: (v if k in ("tools", "arguments") else _respelled(v, reverse))
            for k, v in (reversed(items) if reverse else items)
        }
    if isinstance(value, list):
        return [_respelled(v, reverse) for v in value]
    return value


def test_jsonl_and_inline_agree_and_hashes_ignore_spelling(qwen_tokenizer, fixture, tmp_path):
    """The same rows through JSONL, spelled two ways (ASCII escapes, reversed key order, spaces), give
    the inline rows' hashes, ids and labels; `kiln data inspect --json` reports the same."""
    rows = [c["example"] for c in fixture["cases"] if not holds_empty_answer(c["example"])]
    inline = ingest_examples(rows, tokenizer=qwen_tokenizer)
    plain, respelled = tmp_path / "plain.jsonl", tmp_path / "respelled.jsonl"
    plain.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    respelled.write_text(
        "\r\n\r\n".join(
            json.dumps(_respelled(r, True), ensure_ascii=True, separators=(" , ", " : ")) for r in rows
        ),
        encoding="utf-8",
    )
    for path in (plain, respelled):
        outcomes = list(iter_jsonl_outcomes(path, tokenizer=qwen_tokenizer))
        assert [o.row_index for o in outcomes] == list(range(1, len(rows) + 1))
        assert [o.row_sha256 for o in outcomes] == [r.row_sha256 for r in inline.rows]
        assert [o.tokenized.input_ids for o in outcomes] == [r.input_ids for r in inline.rows]
        assert [o.tokenized.labels for o in outcomes] == [r.labels for r in inline.rows]
    assert [r.row_sha256 for r in inline.rows] == [parsed_row_sha256(parse_example(r)) for r in rows]

    result = CliRunner().invoke(cli, ["data", "inspect", str(respelled), "--json"])
    assert result.exit_code == 0, result.output[-2000:]
    *shown, receipt = [json.loads(line) for line in result.output.splitlines()]
    assert [(r["row_sha256"], r["input_ids"], r["labels"]) for r in shown] == [
        (r.row_sha256, r.input_ids, r.labels) for r in inline.rows
    ]
    assert receipt["kept_corpus_sha256"] == inline.receipt["kept_corpus_sha256"]


def test_hash_identity_of_aliases_and_arguments_text(fixture):
    """Reasoning aliases normalise to one field (one identity, one rendering); the arguments string is
    hashed verbatim, so two spellings of the same call are two rows even though they render alike."""
    base = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}

    def with_reasoning(**fields) -> dict:
        row = json.loads(json.dumps(base))
        row["messages"][1].update(fields)
        return row

    same = [
        with_reasoning(reasoning_content="r"),
        with_reasoning(thinking="r"),
        with_reasoning(reasoning="r"),
        with_reasoning(reasoning_content=None, thinking="r", reasoning="other"),
    ]
    assert len({parsed_row_sha256(parse_example(r)) for r in same}) == 1
    assert parsed_row_sha256(parse_example(with_reasoning(thinking="", reasoning="r"))) != parsed_row_sha256(
        parse_example(same[0])
    )

    def calling(arguments: str) -> dict:
        call = {"function": {"name": "f", "arguments": arguments}}
        return {"messages": [base["messages"][0], {"role": "assistant", "tool_calls": [call]}]}

    spellings = ['{"x": 1.0}', '{"x":1.0}', '{"x": 1E0}']
    assert len({parsed_row_sha256(parse_example(calling(s))) for s in spellings}) == 3


def test_object_key_order_is_rendered_but_not_hashed(qwen_tokenizer):
    """A known limit of the contract's hash recipe. Parameters of an `arguments` object and the keys
    of a `tools` schema render in the order the row gives them, as in TRL (the corner-case fixture's
    `arguments_object` and `tools_nested_schema` cases pin that order), but the parsed-row hash
    sorts keys (docs/ingestion.md#row-identity), so two rows differing only in that order share a
    row hash while training different token sequences. An `arguments` JSON string is hashed
    verbatim and does not have this gap."""
    q = {"role": "user", "content": "Q"}

    def row(arguments: dict, tool: dict) -> dict:
        call = {"function": {"name": "f", "arguments": arguments}}
        return {"tools": [tool], "messages": [q, {"role": "assistant", "tool_calls": [call]}]}

    first = row({"a": 1, "b": 2}, {"name": "f", "description": "d"})
    second = row({"b": 2, "a": 1}, {"description": "d", "name": "f"})
    one, two = ingest_examples([first, second], tokenizer=qwen_tokenizer).rows
    assert one.row_sha256 == two.row_sha256
    assert one.input_ids != two.input_ids
    text = qwen_tokenizer.decode(two.input_ids, skip_special_tokens=False)
    assert '{"description": "d", "name": "f"}' in text
    assert "<parameter=b>\n2\n</parameter>\n<parameter=a>\n1\n</parameter>" in text
