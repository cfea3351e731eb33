"""A real `.kiln-checkpoint` of an earlier job, published as a worker would, for the resume
admission tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.store import Admission
from kiln_train.checkpoint import epoch_order, publish_checkpoint, sft_manifest_draft
from kiln_train.ground.backend import backend_for_device
from kiln_train.optim.kinds import keeps_state
from kiln_train.sft_config import SftConfig
from tests.api.conftest import example
from tests.kiln_train.checkpoint.checkpoint_support import artifacts, auxiliary_state

ROWS = 5  # the checkpoint test support's loop state is built for 5 items
STEP = 3
ADAPTER = "resumable"


def resume_body(**config) -> dict:
    return {
        "examples": [example(i) for i in range(ROWS)],
        "config": {"epochs": 2, "lora_rank": 4, "lora_alpha": 8.0, **config},
    }


@pytest.fixture
def checkpoint(client, sessions, settings, runner) -> dict:
    """Admit a job, cancel it, and publish a checkpoint of it at step 3 (as a worker would)."""
    out = client.post("/v1/train/sft", json=resume_body(output_name=ADAPTER)).get_json()
    assert client.delete(f"/v1/train/queue/{out['job_id']}").get_json()["status"] == "cancelled"
    with sessions() as session:
        admission = session.get(Admission, out["job_id"])
    config = SftConfig.model_validate(admission.effective_config)
    kind = config.optimizer.kind
    draft = sft_manifest_draft(
        config=config,
        adapter_name=ADAPTER,
        precision_policy=backend_for_device("cpu").precision_policy(keeps_state(kind)),
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
