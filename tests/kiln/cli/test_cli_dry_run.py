# ruff: noqa: F811  (fixtures imported from tests.kiln.cli.test_cli_client are used as parameters below)
"""`kiln train sft --dry-run`: the request goes to the preflight; the plan is printed, the
server's refusal is reported exactly as a submission's, and nothing is ever queued."""

from __future__ import annotations

import json
import re

from tests.api.conftest import example, runner_kwargs, tiny_model_dir  # noqa: F401
from tests.kiln.cli.test_cli_client import http_json, kiln, name, server, write_jsonl  # noqa: F401


def test_dry_run_prints_the_plan_and_queues_nothing(kiln, server, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [example(i) for i in range(3)])
    jobs_before = http_json(server, "GET", "/v1/train/status")
    flags = ["--data", str(data), "--epochs", "2", "--rank", "4", "--alpha", "8", "--output-name", name()]
    code, out, err = kiln("train", "sft", *flags, "--dry-run", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert (plan["rows_kept"], plan["total_steps"], plan["drawn"]) == (3, 6, ["seed"])
    assert server.recorder.posts()[-1].path == "/v1/train/sft/preflight"
    code, out, err = kiln("train", "sft", *flags, "--dry-run")
    assert code == 0, err
    assert out.startswith("preflight: would admit 3 row(s) x 2 epoch(s) = 6 step(s)")
    assert re.search(r"^  rows +3 kept, 0 rejected \(of 3 read\)$", out, re.M)
    assert re.search(r"^  seed +drawn at submission$", out, re.M)
    assert re.search(rf"^  largest rank that fits +{plan['max_lora_rank_that_fits']}$", out, re.M)
    assert http_json(server, "GET", "/v1/train/status") == jobs_before


def test_dry_run_reports_the_refusal_a_submission_would_get(kiln, server, tmp_path):
    rows = [example(1), {"messages": []}]
    data = write_jsonl(tmp_path / "d.jsonl", rows, blank_lines=True)
    jobs_before = http_json(server, "GET", "/v1/train/status")
    code, _out, err = kiln("train", "sft", "--data", str(data), "--dry-run")
    assert code == 1
    assert "kiln: training_invalid_request (HTTP 400)" in err and "rejected as empty_messages" in err
    assert f"  note: SFT row 2 is line 3 of {data}" in err
    assert http_json(server, "GET", "/v1/train/status") == jobs_before
