"""A library run is a service run: `kiln_train.finetune` on the rows, config and seed of a job
the api admitted and the worker ran publishes the same adapter, receipt and checkpoints
(docs/library.md#the-service-and-the-library)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln_train import finetune
from tests.api.conftest import sft_body, unique_name
from tests.kiln_train.train.resume.resume_support import VOLATILE_RECEIPT, json_diff

# Where two runs of one plan may differ in a checkpoint manifest: when it was written, and the
# budget an automatic segment plan was derived from (the free memory each run was planned with).
VOLATILE_MANIFEST = {"created_at", "auxiliary_state.gradient_checkpoint_plan.budget_bytes"}


def submit(client, body: dict) -> str:
    response = client.post("/v1/train/sft", json=body)
    assert response.status_code == 200, response.get_json()
    return response.get_json()["job_id"]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.slow
def test_finetune_publishes_what_a_service_job_publishes(client, runtime, settings, resident, tmp_path):
    name = unique_name("parity")
    config = {"epochs": 2, "checkpoint_interval": 2, "output_name": name, "seed": 11}
    body = sft_body(3, optimizer={"kind": "adam_w"}, **config)
    job_id = submit(client, body)
    assert runtime.run_job(job_id) == "completed"
    service = settings.adapters_dir
    result = finetune(resident, body["examples"], body["config"], tmp_path)
    assert result.status == "success", result.failure_message

    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (result.adapter_path / file).read_bytes() == (service / name / file).read_bytes(), file
    ours, theirs = read_json(result.receipt_path), read_json(service / name / "train_receipt.json")
    # A service job's receipt also records its deliveries (docs/recovery.md); a library run has none.
    assert theirs.pop("attempts") == {"attempt": 1, "earlier": []} and "attempts" not in ours
    assert [p for p in json_diff(ours, theirs) if p not in VOLATILE_RECEIPT] == []
    assert theirs["requested_config"] == body["config"]  # the request as sent, through admission

    checkpoints = sorted(p.name for p in service.glob(f"{name}-checkpoint-step-*"))
    assert checkpoints == sorted(p.name for p in tmp_path.glob("*.kiln-checkpoint"))
    assert len(checkpoints) == 2
    for basename in checkpoints:
        files = sorted(p.name for p in (service / basename).iterdir())
        assert sorted(p.name for p in (tmp_path / basename).iterdir()) == files
        for file in files:
            if file != "checkpoint_manifest.json":
                assert (tmp_path / basename / file).read_bytes() == (service / basename / file).read_bytes()
        m1 = read_json(tmp_path / basename / "checkpoint_manifest.json")
        m2 = read_json(service / basename / "checkpoint_manifest.json")
        assert [p for p in json_diff(m1, m2) if p not in VOLATILE_MANIFEST] == [], basename


@pytest.mark.slow
def test_a_job_of_converted_and_cut_rows_is_the_library_run_of_the_same_rows(
    client, runtime, settings, resident, tmp_path
):
    """Formats and the length rule survive the worker's re-verification: the worker re-ingests
    the pinned rows under the pinned max_length/truncation and finds the admitted corpus."""
    name = unique_name("formats")
    rows = [
        {
            "instruction": "Which colour is listed?",
            "input": "red, blue",
            "output": "Red and blue, in that order.",
        },
        {
            "prompt": [{"role": "user", "content": "Colour?"}],
            "completion": [{"role": "assistant", "content": "Gold."}],
        },
        {"prompt": "The sky is", "completion": " blue on a clear day, grey under cloud."},
    ]
    config = {"epochs": 1, "seed": 3, "output_name": name, "max_length": 24, "truncation": "right"}
    body = {**sft_body(1, optimizer={"kind": "adam_w"}, **config), "examples": rows}
    job_id = submit(client, body)
    assert runtime.run_job(job_id) == "completed"
    theirs = read_json(settings.adapters_dir / name / "train_receipt.json")
    counts = theirs["data"]["sft_ingestion"]["row_counts"]
    assert counts["rows_per_format"] == {
        "instruction": 1,
        "prompt_completion": 1,
        "text_prompt_completion": 1,
    }
    assert counts["rows_truncated"] >= 1 and counts["tokens_dropped"] >= counts["rows_truncated"]
    assert theirs["requested_config"] == body["config"] and theirs["config"]["truncation"] == "right"

    result = finetune(resident, rows, body["config"], tmp_path)
    assert result.status == "success", result.failure_message
    ours = read_json(result.receipt_path)
    assert theirs.pop("attempts") == {"attempt": 1, "earlier": []} and "attempts" not in ours
    assert [p for p in json_diff(ours, theirs) if p not in VOLATILE_RECEIPT] == []
    adapter = "adapter_model.safetensors"
    assert (result.adapter_path / adapter).read_bytes() == (
        settings.adapters_dir / name / adapter
    ).read_bytes()
