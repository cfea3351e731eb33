"""Test data and small page helpers shared by the browser tests."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

from tests.ui.conftest import http

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo.jsonl"
INSTRUCTION = REPO / "examples" / "instruction.jsonl"
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


def tab_to(page, element_id: str, limit: int = 60) -> None:
    for _ in range(limit):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement && document.activeElement.id") == element_id:
            return
    raise AssertionError(f"#{element_id} is not reachable with Tab")
