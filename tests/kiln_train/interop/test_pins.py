"""requirements.lock is the installed closure of the runner's stack, exactly."""

from __future__ import annotations

from kiln_train.interop import pins
from kiln_train.interop.bundle import ENFORCED_PINS, parse_lock, runner_bytes


def test_lock_equals_the_installed_closure():
    lock = parse_lock(runner_bytes("requirements.lock").decode("utf-8"))
    assert lock == pins.installed_closure(), "regenerate: .venv/bin/python -m kiln_train.interop.pins --write"


def test_lock_pins_the_stack_the_issue_names():
    lock = parse_lock(runner_bytes("requirements.lock").decode("utf-8"))
    assert {p: lock[p] for p in ("torch", "transformers", "trl", "peft")} == {
        "torch": "2.13.0",
        "transformers": "5.23.0",
        "trl": "1.16.0",
        "peft": "0.21.2",
    }
    assert set(ENFORCED_PINS) <= set(lock)
