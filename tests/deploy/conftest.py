"""Each test's outcome on its item (`item.outcome_call`), so a fixture can tell after the test
whether it failed (the compose end-to-end test prints the containers' logs then)."""

from __future__ import annotations

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"outcome_{report.when}", report)
    return report
