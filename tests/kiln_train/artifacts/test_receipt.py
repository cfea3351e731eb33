"""`train_receipt.json` build and reader validation.

See docs/artifacts.md#receipt-envelope and docs/artifacts.md#receipt-fields.
"""

from __future__ import annotations

import copy

import pytest

from kiln_train.artifacts.receipt import build_receipt
from kiln_train.errors import FAILURE_REASONS
from kiln_train.train.identity import run_facts
from tests.kiln_train.artifacts.receipt_checks import validate_receipt
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config

resident, tiny_dir = fx.resident, fx.tiny_dir  # shared fixtures

TOP_LEVEL_ORDER = [
    "schema_version",
    "receipt_type",
    "adapter_name",
    "produced_at",
    "status",
    "failure_reason",
    "kiln",
    "model",
    "tokenizer",
    "adapters",
    "training_data",
    "hyperparameters",
    "grpo",
    "echo",
    "no_policy_loss",
    "data",
    "rewards",
    "token_counts",
    "phase_timings",
    "runtime",
    "config_hashes",
    "lora_delta_norms",
    "lora_grad_norms",
    "config",
]


@pytest.fixture(scope="module")
def facts(resident):
    ingestion = ingest(resident, conversations(3))
    config = make_config(seed=99, epochs=4)
    f = run_facts(resident, config, ingestion, resident.backend.sft_loss_route, "receipt-unit")
    return f, ingestion


def test_success_receipt_field_order_and_counts(facts):
    f, ingestion = facts
    receipt = build_receipt(
        f,
        status="success",
        output={"path": "/x", "adapter_model_sha256": "sha256:0", "adapter_model_bytes": 1},
    )
    assert list(receipt) == TOP_LEVEL_ORDER
    validate_receipt(receipt)
    assert receipt["data"]["examples_trained"] == 3 * 4
    assert receipt["token_counts"]["action_tokens"] == 4 * ingestion.total_supervised_tokens
    assert receipt["token_counts"]["context_tokens"] == 4 * (
        ingestion.total_tokens - ingestion.total_supervised_tokens
    )
    assert receipt["hyperparameters"]["seed"] == "99"
    assert receipt["config"]["seed"] == "99"
    assert set(receipt["phase_timings"].values()) == {0}
    assert receipt["echo"]["enabled"] is False and receipt["rewards"]["count"] == 0


def test_failed_receipt_counts_what_was_done(facts):
    f, ingestion = facts
    f = copy.copy(f)
    f.steps_completed, f.epochs_completed = 5, 1
    receipt = build_receipt(f, status="failed", failure_reason="cancelled", failure_message="stopped")
    assert list(receipt)[:7] == [*TOP_LEVEL_ORDER[:6], "failure_message"]
    validate_receipt(receipt)
    assert receipt["failure_message"] == "stopped"
    assert receipt["data"]["examples_trained"] == 5
    assert receipt["token_counts"]["action_tokens"] == ingestion.total_supervised_tokens  # one full epoch


def test_unknown_status_or_reason_is_refused_at_build(facts):
    f, _ = facts
    with pytest.raises(ValueError, match="status"):
        build_receipt(f, status="partial")
    with pytest.raises(ValueError, match="failure_reason"):
        build_receipt(f, status="failed", failure_reason="disk_full", failure_message="x")
    for reason in FAILURE_REASONS:
        validate_receipt(build_receipt(f, status="failed", failure_reason=reason, failure_message="x"))


def _set(receipt: dict, path: str, value) -> dict:
    out = copy.deepcopy(receipt)
    node = out
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("schema_version", 2, "not a kiln_train_receipt v1"),
        ("receipt_type", "other", "not a kiln_train_receipt v1"),
        ("adapter_name", "", "adapter_name must be non-empty"),
        ("status", "done", "bad status"),
        ("failure_reason", "nan_loss", "no failure_reason"),
        ("hyperparameters.mode", "grpo", "mode must be sft"),
        ("data.sft_ingestion", None, "carry data.sft_ingestion"),
        ("training_data.source", "dataset_path", "source/path disagree"),
        ("training_data.path", "/elsewhere.jsonl", "source/path disagree"),
        ("training_data.sha256", "sha256:" + "0" * 64, "kept-corpus digest"),
        ("data.examples_read", 99, "examples_read"),
        ("data.examples_filtered", 1, "examples_filtered"),
        ("config.invalid_row_policy", "skip", "invalid_row_policy"),
        ("config_hashes.training_chat_template_hash", "sha256:" + "1" * 64, "template digests disagree"),
        ("runtime.sft_loss_route", None, "sft_loss_route is required"),
    ],
)
def test_validation_names_each_broken_binding(facts, path, value, message):
    f, _ = facts
    receipt = build_receipt(f, status="success")
    with pytest.raises(ValueError, match=message):
        validate_receipt(_set(receipt, path, value))


def test_validation_checks_the_provenance_template_digest(facts):
    f, _ = facts
    receipt = build_receipt(f, status="success")
    broken = copy.deepcopy(receipt)
    broken["runtime"]["execution_provenance"]["model"]["training_chat_template_sha256"] = "sha256:" + "2" * 64
    with pytest.raises(ValueError, match="execution provenance template digest"):
        validate_receipt(broken)
