"""Kiln against the Transformers + TRL conversations fixture, exactly and without TRL
(docs/tokenization.md#oracle-fixtures).

qualification/fixtures/qwen35_sft_conversations_v1.json is written by
`qualification/sft_template_oracle.py --write` (see qualification/README.md): 300 seeded
conversations rendered by `apply_chat_template(..., return_assistant_tokens_mask=True)` over TRL's
`qwen3_5_think_training.jinja` with Kiln's tokenizer.json, and named edge rows with the outcome Kiln
must give. Here Kiln's ingestion must reproduce the text, every token id and every label.
"""

from __future__ import annotations

import hashlib

import pytest

from kiln_train.data.chat_template import training_chat_template_sha256
from kiln_train.data.ingestion import iter_example_outcomes
from kiln_train.data.labels import MASK_CONTRACT
from kiln_train.data.tokenizer import vocabulary_file
from tests.kiln_train.data import reference_fixtures as rf
from tests.kiln_train.data.reference_fixtures import (
    assert_cases_match_the_oracle,
    labels_from,
    load_fixture,
)

generators = rf.generators  # shared fixture

FIXTURE_NAME = "qwen35_sft_conversations_v1.json"


@pytest.fixture(scope="module")
def fixture():
    return load_fixture(FIXTURE_NAME)


def strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def test_header_pins_the_reference_stack_and_our_artifacts(fixture):
    assert fixture["schema"] == "kiln.qwen35-sft-conversations.v1"
    assert fixture["mask_contract"] == MASK_CONTRACT
    assert fixture["versions"]["transformers"] == "5.23.0"
    assert fixture["versions"]["trl"] == "1.16.0"
    assert fixture["artifacts"]["kiln_training_template_sha256"] == training_chat_template_sha256()
    vocabulary = hashlib.sha256(vocabulary_file().read_bytes()).hexdigest()
    assert fixture["artifacts"]["tokenizer_vocabulary_sha256"] == vocabulary
    assert "sft_template_oracle.py --write" in fixture["regenerate"]


def test_fixture_rows_are_the_documented_generator_s(fixture, generators):
    generator = fixture["generator"]
    assert generator["function"] == "conversation_rows"
    assert generator["rows"] == len(fixture["cases"]) >= 300
    rows = generators.conversation_rows(generator["seed"], generator["rows"])
    assert [c["example"] for c in fixture["cases"]] == rows
    assert [e["example"] for e in fixture["edges"]] == [e["example"] for e in generators.conversation_edges()]


def test_fixture_reaches_the_corners_it_claims(fixture):
    examples = [c["example"] for c in fixture["cases"]]
    messages = [m for row in examples for m in row["messages"]]
    assistants = [m for m in messages if m["role"] == "assistant"]

    def count(predicate) -> int:
        return sum(1 for m in messages if predicate(m))

    assert sum("tools" in row for row in examples) >= 50
    assert sum(row["messages"][0]["role"] == "system" for row in examples) >= 100
    for key in ("reasoning_content", "thinking", "reasoning"):
        assert sum(key in m for m in assistants) >= 10, key
    assert count(lambda m: isinstance(m.get("content"), str) and "</think>" in m["content"]) >= 50
    assert count(lambda m: len(m.get("tool_calls") or []) >= 2) >= 20
    calls = [c["function"] for m in assistants for c in m.get("tool_calls") or []]
    assert sum(isinstance(f.get("arguments"), str) for f in calls) >= 100
    assert sum(isinstance(f.get("arguments"), dict) for f in calls) >= 10
    assert sum("arguments" not in f for f in calls) >= 10
    assert count(lambda m: m["role"] == "tool" and "tool_call_id" in m and "name" in m) >= 50
    assert count(lambda m: isinstance(m.get("content"), list)) >= 50
    assert count(lambda m: m.get("content") is None or "content" not in m) >= 30
    assert count(lambda m: isinstance(m.get("content"), str) and not m["content"].strip()) >= 30
    text = "".join(strings(examples))
    for literal in (
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "\r\n",
        "\u3000",
        "e\u0301",
        "👨‍👩‍👧‍👦",
        "数据",
    ):
        assert literal in text, literal


def test_every_conversation_matches_the_oracle_exactly(qwen_tokenizer, fixture):
    cases = fixture["cases"]
    outcomes = list(iter_example_outcomes([c["example"] for c in cases], tokenizer=qwen_tokenizer))
    assert len(outcomes) == len(cases)
    assert assert_cases_match_the_oracle(cases, outcomes, qwen_tokenizer) < len(cases) // 2


def test_edge_rows_get_the_documented_outcome(qwen_tokenizer, fixture):
    edges = fixture["edges"]
    outcomes = list(iter_example_outcomes([e["example"] for e in edges], tokenizer=qwen_tokenizer))
    for edge, outcome in zip(edges, outcomes, strict=True):
        want, oracle = edge["kiln"], edge["oracle"]
        assert edge["why"], edge["name"]
        if want.get("kept"):
            assert outcome.kept, (edge["name"], outcome.detail)
            assert outcome.rendered.text == oracle["text"]
            assert outcome.tokenized.input_ids == oracle["input_ids"]
            assert outcome.tokenized.labels == labels_from(oracle["input_ids"], oracle["supervised_ranges"])
            continue
        assert (outcome.kept, outcome.reason) == (False, want["rejection"]), edge["name"]
        assert want["detail"] in outcome.detail, (edge["name"], outcome.detail)
