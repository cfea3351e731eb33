"""Shared by the tests that compare Kiln with the checked-in Transformers + TRL fixtures."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

from kiln_train.data.labels import IGNORE_INDEX

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


def assert_cases_match_the_oracle(cases: list[dict], outcomes: list) -> None:
    """Each case was kept with the oracle's text, token ids, labels and supervised-token count."""
    for case, outcome in zip(cases, outcomes, strict=True):
        name = case["name"]
        assert "error" not in case, name
        assert outcome.kept, (name, outcome.reason, outcome.detail)
        row = outcome.tokenized
        assert outcome.rendered.text == case["text"], name
        assert row.input_ids == case["input_ids"], name
        labels = labels_from(case["input_ids"], case["supervised_ranges"])
        assert row.labels == labels, name
        assert row.supervised_tokens == sum(1 for label in labels[1:] if label != IGNORE_INDEX), name
