"""The receipt marks a random base model (`model.random_init`, docs/artifacts.md#receipt-fields)
and leaves the field out for a real one."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from kiln_train.artifacts.receipt import build_receipt
from kiln_train.model.random_init import RANDOM_INIT_FILE
from kiln_train.train.identity import run_facts
from tests.kiln_train.artifacts.receipt_checks import validate_receipt
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config

resident, tiny_dir = fx.resident, fx.tiny_dir  # shared fixtures
OUTPUT = {"path": "/x", "adapter_model_sha256": "sha256:0", "adapter_model_bytes": 1}


@pytest.fixture(scope="module")
def facts(resident):
    return run_facts(
        resident,
        make_config(seed=1),
        ingest(resident, conversations(2)),
        resident.backend.sft_loss_route,
        "rnd",
    )


def test_a_random_checkpoint_is_marked_with_its_preset_and_seed(facts, tiny_dir):
    assert (tiny_dir / RANDOM_INIT_FILE).is_file()  # write_tiny_checkpoint leaves the mark
    receipt = build_receipt(facts, status="success", output=OUTPUT)
    validate_receipt(receipt)
    assert receipt["model"]["path"] == str(tiny_dir)
    assert receipt["model"]["random_init"]["preset"] == "tiny"
    assert isinstance(receipt["model"]["random_init"]["seed"], int)


def test_a_real_model_has_no_mark(facts, tiny_dir, tmp_path):
    real = shutil.copytree(tiny_dir, tmp_path / "real")
    (real / RANDOM_INIT_FILE).unlink()
    receipt = build_receipt(dataclasses.replace(facts, model_path=str(real)), status="success", output=OUTPUT)
    validate_receipt(receipt)
    assert "random_init" not in receipt["model"]
