"""Shared by the tests that compare Kiln with the checked-in Transformers + TRL fixtures."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from kiln_train.data.labels import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "qualification" / "fixtures"
ORACLE_SCRIPT = REPO / "qualification" / "sft_template_oracle.py"


def load_fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))


def oracle_module(module_name: str = "sft_template_oracle") -> ModuleType:
    """The oracle script as a module: its generators run without Transformers or TRL."""
    spec = importlib.util.spec_from_file_location(module_name, ORACLE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def labels_from(input_ids: list[int], ranges: list[list[int]]) -> list[int]:
    """-100 everywhere except the supervised token ranges `[a, b)`."""
    labels = [IGNORE_INDEX] * len(input_ids)
    for a, b in ranges:
        labels[a:b] = input_ids[a:b]
    return labels
