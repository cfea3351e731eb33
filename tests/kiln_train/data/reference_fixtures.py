"""Shared by the tests that compare Kiln with the checked-in Transformers + TRL fixtures."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

from kiln_train.data.chat_template import training_template
from kiln_train.data.conversation import parse_example, prepare_for_template
from kiln_train.data.labels import IGNORE_INDEX, label_encoding
from kiln_train.data.row_identity import serde_canonical_json

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "qualification" / "fixtures"


def load_fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def generators() -> ModuleType:
    """The oracle's row generators and case tables (`qualification/sft_oracle`): no Transformers or TRL."""
    return importlib.import_module("qualification.sft_oracle")


def labels_from(input_ids: list[int], ranges: list[list[int]]) -> list[int]:
    """-100 everywhere except the supervised token ranges `[a, b)`."""
    labels = [IGNORE_INDEX] * len(input_ids)
    for a, b in ranges:
        labels[a:b] = input_ids[a:b]
    return labels


def holds_empty_answer(example: dict) -> bool:
    """True when an assistant turn has blank content, no tool calls and no reasoning (Kiln rejects
    the row as `empty_response`; the oracle still renders it)."""
    for m in example.get("messages") or []:
        if m.get("role") != "assistant" or m.get("tool_calls"):
            continue
        content = m.get("content") or ""
        text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
        reasoning = m.get("reasoning_content") or m.get("thinking") or m.get("reasoning") or ""
        if not text.strip() and not reasoning.strip():
            return True
    return False


def render_without_row_rules(example: dict, tokenizer) -> tuple[str, list[int], list[int]]:
    """(text, input ids, labels) of a conversation through the template and the mask alone, for a
    row the row rules reject (an empty answer): the oracle's rendering is still checked."""
    parsed = parse_example(example)
    conversation = prepare_for_template(parsed, serde_canonical_json(parsed))
    rendered = training_template().render(conversation.messages, conversation.tools)
    (encoding,) = tokenizer.encode_batch([rendered.text], add_special_tokens=False)
    return rendered.text, encoding.ids, label_encoding(encoding, rendered.spans).labels


def assert_cases_match_the_oracle(cases: list[dict], outcomes: list, tokenizer) -> int:
    """Each case was kept with the oracle's text, token ids, labels and supervised-token count; a
    case holding an empty answer is rejected `empty_response`, and its rendering still equals the
    oracle's. Returns how many cases were rejected so."""
    empty = 0
    for case, outcome in zip(cases, outcomes, strict=True):
        name = case["name"]
        assert "error" not in case, name
        labels = labels_from(case["input_ids"], case["supervised_ranges"])
        if holds_empty_answer(case["example"]):
            assert (outcome.kept, outcome.reason) == (False, "empty_response"), name
            assert render_without_row_rules(case["example"], tokenizer) == (
                case["text"],
                case["input_ids"],
                labels,
            )
            empty += 1
            continue
        assert outcome.kept, (name, outcome.reason, outcome.detail)
        row = outcome.tokenized
        assert outcome.rendered.text == case["text"], name
        assert row.input_ids == case["input_ids"], name
        assert row.labels == labels, name
        assert row.supervised_tokens == sum(1 for label in labels[1:] if label != IGNORE_INDEX), name
    return empty
