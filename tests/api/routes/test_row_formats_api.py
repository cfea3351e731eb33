"""Row formats through the HTTP front door: the browser's instruction-rows sample, preflight and
admission of mixed formats, the length rule, and rejections naming their line."""

from __future__ import annotations

import json
from pathlib import Path

from tests.api.conftest import example

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "examples" / "instruction.jsonl"


def test_the_instruction_sample_is_served_and_every_row_is_admitted(client, runner):
    served = client.get("/ui/sample-instruction.jsonl")
    assert served.status_code == 200 and served.data == SAMPLE.read_bytes()
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    assert sum("instruction" in r for r in rows) >= 8 and any("history" in r for r in rows)
    plan = client.post("/v1/train/sft/preflight", json={"examples": rows, "config": {"epochs": 1}}).get_json()
    assert (plan["rows_read"], plan["rows_kept"], plan["rows_rejected"]) == (10, 10, 0), plan


def test_a_row_over_max_length_is_too_long_and_right_truncation_admits_it(client, runner):
    rows = [example(0), {"instruction": "Repeat.", "output": "Done. " * 50}]
    body = {"examples": rows, "config": {"epochs": 1, "max_length": 64}}
    refused = client.post("/v1/train/sft/preflight", json=body)
    assert refused.status_code == 400
    message = refused.get_json()["error"]["message"]
    assert (
        "SFT row 2 (sha256:" in message
        and "rejected as too_long" in message
        and "max_length is 64" in message
    )
    skipped = client.post(
        "/v1/train/sft/preflight", json={**body, "config": {**body["config"], "invalid_row_policy": "skip"}}
    ).get_json()
    assert [(r["row_index"], r["reason"]) for r in skipped["rejected_rows"]] == [(2, "too_long")]
    cut = client.post(
        "/v1/train/sft/preflight", json={**body, "config": {**body["config"], "truncation": "right"}}
    )
    assert cut.status_code == 200, cut.get_json()
    assert cut.get_json()["max_seq_len"] == 64  # the plan prices the cut rows
    long_prompt = {"examples": [example(0), {"instruction": "Say it. " * 50, "output": "Done."}]}
    gone = client.post(
        "/v1/train/sft/preflight", json={**long_prompt, "config": {**body["config"], "truncation": "right"}}
    )
    assert gone.status_code == 400 and "rejected as answer_truncated" in gone.get_json()["error"]["message"]


def test_a_format_rejection_is_a_row_rejection_not_a_broken_request(client, runner):
    rows = [example(0), {"conversations": [{"from": "human", "value": "hi"}]}]
    response = client.post("/v1/train/sft/preflight", json={"examples": rows, "config": {"epochs": 1}})
    assert response.status_code == 400
    message = response.get_json()["error"]["message"]
    assert "SFT row 2 (sha256:" in message and "rejected as unsupported_format" in message
    assert "`conversations` key: ShareGPT" in message
    skip = {"examples": rows, "config": {"epochs": 1, "invalid_row_policy": "skip"}}
    plan = client.post("/v1/train/sft/preflight", json=skip).get_json()
    assert [(r["row_index"], r["reason"]) for r in plan["rejected_rows"]] == [(2, "unsupported_format")]


def test_a_dataset_files_rejections_name_their_line_in_preflight_and_admission(client, settings, runner):
    data = settings.datasets_dir / "lines.jsonl"
    bad = {"instruction": "x", "output": "y", "source": "web"}
    data.write_text(
        f"{json.dumps(example(0))}\n\n\n{json.dumps(bad)}\n{json.dumps(example(1))}\n", encoding="utf-8"
    )
    body = {"dataset_path": "lines.jsonl", "config": {"epochs": 1, "invalid_row_policy": "skip"}}
    plan = client.post("/v1/train/sft/preflight", json=body)
    assert plan.status_code == 200, plan.get_json()
    (row,) = plan.get_json()["rejected_rows"]
    assert (row["row_index"], row["line"], row["reason"]) == (2, 4, "unknown_field")
    refused = client.post("/v1/train/sft", json={**body, "config": {"epochs": 1}})
    assert refused.status_code == 400
    message = refused.get_json()["error"]["message"]
    assert message.startswith("Invalid training request: line 4: SFT row 2 (sha256:")
    assert "rejected as unknown_field: 'source' beside" in message
