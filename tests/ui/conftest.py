# ruff: noqa: F811  (fixtures imported from tests.api.conftest are used as parameters below)
"""Fixtures for the browser tests: a live `kiln up` (real api and worker processes, SQLite, the
tiny model) per module, Debian's Chromium driven by Playwright (no browser download), and the
directory screenshots are kept in (`UI_TEST_ARTIFACTS`, default tests/ui/artifacts/, printed at
the end of the run).

The stack caps training memory at `TRAINING_MEMORY_GB` so a very long row is a real 413 while
ordinary rows fit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import tiny_model_dir  # noqa: F401  (re-exported for this package)

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(os.environ.get("UI_TEST_ARTIFACTS") or Path(__file__).parent / "artifacts")
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
TRAINING_MEMORY_GB = 0.2
START_TIMEOUT_S = 240
KILN = [sys.executable, "-m", "kiln_cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(extra)
    return env


def http(url: str, method: str = "GET", body: Any = None, headers: dict | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    sent = (
        {"Content-Type": "application/json", **(headers or {})} if body is not None else dict(headers or {})
    )
    request = urllib.request.Request(url, data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw else None


@dataclass
class Stack:
    """A running `kiln up` and what the tests ask of it over HTTP."""

    url: str
    root: Path
    proc: subprocess.Popen
    log: Path

    def api(self, method: str, path: str, body: Any = None, headers: dict | None = None) -> tuple[int, Any]:
        return http(self.url + path, method, body, headers)

    def get(self, path: str) -> Any:
        status, body = self.api("GET", path)
        assert status == 200, (path, status, body)
        return body

    def jobs(self) -> list[dict]:
        return self.get("/v1/train/status")

    def submit(self, body: dict) -> str:
        status, answer = self.api("POST", "/v1/train/sft", body)
        assert status == 200, answer
        return answer["job_id"]

    def wait(self, job_id: str, until, timeout: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            detail = self.get(f"/v1/train/jobs/{job_id}")
            if until(detail):
                return detail
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} did not get there within {timeout}s: {detail['state']}")

    def finish(self, job_id: str) -> dict:
        """Cancel the job unless it already ended, and wait until it has."""
        detail = self.get(f"/v1/train/jobs/{job_id}")
        if detail["state"] not in ("completed", "failed"):
            self.api("DELETE", f"/v1/train/queue/{job_id}")
        return self.wait(job_id, lambda d: d["state"] in ("completed", "failed"), 120)


def start_up(root: Path, port: int, model_dir: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [*KILN, "up", "--root", str(root), "--port", str(port), "--model-path", str(model_dir)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for_line(proc: subprocess.Popen, log: Path, text: str, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"kiln up exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.3)
    raise AssertionError(f"no {text!r} within {timeout}s:\n{log.read_text()[-4000:]}")


def stop_up(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("ui-stack")
    port = free_port()
    log = root.parent / f"{root.name}-kiln-up.log"
    env = clean_env(
        KILN_SERVER_WORKERS="1",
        KILN_TRAINING_HEARTBEAT_SECONDS="1",
        KILN_MEMORY_TRAINING_MEMORY_GB=str(TRAINING_MEMORY_GB),
    )
    proc = start_up(root, port, tiny_model_dir, env, log)
    try:
        wait_for_line(proc, log, "worker ready")
        yield Stack(f"http://127.0.0.1:{port}", root, proc, log)
    finally:
        code = stop_up(proc)
    assert code == 128 + signal.SIGINT, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert CHROMIUM.is_file(), (
        "Debian's chromium is missing: scripts/test installs it (apt-get install chromium)"
    )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@dataclass
class Tab:
    """A page of a fresh browser context and what it reported: script errors (a blocked script or
    style shows up here as a CSP violation), dialogs (an injected alert() would) and requests."""

    page: Any
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    requests: list[Any] = field(default_factory=list)

    def shot(self, name: str, viewport: dict | None = None) -> Path:
        if viewport is not None:
            self.page.set_viewport_size(viewport)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        size = self.page.viewport_size
        path = ARTIFACTS / f"{name}-{size['width']}x{size['height']}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


def open_tab(browser, base_url: str, viewport: dict = DESKTOP) -> tuple[Any, Tab]:
    context = browser.new_context(viewport=viewport, base_url=base_url, accept_downloads=True)
    tab = Tab(context.new_page())

    def console(message) -> None:
        # A refused request (the 400s and 413s the tests provoke) is logged as "Failed to load
        # resource"; anything else at error level is a fault of the page.
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            tab.errors.append(message.text)

    def dialog(d) -> None:
        tab.dialogs.append(d.message)
        d.dismiss()

    tab.page.on("console", console)
    tab.page.on("pageerror", lambda exc: tab.errors.append(str(exc)))
    tab.page.on("dialog", dialog)
    tab.page.on("request", lambda request: tab.requests.append(request))
    return context, tab


@pytest.fixture
def tab(browser, stack) -> Iterator[Tab]:
    context, tab = open_tab(browser, stack.url)
    yield tab
    context.close()
    assert tab.errors == []
    assert tab.dialogs == []


def pytest_terminal_summary(terminalreporter) -> None:
    if ARTIFACTS.is_dir() and any(ARTIFACTS.glob("*.png")):
        terminalreporter.write_line(f"browser screenshots: {ARTIFACTS}")
