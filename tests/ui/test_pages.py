"""The overview, the inspector, the adapters page, every page at phone and desktop sizes, the
Content-Security-Policy and sign-in with api tokens, in a real browser (Debian's Chromium through
Playwright) against a live `kiln up`: real api and worker processes, SQLite, the tiny model.

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
import uuid

import pytest
from playwright.sync_api import expect

from tests.api.conftest import example
from tests.ui.conftest import DESKTOP, PHONE, TRAINING_MEMORY_GB, clean_env, free_port, http, open_tab
from tests.ui.page_support import (
    BAD_ROLE,
    DEMO,
    INSTRUCTION,
    SMALL,
    XSS_ROW,
    XSS_TEXT,
    jsonl,
    name,
    wait_for_health,
)

pytestmark = pytest.mark.timeout(600)


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


# ----- the inspector ------------------------------------------------------------


def test_the_inspector_marks_exactly_the_tokens_kiln_data_inspect_supervises(
    tab, stack, tmp_path, tiny_model_dir
):
    page = tab.page
    instruction = [json.loads(line) for line in INSTRUCTION.read_text().splitlines()]
    rows = (
        [json.loads(line) for line in DEMO.read_text().splitlines()[:8]]
        + instruction[-3:]
        + [XSS_ROW, BAD_ROLE]
    )
    data = tmp_path / "inspect.jsonl"
    data.write_text(jsonl(rows))
    cli = subprocess.run(
        [sys.executable, "-m", "kiln_cli.main", "data", "inspect", str(data), "--model", str(tiny_model_dir),
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
        expect(article.locator(".line")).to_have_text(f"line {fact['line']}")
        if fact["format"] is not None:
            expect(article.locator(".format")).to_have_text(fact["format"])
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
    formats = [f["format"] for f in facts]
    assert {"instruction", "prompt_completion", "text_prompt_completion", "messages"} <= set(formats)
    tab.shot("inspector", DESKTOP)


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
            # (on a phone a row is a card of labelled cells: at most a quarter of the screen)
            tallest = 160 if viewport is DESKTOP else viewport["height"] / 4
            assert max(heights, default=0) <= tallest, (route, viewport, heights)
            if viewport is PHONE:  # a phone shows every cell on screen, labelled with its column
                cells = page.locator("main table:visible tbody td:visible").evaluate_all(
                    "cells => cells.map(c => [c.getBoundingClientRect().right, c.dataset.label ?? null,"
                    " getComputedStyle(c, '::before').content, c.closest('table').id])"
                )
                assert all(right <= viewport["width"] for right, *_ in cells), (route, cells)
                labelled = [(label, before) for _, label, before, _ in cells if label is not None]
                assert all(before == f'"{label}"' for label, before in labelled), (route, labelled)
                if route == "jobs":
                    assert {"Loss", "ETA", "Progress"} <= {label for label, _ in labelled}, labelled
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
            [sys.executable, "-m", "kiln_cli.main", "serve", "--workers", "1"],
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
