"""Resume admission: a real `.kiln-checkpoint` of an earlier job is fully validated, its seed
becomes the run's, open fields come from it, and any drift (seed, config, data, bytes) is a 400
that leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.store import Admission, Job
from kiln_train.checkpoint import ADAPTER_FILE, epoch_order, publish_checkpoint, sft_manifest_draft
from kiln_train.plan.backend import backend_for_device
from kiln_train.sft_config import SftConfig
from tests.api.conftest import example, snapshot
from tests.kiln_train.checkpoint.checkpoint_support import artifacts, auxiliary_state

ROWS = 5  # the checkpoint test support's loop state is built for 5 items
STEP = 3
ADAPTER = "resumable"


def _body(**config) -> dict:
    return {
        "examples": [example(i) for i in range(ROWS)],
        "config": {"epochs": 2, "lora_rank": 4, "lora_alpha": 8.0, **config},
    }


@pytest.fixture
def checkpoint(client, sessions, settings, runner) -> dict:
    """Admit a job, cancel it, and publish a checkpoint of it at step 3 (as a worker would)."""
    out = client.post("/v1/train/sft", json=_body(output_name=ADAPTER)).get_json()
    assert client.delete(f"/v1/train/queue/{out['job_id']}").get_json()["status"] == "cancelled"
    with sessions() as session:
        admission = session.get(Admission, out["job_id"])
    config = SftConfig.model_validate(admission.effective_config)
    kind = config.optimizer.kind
    draft = sft_manifest_draft(
        config=config,
        adapter_name=ADAPTER,
        precision_policy=backend_for_device("cpu").precision_policy(kind),
        global_step=STEP,
        total_steps=config.epochs * ROWS,
        epoch_index=0,
        cursor_in_epoch=STEP,
        data_order=epoch_order(config.seed, 0, ROWS),
        content_sha256=admission.kept_corpus_sha256,
        item_count=ROWS,
        auxiliary_state=auxiliary_state(kind),
    )
    published = publish_checkpoint(settings.adapters_dir, draft, artifacts(STEP, kind))
    return {"path": Path(published.path), "seed": out["effective_seed"], "job_id": out["job_id"]}


def test_resume_takes_the_checkpoint_seed_and_pins_it(client, sessions, broker, checkpoint):
    name = checkpoint["path"].name
    response = client.post("/v1/train/sft", json=_body(resume_checkpoint=name))
    assert response.status_code == 200, response.get_json()
    out = response.get_json()
    assert out["effective_seed"] == checkpoint["seed"]
    with sessions() as session:
        job = session.get(Job, out["job_id"])
        admission = session.get(Admission, out["job_id"])
    assert job.resume_checkpoint == name and job.adapter_name == ADAPTER
    pin = admission.checkpoint_plan["resume_from"]
    assert pin["checkpoint"] == name and pin["global_step"] == STEP and pin["seed"] == checkpoint["seed"]
    assert pin["manifest_sha256"].startswith("sha256:") and pin["checkpoint_id"]
    assert admission.checkpoint_plan["auto"] is False  # the checkpoint fixed the segment count
    assert admission.effective_config["resume_checkpoint"] == name


def test_resume_with_its_own_explicit_seed_is_accepted(client, checkpoint):
    body = _body(resume_checkpoint=checkpoint["path"].name, seed=checkpoint["seed"])
    assert client.post("/v1/train/sft", json=body).status_code == 200


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"seed": 7}, "seed: checkpoint"),
        ({"lora_alpha": 6.0}, "effective_config.lora_alpha"),
        ({"epochs": 3}, "effective_config.epochs"),
        ({"output_name": "other"}, "differs from the checkpoint's adapter"),
    ],
)
def test_resume_drift_is_rejected(change, fragment, client, engine, broker, storage, checkpoint):
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=_body(resume_checkpoint=checkpoint["path"].name, **change))
    assert response.status_code == 400, response.get_json()
    assert fragment in response.get_json()["error"]["message"]
    assert snapshot(engine, broker, storage) == before


def test_resume_with_other_data_is_rejected(client, engine, broker, storage, checkpoint):
    body = _body(resume_checkpoint=checkpoint["path"].name)
    body["examples"][0] = example(99)
    before = snapshot(engine, broker, storage)
    response = client.post("/v1/train/sft", json=body)
    assert response.status_code == 400
    assert "data.content_sha256" in response.get_json()["error"]["message"]
    assert snapshot(engine, broker, storage) == before


def test_resume_from_a_modified_checkpoint_is_rejected(client, checkpoint):
    adapter_file = checkpoint["path"] / ADAPTER_FILE
    data = bytearray(adapter_file.read_bytes())
    data[-1] ^= 0xFF
    adapter_file.write_bytes(bytes(data))
    response = client.post("/v1/train/sft", json=_body(resume_checkpoint=checkpoint["path"].name))
    assert response.status_code == 400
    assert "sha256" in response.get_json()["error"]["message"]


def test_resume_path_outside_the_registry_is_rejected(client, checkpoint, tmp_path):
    outside = tmp_path / checkpoint["path"].name
    response = client.post("/v1/train/sft", json=_body(resume_checkpoint=str(outside)))
    assert response.status_code == 400
    assert "not directly beneath the adapter registry" in response.get_json()["error"]["message"]
