"""Resume admission: a real `.kiln-checkpoint` of an earlier job is fully validated, its seed
becomes the run's, open fields come from it, and any drift (seed, config, data, bytes) is a 400
that leaves nothing behind."""

from __future__ import annotations

import pytest

from kiln.store import Admission, Job
from kiln_train.checkpoint import ADAPTER_FILE
from tests.api import resume_support
from tests.api.conftest import example, snapshot
from tests.api.resume_support import ADAPTER, STEP, resume_body

checkpoint = resume_support.checkpoint  # fixture


def test_resume_takes_the_checkpoint_seed_and_pins_it(client, sessions, broker, checkpoint):
    name = checkpoint["path"].name
    response = client.post("/v1/train/sft", json=resume_body(resume_checkpoint=name))
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
    body = resume_body(resume_checkpoint=checkpoint["path"].name, seed=checkpoint["seed"])
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
    response = client.post(
        "/v1/train/sft", json=resume_body(resume_checkpoint=checkpoint["path"].name, **change)
    )
    assert response.status_code == 400, response.get_json()
    assert fragment in response.get_json()["error"]["message"]
    assert snapshot(engine, broker, storage) == before


def test_resume_with_other_data_is_rejected(client, engine, broker, storage, checkpoint):
    body = resume_body(resume_checkpoint=checkpoint["path"].name)
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
    response = client.post("/v1/train/sft", json=resume_body(resume_checkpoint=checkpoint["path"].name))
    assert response.status_code == 400
    assert "sha256" in response.get_json()["error"]["message"]


def test_resume_path_outside_the_registry_is_rejected(client, checkpoint, tmp_path):
    outside = tmp_path / checkpoint["path"].name
    response = client.post("/v1/train/sft", json=resume_body(resume_checkpoint=str(outside)))
    assert response.status_code == 400
    assert "not directly beneath the adapter registry" in response.get_json()["error"]["message"]
