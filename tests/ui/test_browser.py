"""The browser UI in a real browser (Debian's Chromium through Playwright) against a live
`kiln up`: real api and worker processes, SQLite, the tiny model.

Each test uses the page the way a person does (the element ids are the UI's automation
contract) and checks what the page shows against the server's own answers: the stored file,
the jobs the api lists, `kiln data inspect --json`. No test injects script; the page runs under
its strict Content-Security-Policy, and a script error or dialog fails the test.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.api.conftest import example
from tests.ui.conftest import (
    DESKTOP,
    PHONE,
    TRAINING_MEMORY_GB,
    clean_env,
    free_port,
    http,
    open_tab,
)

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo.jsonl"
BAD_ROLE = {"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]}
XSS_TEXT = "<img src=x onerror=alert(1)>"
XSS_ROW = {
    "messages": [
        {"role": "user", "content": XSS_TEXT},
        {
            "role": "assistant",
            "content": "<script>alert(2)</script> fine",
            "reasoning_content": "<b>bold?</b>",
        },
    ]
}
SMALL = {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0}


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def job_id_of(page) -> str:
    page.wait_for_url(re.compile(r".*#/jobs/.+"))
    return page.url.split("#/jobs/", 1)[1]


def wait_for_health(proc, base: str, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if http(base + "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{base} did not answer within {timeout}s")


def documents(tab) -> list[str]:
    return [r.url for r in tab.requests if r.resource_type == "document"]


# ----- overview -------------------------------------------------------------------------------


def test_the_overview_shows_runner_model_backend_memory_queue_and_the_guide(tab, stack):
    page = tab.page
    page.goto("/#/")
    expect(page.locator("#overview-runner")).to_have_text("alive")
    health = stack.get("/health")
    runner = health["runner"]
    expect(page.locator("#overview-runner-detail")).to_contain_text(runner["id"])
    expect(page.locator("#overview-model")).to_have_text(runner["model_path"])
    expect(page.locator("#overview-device")).to_contain_text(runner["device"])
    expect(page.locator("#overview-backend")).to_have_text(runner["backend"])
    expect(page.locator("#overview-memory")).to_contain_text(re.compile(r"free of \d+(\.\d+)? GiB"))
    expect(page.locator("#overview-memory-detail")).to_contain_text(
        f"training capped at {TRAINING_MEMORY_GB} GiB"
    )
    expect(page.locator("#overview-queue")).to_have_text(re.compile(r"^\d+ queued$"))
    expect(page.locator("#overview-guide li")).to_have_count(3)  # worker, the sample, an adapter
    expect(page.locator("#overview-guide li.done")).to_have_count(1)  # a worker is up
    expect(page.locator("#overview-guide a[href='#/train']")).to_be_visible()


# ----- train: upload, preflight, submit, watch ------------------------------------------------


@pytest.mark.slow
def test_upload_preflight_submit_and_watch_the_job_to_its_adapter(tab, stack, tmp_path):
    page = tab.page
    data = tmp_path / "support.jsonl"
    # Demo conversations are long enough (about a second a step here) to watch the chart grow.
    data.write_text(jsonl([json.loads(line) for line in DEMO.read_text().splitlines()[6:10]] + [BAD_ROLE]))
    adapter = name("support")

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
    before = len(stack.jobs())
    page.click("#sft-preflight")
    result = page.locator("#preflight-result")
    expect(result).to_have_attribute("data-status", "200")
    expect(result).to_contain_text("4 kept, 1 rejected (of 5 read)")
    expect(result).to_contain_text("12 (3 epoch(s) × 4 row(s))")
    expect(result).to_contain_text("2 (as requested)")
    (rejection,) = info["stats"]["rejections"]
    row = page.locator("#preflight-rejected tbody tr")
    expect(row).to_have_count(1)
    expect(row).to_contain_text("5")
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
    expect(result.locator(".against-budget .seg")).to_have_count(7)
    expect(result.locator(".memory")).to_have_attribute("data-fits", "true")
    assert len(stack.jobs()) == before  # a preflight queues nothing

    page.dblclick("#sft-submit")  # a double click is one submission (one Idempotency-Key)
    job_id = job_id_of(page)
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
    assert len(stack.jobs()) == before + 1
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
    expect(result.locator(".against-budget .seg")).to_have_count(7)
    for part in ("activations", "loss_workspace", "lora_param_grad", "safety_margin"):
        expect(result.locator(f".legend li[data-part='{part}']")).to_contain_text(
            re.compile(r"\d+(\.\d+)? (B|KiB|MiB|GiB)")
        )
    expect(result.locator(".legend")).to_contain_text(f"budget {TRAINING_MEMORY_GB * 1024:.0f} MiB")
    tab.shot("train-413", DESKTOP)
    page.click("#sft-submit")
    banner = page.locator("#sft-error")
    expect(banner).to_have_attribute("data-status", "413")
    expect(banner.locator(".makeup .seg")).to_have_count(7)
    assert len(stack.jobs()) == before


# ----- the inspector and user text ------------------------------------------------------------


def test_the_inspector_marks_exactly_the_tokens_kiln_data_inspect_supervises(
    tab, stack, tmp_path, tiny_model_dir
):
    page = tab.page
    rows = [json.loads(line) for line in DEMO.read_text().splitlines()[:8]] + [XSS_ROW, BAD_ROLE]
    data = tmp_path / "inspect.jsonl"
    data.write_text(jsonl(rows))
    cli = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "data", "inspect", str(data), "--model", str(tiny_model_dir),
         "--policy", "skip", "--json"],
        capture_output=True, text=True, env=clean_env(), check=True,
    )  # fmt: skip
    *facts, receipt = [json.loads(line) for line in cli.stdout.splitlines()]

    page.goto("/#/inspect")
    page.set_input_files("#inspect-file", str(data))
    page.click("#inspect-run")
    expect(page.locator("#inspect-verdict")).to_contain_text(
        f"{receipt['rows_read']} row(s) read, {receipt['rows_kept']} kept, {receipt['rows_rejected']} rejected"
    )
    for fact in facts:
        article = page.locator(f"#inspect-result article[data-row='{fact['row_index']}']")
        expect(article.locator(".hash")).to_have_text(fact["row_sha256"])
        if "labels" in fact:
            supervised = [i for i, label in enumerate(fact["labels"]) if label != -100]
            marked = article.locator(".tok.supervised").evaluate_all(
                "els => els.map(e => Number(e.dataset.token))"
            )
            assert marked == supervised, fact["row_index"]
            expect(article.locator(".tok")).to_have_count(fact["seq_len"])
            expect(article.locator("header")).to_contain_text(
                f"tokens {fact['seq_len']} · supervised {fact['supervised_tokens']}"
            )
        else:
            expect(article.locator(".reason")).to_contain_text(f"REJECTED {fact['rejection']}")
    xss = page.locator(f"#inspect-result article[data-row='{len(rows) - 1}'] pre.rendering")
    expect(xss).to_contain_text(XSS_TEXT)
    expect(xss).to_contain_text("<script>alert(2)</script> fine")
    expect(page.locator("#inspect-result img, #inspect-result script, #inspect-result b")).to_have_count(0)
    tab.shot("inspector", DESKTOP)


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


def tab_to(page, element_id: str, limit: int = 60) -> None:
    for _ in range(limit):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement && document.activeElement.id") == element_id:
            return
    raise AssertionError(f"#{element_id} is not reachable with Tab")


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


# ----- adapters -------------------------------------------------------------------------------


def test_adapters_receipt_download_compare_and_delete(tab, stack, tmp_path):
    page = tab.page
    first, second = name("cmp-a"), name("cmp-b")
    a = stack.submit({"examples": [example(i) for i in range(3)], "config": {**SMALL, "output_name": first}})
    b = stack.submit({"examples": [example(i) for i in range(2)], "config": {**SMALL, "output_name": second}})
    for job in (a, b):
        assert stack.wait(job, lambda d: d["state"] in ("completed", "failed"))["state"] == "completed"
    info = {x["name"]: x for x in stack.get("/v1/adapters")["adapters"]}[first]

    page.goto("/#/adapters")
    row = page.locator(f"#adapters-table tr[data-adapter='{first}']")
    row.locator("button.receipt").click()
    seed = stack.get(f"/v1/adapters/{first}/receipt")["hyperparameters"]["seed"]
    expect(page.locator("#adapter-receipt")).to_contain_text(f"Receipt of {first}")
    expect(page.locator("#adapter-receipt")).to_contain_text(seed)

    with page.expect_download() as download:
        row.locator("button.download").click()
    archive = tmp_path / "adapter.tar.gz"
    download.value.save_as(archive)
    with tarfile.open(archive) as tar:
        weights = tar.extractfile(f"{first}/adapter_model.safetensors").read()
    assert "sha256:" + hashlib.sha256(weights).hexdigest() == info["safetensors_sha256"]

    page.select_option("#compare-a", a)
    page.select_option("#compare-b", b)
    page.click("#compare-run")
    expect(page.locator("#compare-chart")).to_have_attribute("data-points", "3")  # steps 1..3 and 1..2

    delete = row.locator("button.danger")
    delete.click()
    expect(delete).to_have_text("Confirm delete")
    delete.click()
    expect(row).to_have_count(0)
    assert stack.api("GET", f"/v1/adapters/{first}/receipt")[0] == 404
    assert not (stack.root / "adapters" / first).exists()


# ----- every page, at desktop and phone sizes ---------------------------------------------------


def test_every_page_fits_a_phone_and_a_desktop(tab, stack):
    page = tab.page
    if not any(job["state"] == "completed" for job in stack.jobs()):  # rows to measure: a job, an adapter
        job = stack.submit(
            {"examples": [example(0), example(1)], "config": {**SMALL, "output_name": name("fit")}}
        )
        stack.wait(job, lambda d: d["state"] in ("completed", "failed"))
    for route in ("", "train", "jobs", "inspect", "adapters"):
        for viewport in (DESKTOP, PHONE):
            page.set_viewport_size(viewport)
            page.goto(f"/#/{route}")
            expect(page.locator(f"#page-{route or 'overview'}")).to_be_visible()
            if route == "":
                expect(page.locator("#overview-runner")).to_have_text("alive")
            page.wait_for_load_state("networkidle")
            width = page.evaluate("document.scrollingElement.scrollWidth")
            assert width <= viewport["width"], (route, viewport, width)  # nothing scrolls sideways
            heights = page.locator("main table:visible tbody tr").evaluate_all(
                "rows => rows.map(r => r.getBoundingClientRect().height)"
            )
            # an id or a hash wraps in a few lines; a row a screen tall is not a list one can read
            assert max(heights, default=0) <= 160, (route, viewport, heights)
            tab.shot(route or "overview", viewport)


def test_the_page_runs_under_a_strict_content_security_policy(tab, stack):
    response = tab.page.goto("/")
    assert response.status == 200
    policy = response.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "script-src 'self'" in policy and "unsafe-inline" not in policy
    assert response.headers["x-content-type-options"] == "nosniff"
    html = response.text()
    assert "<script>" not in html and " style=" not in html and " onclick=" not in html
    # no third-party origin is ever asked for anything
    origins = {re.match(r"https?://[^/]+", r.url).group(0) for r in tab.requests if r.url.startswith("http")}
    assert origins == {stack.url}


# ----- sign-in with api tokens ----------------------------------------------------------------


def test_with_api_tokens_the_page_asks_for_one_and_sends_it_as_a_bearer(browser, stack):
    port = free_port()
    secret = "ui-" + uuid.uuid4().hex
    log = stack.root.parent / f"{stack.root.name}-tokens.log"
    env = clean_env(
        KILN_STORAGE_ROOT=str(stack.root), KILN_SERVER_PORT=str(port), KILN_SERVER_API_TOKENS=secret
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli.main", "serve", "--workers", "1"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_health(proc, base, log)
        assert http(base + "/v1/config")[0] == 401  # the api itself wants the token
        context, tab = open_tab(browser, base)
        page = tab.page
        page.goto("/")
        expect(page.locator("#login")).to_be_visible()
        expect(page.locator("#page-overview")).to_be_hidden()
        page.fill("#auth-token", "wrong-token")
        page.click("#auth-submit")
        expect(page.locator("#auth-error")).to_contain_text("not accepted")
        page.fill("#auth-token", secret)
        page.click("#auth-submit")
        expect(page.locator("#overview-runner")).to_have_text("alive")
        expect(page.locator("#login")).to_be_hidden()
        assert page.evaluate("sessionStorage.getItem('kiln-api-token')") == secret
        assert context.cookies() == []
        api_calls = [r for r in tab.requests if "/v1/" in r.url]
        assert api_calls and all(
            r.headers.get("authorization", "").startswith("Bearer ") for r in api_calls[-3:]
        )
        assert "cookie" not in {k.lower() for r in api_calls for k in r.headers}
        page.reload()
        expect(page.locator("#overview-runner")).to_have_text("alive")  # same tab: still signed in
        tab.shot("sign-in-done", DESKTOP)
        context.close()
        assert tab.errors == [] and tab.dialogs == []
        other, fresh = open_tab(browser, base)
        fresh.page.goto("/")
        expect(fresh.page.locator("#login")).to_be_visible()  # another tab asks again
        fresh.shot("sign-in", PHONE)
        other.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
