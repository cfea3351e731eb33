"""A newcomer's first hour in the browser, against a live `kiln up`: every page when the api is
unreachable, answers a 5xx or a 4xx (a sentence and a Retry that recovers), the form's alpha
following its rank, `allow_high_lora_scale` under SFT Advanced, the demo's settings beside the
server's defaults, and the whole path from the sample to a downloaded adapter with no "null",
"undefined", "NaN" or a stuck "…" on any screen.

The failures are made with Playwright's request routing (the page's own requests are aborted or
answered with an error envelope); nothing is injected into the page.
"""

from __future__ import annotations

import json
import re
import tarfile

import pytest
from playwright.sync_api import expect

from tests.api.conftest import example
from tests.ui.page_support import DEMO, SMALL, job_id_of, name

pytestmark = pytest.mark.timeout(600)

API = re.compile(r".*/(v1/.*|health)(\?.*)?$")
PAGES = ["/#/", "/#/train", "/#/jobs", "/#/jobs/no-such-job", "/#/inspect", "/#/adapters"]
BAD_WORDS = ("null", "undefined", "NaN", "…")
SERVER_ERROR = {"error": {"code": "internal_error", "message": "the job store failed", "hint": None}}


def assert_clean(page, where: str) -> None:
    """The visible text of the page names no missing value and leaves no placeholder."""
    # the one place the page names NaN on purpose: the anomaly-detection option's explanation
    text = page.locator("body").inner_text().replace("produces NaN/Inf", "")
    for word in BAD_WORDS:
        found = re.search(rf"(?<![A-Za-z]){re.escape(word)}(?![A-Za-z])", text)
        assert found is None, (
            f"{where}: {word!r} on screen: ...{text[max(0, found.start() - 80) : found.end() + 80]}..."
        )


def unreachable(route) -> None:
    route.abort("connectionrefused")


def server_error(route) -> None:
    route.fulfill(status=500, content_type="application/json", body=json.dumps(SERVER_ERROR))


@pytest.mark.parametrize("path", PAGES)
def test_every_page_says_when_the_api_cannot_be_reached_and_retries(tab, stack, path):
    page = tab.page
    page.route(API, unreachable)
    page.goto(path)
    banner = page.locator("#global-error")
    expect(banner).to_contain_text("cannot be reached: is it running? Start it with kiln up")
    expect(banner).to_have_attribute("data-status", "0")
    if path == "/#/":
        expect(page.locator("#overview-runner")).to_have_text("unknown")  # never left on "…"
    assert_clean(page, f"{path} unreachable")
    page.unroute(API)
    banner.locator("button.retry").click()
    if path == "/#/jobs/no-such-job":
        expect(banner).to_contain_text("Not found (training_job_not_found, HTTP 404)")
        expect(banner.locator("button.retry")).to_be_visible()
    else:
        expect(banner).to_be_hidden()
    if path == "/#/":
        expect(page.locator("#overview-runner")).to_have_text("alive")
    assert_clean(page, f"{path} after retry")


@pytest.mark.parametrize("path", PAGES)
def test_every_page_explains_a_server_error_with_a_retry(tab, stack, path):
    page = tab.page
    page.route(API, server_error)
    page.goto(path)
    banner = page.locator("#global-error")
    expect(banner).to_contain_text(
        "The Kiln api failed while answering (internal_error, HTTP 500): the job store failed."
    )
    expect(banner).to_contain_text("logs/serve.log")
    expect(banner.locator("button.retry")).to_be_visible()
    assert_clean(page, f"{path} 500")


def test_a_refused_page_request_names_the_refusal(tab, stack):
    page = tab.page
    page.route(
        re.compile(r".*/v1/datasets$"),
        lambda route: route.fulfill(
            status=403,
            content_type="application/json",
            body=json.dumps({"error": {"code": "forbidden", "message": "this token may not list datasets"}}),
        ),
    )
    page.goto("/#/adapters")
    banner = page.locator("#global-error")
    expect(banner).to_contain_text(
        "The Kiln api refused the request (forbidden, HTTP 403): this token may not list datasets"
    )
    expect(banner.locator("button.retry")).to_be_visible()
    page.unroute(re.compile(r".*/v1/datasets$"))
    banner.locator("button.retry").click()
    expect(banner).to_be_hidden()


def test_preflight_and_submit_without_an_api_say_so_and_retry(tab, stack):
    page = tab.page
    page.goto("/#/train")
    expect(page.locator("#sft-epochs")).to_have_value("3")
    page.route(API, unreachable)
    page.route(re.compile(r".*/ui/sample\.jsonl$"), unreachable)
    page.click("#sft-preflight")
    error = page.locator("#sft-error")
    expect(error).to_contain_text("cannot be reached: is it running? Start it with kiln up")
    assert "Failed to fetchnull" not in error.inner_text()
    assert_clean(page, "preflight unreachable")
    page.unroute(API)
    page.unroute(re.compile(r".*/ui/sample\.jsonl$"))
    error.locator("button.retry").click()
    expect(page.locator("#preflight-result h2")).to_have_text("Preflight: would be admitted")
    expect(error).to_be_hidden()
    page.route(re.compile(r".*/v1/train/sft$"), server_error)
    page.click("#sft-submit")
    expect(error).to_contain_text("failed while answering (internal_error, HTTP 500)")
    expect(error.locator("button.retry")).to_be_visible()


def test_alpha_follows_the_rank_until_it_is_chosen(tab, stack):
    page = tab.page
    page.goto("/#/train")
    defaults = stack.get("/ui/defaults.json")
    rank, alpha = page.locator("#sft-lora-rank"), page.locator("#sft-lora-alpha")
    expect(rank).to_have_value(str(defaults["config"]["lora_rank"]))
    expect(alpha).to_have_value(f"{defaults['config']['lora_alpha']:g}")
    rank.fill("4")
    expect(alpha).to_have_value("8")
    rank.fill("12")
    expect(alpha).to_have_value("24")
    alpha.fill("30")
    rank.fill("20")
    expect(alpha).to_have_value("30")  # chosen by hand: it stays
    rank.fill("4")  # 30 / 4 = 7.5 exceeds the limit
    page.click("#sft-preflight")
    expect(page.locator("#sft-error")).to_contain_text("allow_high_lora_scale")
    allow = page.locator("#sft-allow-high-lora-scale")
    expect(allow).to_be_hidden()  # under SFT Advanced
    page.click("#sft-advanced summary")
    expect(allow).not_to_be_checked()
    expect(page.locator("#sft-advanced")).to_contain_text(
        f"Above {defaults['max_lora_alpha_over_rank']:g} a run is refused unless this is on"
    )
    allow.check()
    with page.expect_request(re.compile(r".*/v1/train/sft/preflight$")) as sent:
        page.click("#sft-preflight")
    config = sent.value.post_data_json["config"]
    assert (config["lora_rank"], config["lora_alpha"], config["allow_high_lora_scale"]) == (4, 30, True)
    expect(page.locator("#preflight-result h2")).to_have_text("Preflight: would be admitted")


def test_the_form_shows_the_servers_defaults_and_how_the_demo_differs(tab, stack):
    page = tab.page
    page.goto("/#/train")
    defaults = stack.get("/ui/defaults.json")
    demo, kind = defaults["demo"], defaults["config"]["optimizer"]["kind"]
    expect(page.locator("#sft-optimizer")).to_have_value(kind)
    expect(page.locator("#sft-learning-rate-default")).to_have_text(str(defaults["learning_rate"][kind]))
    note = page.locator("#sft-demo-note")
    expect(note).to_contain_text(f"optimizer {demo['optimizer']} (the server's default is {kind})")
    expect(note).to_contain_text(f"learning rate {demo['learning_rate']}")
    expect(note).to_contain_text(f"seed {demo['seed']}")
    page.click("#sft-demo-settings")
    expect(page.locator("#sft-optimizer")).to_have_value(demo["optimizer"])
    expect(page.locator("#sft-learning-rate")).to_have_value(str(demo["learning_rate"]))
    expect(page.locator("#sft-seed")).to_have_value(str(demo["seed"]))
    expect(page.locator("#sft-source-sample")).to_be_checked()


def test_the_newcomer_path_from_the_sample_to_a_downloaded_adapter(tab, stack, tmp_path):
    page = tab.page
    page.goto("/#/")
    expect(page.locator("#overview-runner")).to_have_text("alive")
    expect(page.locator("#overview-queue")).to_have_text(re.compile(r"^\d+ queued$"))
    expect(page.locator("#overview-model-random")).to_contain_text("A random tiny checkpoint")
    assert_clean(page, "overview")

    page.click("header nav a[data-page='train']")
    expect(page.locator("#sft-source-sample")).to_be_checked()
    adapter = name("first")
    page.fill("#sft-output-name", adapter)
    page.click("#sft-advanced summary")
    page.check("#sft-adapter-smoke-test")  # the canaries, as the demo runs them
    page.click("#sft-preflight")
    result = page.locator("#preflight-result")
    expect(result.locator("h2")).to_have_text("Preflight: would be admitted")
    expect(result).to_contain_text("differs from a stored dataset's sha256")
    expect(result.locator(".legend li[data-part='base_weights']")).to_have_count(0)  # never "weights 0 B"
    expect(result).to_contain_text("The base model's weights are not in it")
    assert_clean(page, "preflight")

    page.click("#sft-submit")
    job_id = job_id_of(page)
    chart = page.locator("#job-loss-chart")
    expect(page.locator("#job-state")).to_have_text("completed", timeout=300_000)
    expect(chart).not_to_have_attribute("data-points", "0")
    expect(chart.locator(".u-legend")).not_to_contain_text("validation loss")  # no validation in this run
    expect(page.locator("#job-receipt")).to_contain_text("mean step time")
    expect(page.locator("#job-checkpoints")).not_to_contain_text("None yet")
    model = stack.get(f"/v1/train/jobs/{job_id}")["model"]
    assert model["random_init"]["preset"] == "tiny"
    expect(page.locator("#job-model")).to_have_text(
        f"model {model['path']} (a random tiny checkpoint: the run shows the mechanics, not a useful model)"
    )
    expect(page.locator("#canary-table")).to_be_visible()
    expect(page.locator("#canary-random")).to_contain_text(
        "The base model is a random checkpoint (preset tiny, seed 0)"
    )
    assert_clean(page, "completed job")
    job_step_time = page.locator("#receipt-summary dt:text-is('mean step time') + dd").inner_text()
    assert re.fullmatch(r"\d+ ms", job_step_time), job_step_time
    assert stack.get(f"/v1/train/jobs/{job_id}")["adapter_name"] == adapter

    page.click("header nav a[data-page='adapters']")
    row = page.locator(f"#adapters-table tr[data-adapter='{adapter}']")
    row.locator("button.receipt").click()
    expect(page.locator("#adapter-receipt")).to_contain_text(f"Receipt of {adapter}")
    expect(page.locator("#adapter-receipt #canary-random")).to_be_visible()
    receipt_step_time = page.locator("#adapter-receipt dt:text-is('mean step time') + dd").inner_text()
    assert receipt_step_time == job_step_time  # the same run, the same figure on both pages
    assert_clean(page, "adapters")
    with page.expect_download() as download:
        row.locator("button.download").click()
    archive = tmp_path / "adapter.tar.gz"
    download.value.save_as(archive)
    with tarfile.open(archive) as tar:
        assert f"{adapter}/adapter_model.safetensors" in tar.getnames()


def test_an_upload_keeps_its_message(tab, stack):
    page = tab.page
    page.goto("/#/train")
    page.check("#sft-source-file")
    page.set_input_files("#sft-dataset-file", str(DEMO))
    page.fill("#sft-dataset-name", name("kept") + ".jsonl")
    page.click("#sft-dataset-upload")
    message = page.locator("#sft-dataset-upload-result")
    expect(message).to_contain_text("Stored ")
    expect(page.locator("#sft-source-stored")).to_be_checked()
    expect(message).to_be_visible()  # still there once the form shows the stored dataset


def test_a_queued_job_says_where_its_chart_will_be_and_a_finished_one_why_no_checkpoint(tab, stack):
    page = tab.page
    busy = stack.submit({"examples": [example(0), example(1)], "config": {**SMALL, "epochs": 500}})
    queued = stack.submit({"examples": [example(2)], "config": SMALL})
    try:
        stack.wait(busy, lambda d: d["state"] == "running")
        page.goto(f"/#/jobs/{queued}")
        expect(page.locator("#job-state")).to_have_text("queued")
        chart = page.locator("#job-loss-chart")
        expect(chart).to_have_text("The loss curve appears here after the first training step.")
        expect(chart.locator(".u-legend")).to_have_count(0)
        expect(page.locator("#job-checkpoints")).to_contain_text(
            "None yet: one is written every checkpoint interval"
        )
        assert_clean(page, "queued job")
    finally:
        stack.finish(busy)
        stack.finish(queued)
    page.goto(f"/#/jobs/{busy}")
    expect(page.locator("#job-state")).to_have_text("failed")
    expect(page.locator("#job-checkpoints")).not_to_contain_text("None yet")
    assert_clean(page, "cancelled job")
