"""`--check`: a fresh oracle run against the stored fixtures, and Kiln against the oracle on more rows.

For each fixture: every header and case field equals a fresh run, Kiln reproduces every case, and
further rows from the same generator under another seed agree too; edge rows give the outcome
they record. For the first fixture, Kiln's own training template rendered by Transformers must
also equal TRL's on every row.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln_train.data.chat_template import TRAINING_TEMPLATE_FILE

from .constants import (
    CHECK_ROWS,
    CHECK_SEED,
    CONVERSATIONS_CHECK_ROWS,
    CONVERSATIONS_CHECK_SEED,
    CONVERSATIONS_FIXTURE,
    FIXTURE,
    PROBE2_CHECK_ROWS,
    PROBE2_CHECK_SEED,
    PROBE2_FIXTURE,
)
from .conversations import conversation_rows
from .fixtures import build_conversations_fixture, build_fixture, build_probe2_fixture
from .probe2 import probe2_rows
from .random_rows import random_rows
from .stack import compare_kiln, kiln_edge_problem, kiln_template_input, run_oracle, trl_template_path


def _stale_fields(fresh: dict, stored_path: Path, label: str) -> list[str]:
    """One failure per top-level field of the stored fixture that a fresh run does not reproduce."""
    stored = json.loads(stored_path.read_text(encoding="utf-8"))
    return [
        f"{label} field {key!r} differs from a fresh oracle run"
        for key in fresh
        if fresh[key] != stored.get(key)
    ]


def _edge_failures(tokenizer, edges: list[dict], label: str) -> list[str]:
    failures = []
    for edge in edges:
        problem = kiln_edge_problem(tokenizer, edge)
        if problem:
            failures.append(f"{label} {edge['name']}: {problem}")
    return failures


def check(hf_tokenizer, tokenizer, tokenizer_json: Path) -> int:
    """Check all three fixtures; print the first 50 failures and return the exit status."""
    fresh = build_fixture(hf_tokenizer, tokenizer_json)
    failures = _stale_fields(fresh, FIXTURE, "fixture")
    trl_template = trl_template_path().read_text(encoding="utf-8")
    kiln_template = TRAINING_TEMPLATE_FILE.read_text(encoding="utf-8")
    rows = [c["example"] for c in fresh["cases"]] + random_rows(CHECK_SEED, CHECK_ROWS)
    for i, row in enumerate(rows):
        expected = run_oracle(hf_tokenizer, trl_template, row)
        problem = compare_kiln(tokenizer, row, expected)
        if problem:
            failures.append(f"row {i}: Kiln vs oracle: {problem}")
        prepared = kiln_template_input(row)
        if prepared is None:
            if "error" not in expected:  # both refusing is agreement; otherwise reported just above
                failures.append(f"row {i}: Kiln's normaliser refused the row")
            continue
        effective = run_oracle(hf_tokenizer, kiln_template, row, prepared)
        if effective != expected and not ("error" in effective and "error" in expected):
            failures.append(f"row {i}: Kiln's training template through Transformers differs from TRL's")
    failures += check_conversations(hf_tokenizer, tokenizer, tokenizer_json)
    failures += check_probe2(hf_tokenizer, tokenizer, tokenizer_json)
    for failure in failures[:50]:
        print("FAIL", failure)
    print(f"checked {len(rows)} rows against the oracle; {len(failures)} failure(s)")
    return 1 if failures else 0


def check_conversations(hf_tokenizer, tokenizer, tokenizer_json: Path) -> list[str]:
    """The conversations fixture, 1,000 further generated conversations and the edge rows."""
    fresh = build_conversations_fixture(hf_tokenizer, tokenizer_json)
    failures = _stale_fields(fresh, CONVERSATIONS_FIXTURE, "conversations fixture")
    trl_template = trl_template_path().read_text(encoding="utf-8")
    rows = [c["example"] for c in fresh["cases"]] + conversation_rows(
        CONVERSATIONS_CHECK_SEED, CONVERSATIONS_CHECK_ROWS
    )
    for i, row in enumerate(rows):
        expected = run_oracle(hf_tokenizer, trl_template, row)
        problem = compare_kiln(tokenizer, row, expected)
        if problem:
            failures.append(f"conversation {i}: Kiln vs oracle: {problem}")
    failures += _edge_failures(tokenizer, fresh["edges"], "edge")
    print(f"checked {len(rows)} conversations and {len(fresh['edges'])} edge rows against the oracle")
    return failures


def check_probe2(hf_tokenizer, tokenizer, tokenizer_json: Path) -> list[str]:
    """The corner-case fixture, 1,000 further probe2 rows and the edge rows."""
    fresh = build_probe2_fixture(hf_tokenizer, tokenizer_json)
    failures = _stale_fields(fresh, PROBE2_FIXTURE, "probe2 fixture")
    trl_template = trl_template_path().read_text(encoding="utf-8")
    rows = [c["example"] for c in fresh["cases"]] + probe2_rows(PROBE2_CHECK_SEED, PROBE2_CHECK_ROWS)
    for i, row in enumerate(rows):
        problem = compare_kiln(tokenizer, row, run_oracle(hf_tokenizer, trl_template, row))
        if problem:
            failures.append(f"probe2 conversation {i}: Kiln vs oracle: {problem}")
    failures += _edge_failures(tokenizer, fresh["edges"], "probe2 edge")
    print(f"checked {len(rows)} probe2 conversations and {len(fresh['edges'])} edge rows against the oracle")
    return failures
