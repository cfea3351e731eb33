"""The train form and the job pages in a real browser (Debian's Chromium through Playwright)
against a live `kiln up`: upload, preflight, submit and watch a job to its adapter; cancel a queued
and a running job and resume from a checkpoint; refusals shown next to their field (a 400, the
413 breakdown, user text as text); the keyboard alone; every field of the form reaching the
request.

Each test uses the page the way a person does (the element ids are the UI's automation
contract) and checks what the page shows against the server's own answers. No test injects
script; the page runs under its strict Content-Security-Policy, and a script error or dialog fails
the test.
"""

from __future__ import annotations

import hashlib
import json
import re
import time

import pytest
from playwright.sync_api import expect

from tests.api.conftest import example
from tests.ui.conftest import DESKTOP, PHONE, TRAINING_MEMORY_GB
from tests.ui.page_support import BAD_ROLE, DEMO, SMALL, XSS_TEXT, documents, job_id_of, jsonl, name, tab_to

pytestmark = pytest.mark.timeout(600)

# The memory parts the page draws (app.js MEMORY_PARTS), when above zero.
MEMORY_PARTS = (
    "base_weights",
    "activations",
    "loss_workspace",
    "lora_param_grad",
    "lora_optimizer_state",
    "residency_scratch",
    "safety_margin",
)


# ----- train: upload, preflight, submit, watch ------------------------------------------------


@pytest.mark.slow
def test_upload_preflight_submit_and_watch_the_job_to_its_adapter(tab, stack, tmp_path):
    page = tab.page
    data = tmp_path / "support.jsonl"
    # Demo conversations are long enough (about a second a step here) to watch the chart grow.
    data.write_text(jsonl([json.loads(line) for line in DEMO.read_text().splitlines()[6:10]] + [BAD_ROLE]))
    adapter = name("support")

    info = _upload_and_store(page, stack, data)
    _fill_the_form(page, adapter)
    before = len(stack.jobs())
    _preflight_shows_the_plan(tab, stack, info, adapter)
    assert len(stack.jobs()) == before  # a preflight queues nothing

    page.dblclick("#sft-submit")  # a double click is one submission (one Idempotency-Key)
    job_id = job_id_of(page)
    _watch_the_job_to_completion(tab)
    assert len(stack.jobs()) == before + 1
    _the_finished_job_shows_its_receipt_canaries_and_checkpoints(tab, stack, job_id, adapter)


def _upload_and_store(page, stack, data) -> dict:
    """The file is uploaded with the skip policy, stored byte for byte and selected."""
    page.goto("/#/train")
    expect(page.locator("#sft-epochs")).to_have_value("3")  # the server's defaults are shown
    page.check("#sft-source-file")
    page.set_input_files("#sft-dataset-file", str(data))
    expect(page.locator("#sft-dataset-name")).to_have_value("support.jsonl")
    page.click("#sft-advanced summary")
    page.select_option("#sft-invalid-row-policy", "skip")
    page.click("#sft-dataset-upload")
    expect(page.locator("#sft-dataset-upload-result")).to_contain_text(
        "Stored support.jsonl: 4 row(s) kept, 1 rejected"
    )
    stored = stack.root / "datasets" / "support.jsonl"
    assert stored.read_bytes() == data.read_bytes()
    info = stack.get("/v1/datasets/support.jsonl")
    assert info["sha256"] == "sha256:" + hashlib.sha256(data.read_bytes()).hexdigest()
    expect(page.locator("#sft-dataset-select")).to_have_value("support.jsonl")
    expect(page.locator("#sft-source-stored")).to_be_checked()
    return info


def _fill_the_form(page, adapter: str) -> None:
    page.fill("#sft-output-name", adapter)
    page.fill("#sft-epochs", "3")
    page.fill("#sft-lora-rank", "4")
    page.fill("#sft-lora-alpha", "8")
    page.fill("#sft-checkpoint-interval", "3")
    page.fill("#sft-grad-checkpoint-segments", "2")
    prompts = page.locator("#sft-adapter-smoke-prompts")
    expect(prompts).to_be_disabled()  # until the smoke test is on
    page.check("#sft-adapter-smoke-test")
    expect(prompts).to_be_enabled()
    prompts.fill("Say hello:")


def test_the_instruction_rows_sample_is_converted_and_planned(tab, stack):
    page = tab.page
    page.goto("/#/train")
    page.check("#sft-source-sample-instruction")
    expect(page.locator("#sft-dataset-sample-instruction-note")).to_be_visible()
    expect(page.locator("#sft-dataset-sample-note")).to_be_hidden()
    page.click("#sft-preflight")
    result = page.locator("#preflight-result")
    expect(result).to_have_attribute("data-status", "200")
    expect(result).to_contain_text("10 kept, 0 rejected (of 10 read)")


def _preflight_shows_the_plan(tab, stack, info: dict, adapter: str) -> None:
    """The preflight shows the plan the api gives for the same body, and the rejected row."""
    page = tab.page
    page.click("#sft-preflight")
    result = page.locator("#preflight-result")
    expect(result).to_have_attribute("data-status", "200")
    expect(result).to_contain_text("4 kept, 1 rejected (of 5 read)")
    expect(result).to_contain_text("12 (3 epoch(s) × 4 row(s))")
    expect(result).to_contain_text("2 (as requested)")
    (rejection,) = info["stats"]["rejections"]
    row = page.locator("#preflight-rejected tbody tr")
    expect(row).to_have_count(1)
    expect(row).to_contain_text("5 (line 5)")  # a stored file's row names its line
    expect(row).to_contain_text(rejection["row_sha256"])
    expect(row).to_contain_text("invalid_role")
    body = {
        "dataset_path": "support.jsonl",
        "config": {
            "training_profile": "native_online_lora_v1",
            "output_name": adapter,
            "epochs": 3,
            "lora_rank": 4,
            "lora_alpha": 8,
            "optimizer": {
                "kind": "muon",
                "momentum": 0.95,
                "nesterov": True,
                "ns_iters": 5,
                "weight_decay": 0,
            },
            "invalid_row_policy": "skip",
            "adapter_smoke_test": True,
            "adapter_smoke_prompts": ["Say hello:"],
            "checkpoint_interval": 3,
            "grad_checkpoint_segments": 2,
        },
    }
    status, plan = stack.api("POST", "/v1/train/sft/preflight", body)
    assert status == 200, plan
    expect(page.locator("#preflight-max-rank")).to_have_text(str(plan["max_lora_rank_that_fits"]))
    tab.shot("train-preflight", DESKTOP)
    drawn = [k for k, v in plan["memory"]["breakdown"].items() if k in MEMORY_PARTS and v > 0]
    assert "base_weights" not in drawn  # resident beside the budget: explained, not drawn as "0 B"
    expect(result.locator(".against-budget .seg")).to_have_count(len(drawn))
    expect(result).to_contain_text("The base model's weights are not in it")
    expect(result.locator(".memory")).to_have_attribute("data-fits", "true")


def _watch_the_job_to_completion(tab) -> None:
    """The job page follows the run to `completed`; its chart grows without a reload."""
    page = tab.page
    loaded = len(documents(tab))
    seen: set[int] = set()
    deadline = time.monotonic() + 240
    while page.locator("#job-state").text_content() != "completed":
        points = page.locator("#job-loss-chart").get_attribute("data-points")
        if points is not None:
            seen.add(int(points))
        assert page.locator("#job-state").text_content() != "failed", page.locator(
            "#job-failure"
        ).text_content()
        assert time.monotonic() < deadline, seen
        time.sleep(0.25)
    expect(page.locator("#job-steps")).to_have_text("12/12")
    expect(page.locator("#job-loss-chart")).to_have_attribute("data-points", "12")
    assert any(0 < n < 12 for n in seen), seen  # the chart grew while the job ran, without a reload
    assert len(documents(tab)) == loaded


def _the_finished_job_shows_its_receipt_canaries_and_checkpoints(
    tab, stack, job_id: str, adapter: str
) -> None:
    page = tab.page
    detail = stack.get(f"/v1/train/jobs/{job_id}")
    assert detail["adapter_name"] == adapter and detail["training_data"]["dataset_path"] == "support.jsonl"
    assert [p["step"] for p in detail["loss_history"]] == list(range(1, 13))
    receipt = page.locator("#receipt-summary")
    expect(receipt).to_contain_text(detail["train_receipt"]["hyperparameters"]["seed"])
    expect(receipt).to_contain_text("kt_tape_flce")
    (canary,) = detail["train_receipt"]["adapter_smoke_test"]["prompts"]
    canaries = page.locator("#canary-table tbody tr")
    expect(canaries).to_have_count(1)
    expect(canaries).to_contain_text("Say hello:")
    expect(canaries.locator("td").nth(2)).to_have_text(canary["adapter_output"])
    assert detail["replay_request"]["config"]["grad_checkpoint_segments"] == 2
    expect(page.locator("#job-events li[data-kind='completed']")).to_have_count(1)
    checkpoints = stack.get(f"/v1/checkpoints?adapter={adapter}")["checkpoints"]
    assert [c["global_step"] for c in checkpoints] == [3, 6, 9]
    written = [c["resume_checkpoint"] for c in checkpoints]
    rows = page.locator("#job-checkpoints tbody tr")
    expect(rows).to_have_count(3)
    assert [rows.nth(i).get_attribute("data-checkpoint") for i in range(3)] == written
    tab.shot("job-page", DESKTOP)
    tab.shot("job-page", PHONE)


# ----- cancel, and resume from a checkpoint ---------------------------------------------------


def test_cancel_a_queued_and_a_running_job_then_resume_from_its_checkpoint(tab, stack):
    page = tab.page
    rows = [json.loads(line) for line in DEMO.read_text().splitlines()[:6]]
    running_name, queued_name = name("long"), name("behind")
    config = {**SMALL, "epochs": 40, "checkpoint_interval": 2}
    running = stack.submit({"examples": rows, "config": {**config, "output_name": running_name}})
    queued = stack.submit({"examples": rows, "config": {**config, "output_name": queued_name}})

    page.goto("/#/jobs")
    row = page.locator(f"#jobs-table tr[data-job='{queued}']")
    expect(row).to_have_attribute("data-state", "queued")
    expect(row.locator(".eta")).to_contain_text("in queue")
    row.locator("button[data-cancel]").click()
    expect(row).to_have_attribute("data-state", "failed", timeout=15000)
    assert stack.get(f"/v1/train/status/{queued}")["failure_reason"] == "cancelled"

    stack.wait(running, lambda d: d["global_step"] >= 3)
    expect(page.locator(f"#jobs-table tr[data-job='{running}'] .eta")).to_contain_text(
        re.compile(r"\d+(s|m)")
    )
    page.click(f"#jobs-table tr[data-job='{running}'] a")
    cancel = page.locator("#job-cancel")
    expect(cancel).to_be_visible()
    cancel.click()
    expect(page.locator("#job-state")).to_have_text("failed", timeout=60000)
    expect(page.locator("#job-failure")).to_contain_text("cancelled")
    expect(cancel).to_be_hidden()
    stopped = stack.get(f"/v1/train/jobs/{running}")
    assert stopped["failure_reason"] == "cancelled" and stopped["global_step"] < stopped["total_steps"]

    newest = stack.get(f"/v1/checkpoints?adapter={running_name}")["checkpoints"][-1]
    assert newest["global_step"] >= 2 and len(page.locator("#job-checkpoints tbody tr").all()) >= 1
    resume = page.locator("#job-checkpoints button.resume")
    expect(resume).to_have_count(1)  # only the newest checkpoint can be resumed from
    checkpoint = resume.locator("xpath=ancestor::tr").get_attribute("data-checkpoint")
    assert checkpoint == newest["resume_checkpoint"]
    resume.click()
    page.wait_for_url(re.compile(r".*#/train$"))
    expect(page.locator("#sft-resume-checkpoint")).to_have_value(checkpoint)
    expect(page.locator("#sft-output-name")).to_have_value(running_name)
    expect(page.locator("#sft-source-text")).to_be_checked()
    assert len(page.locator("#sft-dataset-text").input_value().splitlines()) == len(rows)
    page.click("#sft-preflight")
    expect(page.locator("#preflight-result")).to_have_attribute("data-status", "200")
    expect(page.locator("#preflight-result")).to_contain_text(checkpoint)
    page.click("#sft-submit")
    resumed = job_id_of(page)
    detail = stack.get(f"/v1/train/jobs/{resumed}")
    assert detail["adapter_name"] == running_name
    assert (
        stack.get(f"/v1/train/jobs/{resumed}")["replay_request"]["config"]["resume_checkpoint"] == checkpoint
    )
    assert stack.finish(resumed)["state"] in ("completed", "failed")


# ----- errors ---------------------------------------------------------------------------------


def test_a_refused_field_shows_the_servers_message_next_to_it(tab, stack):
    page = tab.page
    before = len(stack.jobs())
    page.goto("/#/train")
    expect(page.locator("#sft-epochs")).to_have_value("3")
    page.fill("#sft-lora-rank", "4")
    page.fill("#sft-lora-alpha", "100")
    page.click("#sft-submit")
    alpha = page.locator("#sft-lora-alpha-error")
    expect(alpha).to_contain_text("unsafe LoRA scaling: lora_alpha/lora_rank = 100/4")
    expect(page.locator("#sft-lora-alpha")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#sft-lora-alpha")).to_be_focused()

    page.fill("#sft-lora-alpha", "8")
    page.fill("#sft-epochs", "0")
    page.click("#sft-submit")
    expect(page.locator("#sft-epochs-error")).to_contain_text("config.epochs")
    expect(alpha).to_have_text("")

    page.fill("#sft-epochs", "1")
    page.select_option("#sft-optimizer", "adam_w")
    expect(page.locator("#sft-learning-rate-default")).to_have_text("0.0001")
    page.fill("#sft-adamw-beta1", "1")
    page.click("#sft-preflight")
    expect(page.locator("#sft-adamw-beta1-error")).to_contain_text("beta1 must be in [0, 1)")
    assert len(stack.jobs()) == before


def test_a_job_that_will_not_fit_shows_the_413_breakdown(tab, stack):
    page = tab.page
    before = len(stack.jobs())
    long_row = {
        "messages": [{"role": "user", "content": "Write."}, {"role": "assistant", "content": "word " * 20000}]
    }
    page.goto("/#/train")
    page.check("#sft-source-text")
    page.fill("#sft-dataset-text", json.dumps(long_row))
    page.fill("#sft-lora-rank", "4")
    page.fill("#sft-lora-alpha", "8")
    page.click("#sft-preflight")
    result = page.locator("#preflight-result")
    expect(result).to_have_attribute("data-status", "413")
    expect(result).to_contain_text("Estimated training step working set is")
    expect(result.locator(".memory")).to_have_attribute("data-fits", "false")
    expect(result.locator(".against-budget .seg")).to_have_count(6)  # the resident weights are not drawn
    for part in ("activations", "loss_workspace", "lora_param_grad", "safety_margin"):
        expect(result.locator(f".legend li[data-part='{part}']")).to_contain_text(
            re.compile(r"\d+(\.\d+)? (B|KiB|MiB|GiB)")
        )
    expect(result.locator(".legend")).to_contain_text(f"budget {TRAINING_MEMORY_GB * 1024:.0f} MiB")
    tab.shot("train-413", DESKTOP)
    page.click("#sft-submit")
    banner = page.locator("#sft-error")
    expect(banner).to_have_attribute("data-status", "413")
    expect(banner.locator(".makeup .seg")).to_have_count(6)
    assert len(stack.jobs()) == before


# ----- user text in a refusal ---------------------------------------------------------------


def test_user_text_in_a_refusal_is_shown_as_text(tab, stack):
    page = tab.page
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": XSS_TEXT, "content": "x"}]}
    page.goto("/#/train")
    page.check("#sft-source-text")
    page.fill("#sft-dataset-text", json.dumps(row))
    page.click("#sft-submit")
    error = page.locator("#sft-dataset-text-error")
    expect(error).to_contain_text(f"messages[1].role is '{XSS_TEXT}'")
    expect(page.locator("main img")).to_have_count(0)


# ----- keyboard only --------------------------------------------------------------------------


def test_a_job_can_be_submitted_with_the_keyboard_alone(tab, stack):
    page = tab.page
    adapter = name("keys")
    page.goto("/#/train")
    expect(page.locator("#sft-epochs")).to_have_value("3")
    tab_to(page, "sft-output-name")
    page.keyboard.type(adapter)
    tab_to(page, "sft-epochs")
    page.keyboard.press("Control+A")
    page.keyboard.type("1")
    tab_to(page, "sft-lora-rank")
    page.keyboard.press("Control+A")
    page.keyboard.type("4")
    tab_to(page, "sft-lora-alpha")
    page.keyboard.press("Control+A")
    page.keyboard.type("8")
    tab_to(page, "sft-submit")
    page.keyboard.press("Enter")
    job_id = job_id_of(page)
    detail = stack.get(f"/v1/train/jobs/{job_id}")
    assert detail["adapter_name"] == adapter
    assert (
        detail["replay_request"]["config"]["epochs"] == 1
        and detail["replay_request"]["config"]["lora_rank"] == 4
    )
    stack.finish(job_id)


# ----- every field of the form ----------------------------------------------------------------


def test_every_sft_field_reaches_the_request(tab, stack):
    """Each control of the automation contract that no other test sends (seed, learning rate, an
    optimizer's own fields, anomaly detection, warm start) ends up in the admitted config."""
    page = tab.page
    base = name("warm")
    first = stack.submit({"examples": [example(0), example(1)], "config": {**SMALL, "output_name": base}})
    assert stack.wait(first, lambda d: d["state"] in ("completed", "failed"))["state"] == "completed"
    adapter = name("fields")
    page.goto("/#/train")
    expect(page.locator("#sft-epochs")).to_have_value("3")
    page.fill("#sft-output-name", adapter)
    page.fill("#sft-epochs", "2")
    page.fill("#sft-lora-rank", "4")
    page.fill("#sft-lora-alpha", "8")
    page.select_option("#sft-optimizer", "adam_w")
    expect(page.locator("#sft-adamw-beta1")).to_have_value("0.9")  # its own fields, with their defaults
    expect(page.locator("#sft-muon-momentum")).to_be_hidden()
    page.fill("#sft-adamw-beta2", "0.95")
    page.fill("#sft-adamw-weight-decay", "0.01")
    page.fill("#sft-learning-rate", "0.0002")
    page.fill("#sft-seed", "12345")
    page.click("#sft-advanced summary")
    page.select_option("#sft-invalid-row-policy", "skip")
    page.check("#sft-detect-anomaly")
    page.fill("#sft-checkpoint-interval", "2")
    page.select_option("#sft-base-adapter", base)
    page.fill("#sft-grad-checkpoint-segments", "1")
    page.click("#sft-submit")
    job_id = job_id_of(page)
    config = stack.get(f"/v1/train/jobs/{job_id}")["replay_request"]["config"]
    stack.finish(job_id)
    assert config["output_name"] == adapter and config["epochs"] == 2
    assert (config["lora_rank"], config["lora_alpha"]) == (4, 8)
    optimizer = config["optimizer"]
    assert optimizer["kind"] == "adam_w" and (optimizer["beta1"], optimizer["beta2"]) == (0.9, 0.95)
    assert optimizer["weight_decay"] == 0.01
    assert config["learning_rate"] == 0.0002 and str(config["seed"]) == "12345"
    assert config["invalid_row_policy"] == "skip" and config["detect_anomaly"] is True
    assert config["checkpoint_interval"] == 2 and config["grad_checkpoint_segments"] == 1
    assert config["base_adapter"] == base
