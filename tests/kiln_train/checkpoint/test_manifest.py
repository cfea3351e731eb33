"""The manifest `kiln.training-checkpoint.v1`: shape, every manifest rule, SFT bindings and resume gates (docs/checkpoints.md#manifest)."""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from api.errors import http_status
from kiln_train.checkpoint import (
    CheckpointError,
    checkpoint_dir_name,
    parse_manifest_bytes,
    validate_manifest,
)
from kiln_train.checkpoint.manifest import MAX_MANIFEST_BYTES, FileRecord
from tests.kiln_train.checkpoint.checkpoint_support import ADAPTER, artifacts, draft


def _files(global_step: int = 7, optimizer: str = "adam_w") -> dict:
    roles = {"adapter.safetensors": "adapter-parameters", "optimizer.safetensors": "optimizer-state"}
    roles["sft_loop_state.json"] = "loss-history"
    return {
        rel: FileRecord(role=roles[rel], size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        for rel, data in artifacts(global_step, optimizer).items()
    }


def valid_json(global_step: int = 7, optimizer: str = "adam_w") -> dict:
    return draft(global_step, optimizer).to_manifest(_files(global_step, optimizer)).to_json()


def _check(value: dict) -> None:
    validate_manifest(parse_manifest_bytes(json.dumps(value).encode()))


def test_a_complete_manifest_round_trips():
    value = valid_json()
    manifest = parse_manifest_bytes(json.dumps(value).encode())
    validate_manifest(manifest)
    assert manifest.to_json() == value
    assert parse_manifest_bytes(manifest.to_bytes()) == manifest
    assert manifest.checkpoint_id == "sft-step-00000007"
    assert list(value["rng_states"]) == ["epoch-order", "lora-init"]
    assert value["optimizer"]["state_file"] == "optimizer.safetensors"
    assert value["state_files"] == {
        "adapter_parameters": "adapter.safetensors",
        "optimizer_state": "optimizer.safetensors",
        "loss_history": "sft_loop_state.json",
    }
    assert "resume_checkpoint" not in value["effective_config"]
    assert value["data"]["content_sha256"] == value["data"]["content_sha256"].lower()
    assert len(value["data"]["content_sha256"]) == 64
    assert manifest.to_bytes().endswith(b"}\n") and b'\n  "schema_version": 1,' in manifest.to_bytes()


def test_sgd_has_no_optimizer_state_members():
    value = valid_json(optimizer="sgd")
    _check(value)
    assert "state_file" not in value["optimizer"]
    assert "optimizer_state" not in value["state_files"]
    assert set(value["files"]) == {"adapter.safetensors", "sft_loop_state.json"}


def test_directory_name():
    assert checkpoint_dir_name(ADAPTER, 25) == "support-bot-checkpoint-step-00000025.kiln-checkpoint"
    with pytest.raises(CheckpointError, match="adapter_name"):
        checkpoint_dir_name("../evil", 1)


def _set(path: str, value):
    """A mutation that sets the dotted `path` (list indices allowed) to `value`."""

    def apply(m: dict) -> None:
        *parents, last = path.split(".")
        target = m
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return apply


def _set_file(rel: str, field: str, value):
    def apply(m: dict) -> None:
        m["files"][rel][field] = value

    return apply


def _delete(path: str):
    def apply(m: dict) -> None:
        *parents, last = path.split(".")
        target = m
        for key in parents:
            target = target[key]
        del target[last]

    return apply


def _rename_file(old: str, new: str):
    def apply(m: dict) -> None:
        m["files"][new] = m["files"].pop(old)

    return apply


def _many_files(m: dict) -> None:
    record = next(iter(m["files"].values()))
    for i in range(62):
        m["files"][f"extra/{i}.bin"] = dict(record, role="rng-state")


def _empty_order(m: dict) -> None:
    m["progress"]["data_order"] = []
    m["progress"]["cursor_in_epoch"] = 0


SHAPE_CASES = {
    "unknown top-level field": (_set("bogus", 1), "bogus: unknown field"),
    "unknown progress field": (_set("progress.bogus", 1), "progress.bogus: unknown field"),
    "unknown data field": (_set("data.bogus", 1), "data.bogus: unknown field"),
    "unknown rng stream": (_set("rng_states.dropout", {}), "rng_states.dropout: unknown field"),
    "unknown rng field": (
        _set("rng_states.epoch-order.bogus", 1),
        "rng_states.epoch-order.bogus: unknown field",
    ),
    "unknown optimizer field": (_set("optimizer.bogus", 1), "optimizer.bogus: unknown field"),
    "unknown hyperparameter": (
        _set("optimizer.hyperparameters.bogus", 1),
        "hyperparameters.bogus: unknown field",
    ),
    "unknown optimizer option": (
        _set("optimizer.hyperparameters.optimizer.bogus", 1),
        "hyperparameters.optimizer.adam_w.bogus: unknown field",
    ),
    "unknown scheduler field": (_set("scheduler.bogus", 1), "scheduler.bogus: unknown field"),
    "unknown scheduler state": (_set("scheduler.state.bogus", 1), "scheduler.state.bogus: unknown field"),
    "unknown state_files member": (_set("state_files.bogus", "x"), "state_files.bogus: unknown field"),
    "unknown file record field": (
        _set_file("adapter.safetensors", "x", 1),
        "unknown field",
    ),
    "unknown precision field": (_set("precision_policy.bogus", 1), "precision_policy.bogus: unknown field"),
    "missing field": (_delete("data"), "data: required field is missing"),
    "schema version": (_set("schema_version", 2), "schema_version"),
    "manifest type": (_set("manifest_type", "kiln.training-checkpoint.v2"), "manifest_type"),
    "checkpoint kind": (_set("checkpoint_kind", "final"), "checkpoint_kind"),
    "training kind not kebab": (_set("training_kind", "capability_distillation"), "training_kind"),
    "created_at": (_set("created_at", "yesterday"), "created_at: 'yesterday' is not an RFC 3339 timestamp"),
    "created_at impossible date": (_set("created_at", "2026-13-01T00:00:00Z"), "created_at"),
    "effective_config not an object": (_set("effective_config", [1]), "effective_config"),
    "auxiliary_state not an object": (_set("auxiliary_state", "x"), "auxiliary_state"),
    "stochastic_rounding not an object": (
        _set("precision_policy.stochastic_rounding", "rtn"),
        "stochastic_rounding",
    ),
    "hyperparameters not an object": (_set("optimizer.hyperparameters", 0.1), "optimizer.hyperparameters"),
    "item_count zero": (_set("data.item_count", 0), "data.item_count"),
    "prefixed content digest": (_set("data.content_sha256", "sha256:" + "a" * 64), "data.content_sha256"),
    "uppercase file digest": (_set_file("adapter.safetensors", "sha256", "A" * 64), "sha256"),
    "bool as integer": (_set("progress.global_step", True), "progress.global_step"),
    "seed above u64": (_set("rng_states.lora-init.seed", 2**64), "rng_states.lora-init.seed"),
    "rust epoch-order algorithm": (
        _set("rng_states.epoch-order.algorithm", "kiln.epoch-order.v1"),
        "'kiln.epoch-order.v1' is not 'kiln-py.epoch-order.v1'",
    ),
    "empty dtype": (
        _set("precision_policy.gradient_dtype", " "),
        "gradient_dtype must be a non-empty dtype name",
    ),
    "unknown file role": (_set_file("adapter.safetensors", "role", "weights"), "role"),
    "gradient clipping": (_set("scheduler.state.gradient_clipping", "norm"), "gradient_clipping"),
    "warmup": (_set("scheduler.state.warmup_steps", 10), "warmup_steps"),
}

RULE_CASES = {
    "adapter name charset": (
        _set("adapter_name", "support bot"),
        "adapter_name: 'support bot' is not an identifier",
    ),
    "adapter name length": (_set("adapter_name", "a" * 256), "adapter_name"),
    "checkpoint id charset": (_set("checkpoint_id", "sft/step"), "checkpoint_id"),
    "grpo is not read": (_set("training_kind", "grpo"), "training_kind: 'grpo' checkpoints cannot be read"),
    "step above total": (
        _set("progress.global_step", 11),
        "progress.global_step: 11 exceeds progress.total_steps 10",
    ),
    "cursor beyond order": (_set("progress.cursor_in_epoch", 6), "progress.cursor_in_epoch: 6 exceeds len"),
    "empty order while unfinished": (_empty_order, "progress.data_order: empty while the run is unfinished"),
    "order length": (_set("progress.data_order", [0, 1, 2, 3]), "progress.data_order: has 4 entries"),
    "order duplicates": (_set("progress.data_order", [0, 1, 1, 3, 4]), "not a permutation of 0..4"),
    "order out of range": (_set("progress.data_order", [0, 1, 2, 3, 5]), "not a permutation of 0..4"),
    "optimizer step": (_set("optimizer.step", 6), "optimizer.step: 6 differs from progress.global_step 7"),
    "scheduler step": (_set("scheduler.step", 8), "scheduler.step: 8 differs from progress.global_step 7"),
    "no files": (_set("files", {}), "files: 0 entries"),
    "too many files": (_many_files, "files: 65 entries"),
    "absolute path": (_rename_file("adapter.safetensors", "/adapter.safetensors"), "is absolute"),
    "backslash": (_rename_file("adapter.safetensors", "sub\\adapter.safetensors"), "backslash"),
    "dot-dot": (
        _rename_file("adapter.safetensors", "a/../adapter.safetensors"),
        "not a normalised relative path",
    ),
    "dot segment": (
        _rename_file("adapter.safetensors", "./adapter.safetensors"),
        "not a normalised relative path",
    ),
    "reserved name": (_rename_file("adapter.safetensors", "checkpoint_manifest.json"), "reserved name"),
    "reserved sentinel": (_rename_file("adapter.safetensors", ".incomplete"), "reserved name"),
    "path too long": (_rename_file("adapter.safetensors", "a" * 1025), "exceeds 1024 bytes"),
    "state file not listed": (
        _rename_file("adapter.safetensors", "weights.safetensors"),
        "state_files.adapter_parameters: 'adapter.safetensors' is not listed in files",
    ),
    "role mismatch": (
        _set_file("sft_loop_state.json", "role", "data-order"),
        "files['sft_loop_state.json'].role: 'data-order', but state_files.loss_history requires 'loss-history'",
    ),
    "state_file without optimizer_state": (
        _delete("state_files.optimizer_state"),
        "optimizer.state_file: must be present exactly when state_files.optimizer_state is present",
    ),
    "optimizer_state without state_file": (
        _delete("optimizer.state_file"),
        "optimizer.state_file: must be present",
    ),
    "resume_checkpoint recorded": (
        _set("effective_config.resume_checkpoint", "x"),
        "effective_config.resume_checkpoint: must not be recorded",
    ),
    "unknown config field": (_set("effective_config.gradient_accumulation_steps", 4), "effective_config: "),
    "unresolved learning rate": (
        _set("effective_config.learning_rate", None),
        "effective_config.learning_rate",
    ),
    "unresolved seed": (_set("effective_config.seed", None), "effective_config.seed"),
    "checkpoint id mismatch": (
        _set("checkpoint_id", "sft-step-00000008"),
        "checkpoint_id: 'sft-step-00000008' is not",
    ),
    "hyperparameter lr": (
        _set("optimizer.hyperparameters.learning_rate", 0.5),
        "optimizer.hyperparameters.learning_rate",
    ),
    "scheduler lr": (
        _set("scheduler.state.learning_rate", 0.5),
        "scheduler.state.learning_rate: 0.5 differs",
    ),
    "optimizer object": (
        _set("optimizer.hyperparameters.optimizer.beta1", 0.8),
        "optimizer.hyperparameters.optimizer: differs from effective_config.optimizer",
    ),
    "rng seed": (
        _set("rng_states.lora-init.seed", 5),
        "rng_states.lora-init.seed: 5 differs from effective_config.seed",
    ),
    "rng position": (
        _set("rng_states.epoch-order.position", 0),
        "rng_states.epoch-order.position: 0 differs",
    ),
    "lora-init position": (
        _set("rng_states.lora-init.position", 1),
        "rng_states.lora-init.position: 1, expected 0",
    ),
    "total steps": (
        _set("progress.total_steps", 9),
        "progress.total_steps: 9 is not effective_config.epochs 2",
    ),
    "progress arithmetic": (
        _set("progress.cursor_in_epoch", 3),
        "progress.global_step: 7 is not epoch_index 1 x item_count 5 + cursor_in_epoch 3",
    ),
    "stochastic rounding": (
        _set("precision_policy.stochastic_rounding", {"mode": "stochastic", "seed": 3}),
        "legacy stochastic-rounding checkpoint is not resumable",
    ),
    "planning v3": (
        _set(
            "auxiliary_state.training_runtime_planning_identity.schema",
            "kiln.training-checkpoint-planning.v3",
        ),
        "'kiln.training-checkpoint-planning.v3' is not the SFT planning identity",
    ),
    "planning without route": (
        _delete("auxiliary_state.training_runtime_planning_identity.sft_loss_route"),
        "training_runtime_planning_identity.sft_loss_route: None",
    ),
    "planning unknown route": (
        _set("auxiliary_state.training_runtime_planning_identity.sft_loss_route", "fast"),
        "sft_loss_route: 'fast' is not one of",
    ),
    "aux missing key": (
        _delete("auxiliary_state.base_weight_shard_manifest"),
        "auxiliary_state.base_weight_shard_manifest: required for an SFT checkpoint",
    ),
    "aux loop state type": (_set("auxiliary_state.loop_state_type", "x"), "auxiliary_state.loop_state_type"),
    "aux aggregate": (
        _set("auxiliary_state.base_model_weights_sha256", "f" * 64),
        "auxiliary_state.base_model_weights_sha256: 'ffff",
    ),
    "aux provenance": (
        _set("auxiliary_state.execution_provenance", {"schema_version": 1}),
        "auxiliary_state.execution_provenance: must be a full execution-provenance object",
    ),
    "aux precision": (
        _set("auxiliary_state.training_precision_policy", {"parameter_dtype": "bf16"}),
        "auxiliary_state.training_precision_policy: differs from precision_policy",
    ),
    "aux shard record tampered": (
        _set("auxiliary_state.base_weight_shard_manifest.shards.1.size_bytes", 513),
        "base_weight_shard_manifest.aggregate_sha256: 'sha256:",
    ),
    "aux shard records malformed": (
        _set("auxiliary_state.base_weight_shard_manifest.shards", [{"filename": "x"}]),
        "base_weight_shard_manifest.shards: must list",
    ),
    "aux provenance tampered": (
        _set("auxiliary_state.execution_provenance.backend.name", "cuda"),
        "execution_provenance.provenance_sha256: does not cover the recorded provenance",
    ),
    "aux empty digest": (
        _set("auxiliary_state.valid_indices_sha256", ""),
        "auxiliary_state.valid_indices_sha256",
    ),
}


def _swapped_order(m: dict) -> None:
    order = m["progress"]["data_order"]
    order[0], order[1] = order[1], order[0]


RULE_CASES["not the seeded order"] = (
    _swapped_order,
    "progress.data_order: differs from the seeded order for epoch 1",
)


@pytest.mark.parametrize("case", sorted(SHAPE_CASES | RULE_CASES))
def test_invalid_manifests_are_rejected_naming_the_field(case):
    mutate, message = (SHAPE_CASES | RULE_CASES)[case]
    value = copy.deepcopy(valid_json())
    mutate(value)
    with pytest.raises(CheckpointError) as info:
        _check(value)
    assert message in info.value.message
    assert info.value.code == "training_invalid_request" and http_status(info.value) == 400


def test_sgd_with_an_optimizer_state_is_rejected():
    value = valid_json(optimizer="sgd")
    value["state_files"]["optimizer_state"] = "sft_loop_state.json"
    value["optimizer"]["state_file"] = "sft_loop_state.json"
    with pytest.raises(CheckpointError, match="role"):
        _check(value)


def test_a_finished_run_may_have_an_empty_order():
    value = draft(10).to_manifest(_files(10)).to_json()
    value["progress"]["data_order"] = []
    _check(value)


@pytest.mark.parametrize(
    "text",
    ['{"schema_version": 1, "schema_version": 1}', '{"x": NaN}', '{"x": -Infinity}', "[]", "{"],
)
def test_strict_json(text):
    with pytest.raises(CheckpointError, match="checkpoint_manifest.json"):
        parse_manifest_bytes(text.encode())


def test_oversized_manifest_bytes():
    with pytest.raises(CheckpointError, match="exceeds the 16777216 byte limit"):
        parse_manifest_bytes(b" " * (MAX_MANIFEST_BYTES + 1))


def test_the_package_does_not_import_torch():
    # The api reads checkpoints for status and admission and must stay torch-free.
    code = "import sys, kiln_train.checkpoint; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[3]).returncode == 0
