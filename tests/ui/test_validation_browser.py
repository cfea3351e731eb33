"""Held-out validation in the browser (docs/validation.md): the form's validation controls reach
the request, a refused validation field is marked next to its control, and the job page overlays
the validation curve on `#job-loss-chart` with exactly one point per evaluation the server made.
Against a live `kiln up` (real api and worker processes, SQLite, the tiny model)."""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest
from playwright.sync_api import expect

from tests.api.conftest import example

pytestmark = pytest.mark.timeout(600)


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_the_job_chart_overlays_one_validation_point_per_evaluation(tab, stack, tmp_path):
    page = tab.page
    adapter = f"validated-{uuid.uuid4().hex[:6]}"
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text(jsonl([example(i) for i in range(20, 22)]))

    page.goto("/#/train")
    expect(page.locator("#sft-epochs")).to_have_value("3")
    page.check("#sft-source-text")
    page.fill("#sft-dataset-text", jsonl([example(i) for i in range(4)]))
    page.fill("#sft-output-name", adapter)
    page.fill("#sft-epochs", "2")
    page.fill("#sft-lora-rank", "4")
    page.fill("#sft-lora-alpha", "8")
    page.set_input_files("#sft-validation-file", str(held_out))
    page.fill("#sft-validation-interval", "3")
    before = len(stack.jobs())
    page.click("#sft-preflight")
    result = page.locator("#preflight-result")
    expect(result).to_have_attribute("data-status", "200")
    expect(result).to_contain_text("Validation (held out)")
    expect(result).to_contain_text("inline: 2 kept, 0 rejected (of 2 read)")
    # 8 steps: the baseline, steps 3 and 6 (interval), 4 and 8 (epoch ends)
    expect(result).to_contain_text("5 (every 3 steps and each epoch's end)")
    assert len(stack.jobs()) == before

    page.click("#sft-submit")
    page.wait_for_url(re.compile(r".*#/jobs/.+"))
    job_id = page.url.split("#/jobs/", 1)[1]
    deadline = time.monotonic() + 240
    while page.locator("#job-state").text_content() != "completed":
        assert page.locator("#job-state").text_content() != "failed", page.locator(
            "#job-failure"
        ).text_content()
        assert time.monotonic() < deadline
        time.sleep(0.25)
    detail = stack.get(f"/v1/train/jobs/{job_id}")
    evaluations = detail["validation_history"]
    assert [e["global_step"] for e in evaluations] == [0, 3, 4, 6, 8]
    receipt = detail["train_receipt"]["validation"]
    assert [e["global_step"] for e in receipt["evaluations"]] == [0, 3, 4, 6, 8]
    assert [e["loss"] for e in receipt["evaluations"]] == [e["loss"] for e in evaluations]

    chart = page.locator("#job-loss-chart")
    expect(chart).to_have_attribute("data-validation-points", str(len(evaluations)))
    expect(chart).to_have_attribute("data-points", "9")  # steps 1..8 and the baseline at 0
    last = evaluations[-1]
    expect(page.locator("#job-validation")).to_have_text(
        f"validation loss {last['loss']:.4f}, token accuracy {last['token_accuracy']:.4f}"
    )
    expect(page.locator("#job-events li[data-kind='validation_evaluated']")).to_have_count(5)
    tab.shot("job-page-validation")


def test_a_refused_validation_field_is_marked_next_to_its_control(tab, stack):
    page = tab.page
    before = len(stack.jobs())
    page.goto("/#/train")
    expect(page.locator("#sft-epochs")).to_have_value("3")
    page.fill("#sft-lora-rank", "4")
    page.fill("#sft-lora-alpha", "8")
    page.fill("#sft-holdout-percent", "60")
    page.click("#sft-preflight")
    expect(page.locator("#sft-holdout-percent-error")).to_contain_text("validation.holdout_percent")
    expect(page.locator("#sft-holdout-percent")).to_have_attribute("aria-invalid", "true")

    page.fill("#sft-holdout-percent", "")
    page.fill("#sft-validation-interval", "2")
    page.click("#sft-submit")
    expect(page.locator("#sft-validation-interval-error")).to_contain_text("holdout percent first")
    assert len(stack.jobs()) == before
