"""Admission's steps are numbered once: the list in docs/ARCHITECTURE.md#the-path-of-one-job and
the order in api/admission.py's docstring name the same step under the same number."""

from __future__ import annotations

import re
from pathlib import Path

import api.admission

ROOT = Path(__file__).resolve().parents[2]
# A word each step's text carries, in the doc and in the code.
STEP_WORDS = {
    1: "slot",
    2: "body",
    3: "parse",
    4: "idempotency-key",
    5: "runner",
    6: "static gates",
    7: "resume",
    8: "ingestion",
    9: "memory",
    10: "transaction",
    11: "publish",
}


def _doc_steps() -> dict[int, str]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    api_part = text.split("**In the api**", 1)[1].split("**In the worker**", 1)[0]
    items = re.split(r"^(\d+)\. ", api_part, flags=re.MULTILINE)[1:]
    return {int(n): body.lower() for n, body in zip(items[::2], items[1::2], strict=True)}


def _code_steps() -> dict[int, str]:
    doc = " ".join(api.admission.__doc__.split())
    parts = re.split(r"\((\d+)\) ", doc.split("The checks that need no store", 1)[0])[1:]
    return {int(n): body.lower() for n, body in zip(parts[::2], parts[1::2], strict=True)}


def test_the_doc_and_the_code_number_the_admission_steps_alike():
    doc, code = _doc_steps(), _code_steps()
    assert sorted(doc) == sorted(code) == list(STEP_WORDS)
    for n, word in STEP_WORDS.items():
        assert word in doc[n], f"docs step {n} does not mention {word!r}"
        assert word in code[n], f"api/admission.py step ({n}) does not mention {word!r}"


def test_the_step_marks_in_the_code_are_steps_of_that_list():
    for rel in ("api/admission.py", "api/admission_plan.py", "api/routes/training.py"):
        marks = [int(n) for n in re.findall(r"# (?:admission step )?\((\d+)\)", (ROOT / rel).read_text())]
        assert marks and all(n in STEP_WORDS for n in marks), rel
