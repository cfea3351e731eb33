"""The strict loader and status discovery (kiln-contract §5.7): one test per rejection."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load

from kiln_train.checkpoint import (
    ADAPTER_FILE,
    LOOP_STATE_FILE,
    MANIFEST_FILENAME,
    OPTIMIZER_FILE,
    PEFT_MESSAGE,
    CheckpointError,
    discover_checkpoints,
    load_checkpoint,
    read_checkpoint_manifest,
)
from tests.kiln_train.checkpoint.checkpoint_support import LORA_KEY, artifacts, loop_state, publish

NAME = "support-bot-checkpoint-step-00000007.kiln-checkpoint"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return publish(tmp_path / "adapters", 7).path


def _reject(path: Path, message: str, **kwargs) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, **kwargs)
    assert message in info.value.message, info.value.message
    assert info.value.code == "training_invalid_request"
    return info.value


def _edit_manifest(path: Path, edit) -> None:
    manifest = path / MANIFEST_FILENAME
    value = json.loads(manifest.read_bytes())
    edit(value)
    manifest.write_text(json.dumps(value, indent=2))


def _replace_file(path: Path, rel: str, data: bytes) -> None:
    """Replace a file and re-record it in the manifest, so only the content rules can object."""
    (path / rel).write_bytes(data)

    def edit(value: dict) -> None:
        value["files"][rel]["size_bytes"] = len(data)
        value["files"][rel]["sha256"] = hashlib.sha256(data).hexdigest()

    _edit_manifest(path, edit)


def test_loads_a_published_checkpoint(ckpt):
    loaded = load_checkpoint(ckpt)
    assert loaded.path == ckpt
    assert loaded.manifest.checkpoint_id == "sft-step-00000007"
    assert loaded.manifest_sha256 == hashlib.sha256((ckpt / MANIFEST_FILENAME).read_bytes()).hexdigest()
    assert set(loaded.files) == {ADAPTER_FILE, OPTIMIZER_FILE, LOOP_STATE_FILE}
    assert loaded.loop_state == loop_state(7)
    tensors = load(loaded.read_verified(ADAPTER_FILE))
    assert set(tensors) == {LORA_KEY.format("A"), LORA_KEY.format("B")}
    assert load(loaded.read_verified(OPTIMIZER_FILE))[f"{LORA_KEY.format('A')}.adamw.step"].tolist() == [7]
    assert read_checkpoint_manifest(ckpt) == (loaded.manifest, loaded.manifest_sha256)
    assert load_checkpoint(ckpt, verify_hashes=False).manifest == loaded.manifest


def test_rejects_a_basename_without_the_suffix(ckpt):
    renamed = ckpt.with_name("support-bot-checkpoint-step-00000007")
    ckpt.rename(renamed)
    _reject(renamed, "does not end with '.kiln-checkpoint'")


def test_rejects_a_renamed_checkpoint(ckpt):
    renamed = ckpt.with_name("support-bot-checkpoint-step-00000009.kiln-checkpoint")
    ckpt.rename(renamed)
    _reject(renamed, "the directory name is not 'support-bot-checkpoint-step-00000007.kiln-checkpoint'")


def test_rejects_a_missing_path(tmp_path):
    _reject(tmp_path / NAME, "does not exist")


def test_rejects_a_symlinked_directory(ckpt, tmp_path):
    link = tmp_path / "links" / NAME
    link.parent.mkdir()
    link.symlink_to(ckpt, target_is_directory=True)
    _reject(link, "is a symlink; a checkpoint must be a real directory")


def test_rejects_a_regular_file(tmp_path):
    path = tmp_path / NAME
    path.write_bytes(b"{}")
    _reject(path, "is not a directory")


def test_rejects_a_leftover_sentinel(ckpt):
    (ckpt / ".incomplete").write_bytes(b"sft-step-00000007\n")
    _reject(ckpt, "holds the '.incomplete' sentinel; the checkpoint was never completely published")


def test_rejects_a_missing_manifest(ckpt):
    (ckpt / MANIFEST_FILENAME).unlink()
    _reject(ckpt, f"{MANIFEST_FILENAME} is missing ({PEFT_MESSAGE})")


@pytest.mark.parametrize("name", ["support-bot", NAME])
def test_rejects_a_peft_adapter_directory(tmp_path, name):
    adapter = tmp_path / name
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (adapter / "adapter_model.safetensors").write_bytes(artifacts(7)[ADAPTER_FILE])
    error = _reject(adapter, PEFT_MESSAGE)
    assert "is a PEFT adapter directory" in error.message


def test_rejects_an_oversized_manifest(ckpt):
    manifest = ckpt / MANIFEST_FILENAME
    data = manifest.read_bytes()
    manifest.write_bytes(data + b" " * (16 * 1024 * 1024 + 1 - len(data)))  # still valid JSON
    _reject(ckpt, "is 16777217 bytes, above the 16777216 byte limit")


def test_rejects_a_hard_linked_manifest(ckpt, tmp_path):
    os.link(ckpt / MANIFEST_FILENAME, tmp_path / "manifest-copy.json")
    _reject(ckpt, "'checkpoint_manifest.json' has 2 hard links")


def test_rejects_a_symlinked_manifest(ckpt, tmp_path):
    real = tmp_path / "manifest.json"
    shutil.move(ckpt / MANIFEST_FILENAME, real)
    (ckpt / MANIFEST_FILENAME).symlink_to(real)
    _reject(ckpt, "'checkpoint_manifest.json' is a symlink")


@pytest.mark.parametrize("verify_hashes", [True, False])
def test_rejects_a_hard_linked_file(ckpt, tmp_path, verify_hashes):
    os.link(ckpt / ADAPTER_FILE, tmp_path / "adapter-copy.safetensors")
    _reject(ckpt, "'adapter.safetensors' has 2 hard links", verify_hashes=verify_hashes)


def test_rejects_a_symlinked_file(ckpt, tmp_path):
    real = tmp_path / "adapter.safetensors"
    shutil.move(ckpt / ADAPTER_FILE, real)
    (ckpt / ADAPTER_FILE).symlink_to(real)
    _reject(ckpt, "'adapter.safetensors' is a symlink")


@pytest.mark.parametrize(
    ("where", "edit"),
    [
        ("bogus", lambda v: v.update(bogus=1)),
        ("progress.bogus", lambda v: v["progress"].update(bogus=1)),
        ("rng_states.lora-init.bogus", lambda v: v["rng_states"]["lora-init"].update(bogus=1)),
        ("files.adapter.safetensors.bogus", lambda v: v["files"][ADAPTER_FILE].update(bogus=1)),
        ("scheduler.state.bogus", lambda v: v["scheduler"]["state"].update(bogus=1)),
    ],
)
def test_rejects_unknown_manifest_fields(ckpt, where, edit):
    _edit_manifest(ckpt, edit)
    _reject(ckpt, f"{where}: unknown field")


def test_rejects_a_missing_file(ckpt):
    (ckpt / OPTIMIZER_FILE).unlink()
    _reject(ckpt, "file set: 'optimizer.safetensors' is listed in files but missing")


@pytest.mark.parametrize("extra", ["notes.txt", "sub/dir/notes.txt", ".hidden"])
def test_rejects_an_extra_file(ckpt, extra):
    (ckpt / extra).parent.mkdir(parents=True, exist_ok=True)
    (ckpt / extra).write_bytes(b"x")
    _reject(ckpt, f"file set: {extra!r} is not listed in files")


@pytest.mark.parametrize("verify_hashes", [True, False])
def test_rejects_a_size_mismatch(ckpt, verify_hashes):
    with open(ckpt / ADAPTER_FILE, "ab") as fh:
        fh.write(b"\0")
    _reject(ckpt, "files['adapter.safetensors'].size_bytes: manifest", verify_hashes=verify_hashes)


@pytest.mark.parametrize("rel", [ADAPTER_FILE, OPTIMIZER_FILE, LOOP_STATE_FILE])
def test_rejects_a_tampered_byte(ckpt, rel):
    path = ckpt / rel
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    _reject(ckpt, f"files[{rel!r}].sha256: manifest")


def test_read_verified_catches_tampering_after_load(ckpt):
    loaded = load_checkpoint(ckpt)
    data = bytearray((ckpt / ADAPTER_FILE).read_bytes())
    data[-1] ^= 0x80
    (ckpt / ADAPTER_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"files\['adapter.safetensors'\].sha256"):
        loaded.read_verified(ADAPTER_FILE)


def test_rejects_an_older_planning_identity(ckpt):
    def edit(value: dict) -> None:
        identity = value["auxiliary_state"]["training_runtime_planning_identity"]
        identity["schema"] = "kiln.training-checkpoint-planning.v3"
        del identity["sft_loss_route"]

    _edit_manifest(ckpt, edit)
    _reject(ckpt, "'kiln.training-checkpoint-planning.v3' is not the SFT planning identity")


def test_rejects_a_different_planned_route(ckpt):
    _edit_manifest(
        ckpt,
        lambda v: v["auxiliary_state"]["training_runtime_planning_identity"].update(sft_loss_route="bogus"),
    )
    _reject(ckpt, "sft_loss_route: 'bogus' is not one of")


def test_rejects_recorded_stochastic_rounding(ckpt):
    def edit(value: dict) -> None:
        value["precision_policy"]["stochastic_rounding"] = {"mode": "stochastic", "seed": 11}
        value["auxiliary_state"]["training_precision_policy"] = value["precision_policy"]

    _edit_manifest(ckpt, edit)
    _reject(ckpt, "legacy stochastic-rounding checkpoint is not resumable")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_history": [1.0] * 6}, "loss_history has 6 entries, global_step is 7"),
        ({"last_loss": 0.25}, "last_loss 0.25 is not the last loss_history entry"),
        ({"current_epoch_items": 3}, "current_epoch_items 3 differs from cursor_in_epoch 2"),
        ({"first_epoch_loss": None}, "first_epoch_loss must be present at epoch_index 1"),
        (
            {"cursor_in_epoch": 3, "current_epoch_items": 3},
            "cursor_in_epoch 3 differs from progress.cursor_in_epoch 2",
        ),
    ],
)
def test_rejects_broken_loop_state(ckpt, change, message):
    value = loop_state(7).model_dump(mode="json")
    value.update(change)
    _replace_file(ckpt, LOOP_STATE_FILE, json.dumps(value).encode())
    _reject(ckpt, message)


def test_rejects_non_finite_loop_state(ckpt):
    text = (
        loop_state(7)
        .to_bytes()
        .decode()
        .replace('"current_epoch_loss_sum": ', '"current_epoch_loss_sum": NaN, "x": ')
    )
    _replace_file(ckpt, LOOP_STATE_FILE, text.encode())
    _reject(ckpt, "NaN is not valid JSON")


def test_rejects_inconsistent_progress_arithmetic(ckpt):
    _edit_manifest(ckpt, lambda v: v["progress"].update(cursor_in_epoch=1))
    _reject(ckpt, "progress.global_step: 7 is not epoch_index 1 x item_count 5 + cursor_in_epoch 1")


def test_rejects_a_data_order_that_is_not_the_seeded_one(ckpt):
    def edit(value: dict) -> None:
        value["progress"]["data_order"] = sorted(value["progress"]["data_order"])

    _edit_manifest(ckpt, edit)
    _reject(ckpt, "progress.data_order: differs from the seeded order for epoch 1")


def test_discovery_validates_manifests_only_and_sorts_by_step(tmp_path):
    registry = tmp_path / "adapters"
    three = publish(registry, 3).path
    publish(registry, 7)
    broken = publish(registry, 9).path
    (broken / ".incomplete").write_bytes(b"sft-step-00000009\n")
    (registry / f".{NAME}.incomplete-0000").mkdir()  # a stale staging dir is not a checkpoint
    (registry / "support-bot").mkdir()  # the adapter itself
    other = publish(tmp_path / "elsewhere", 5).path
    shutil.move(other, registry / other.name.replace("support-bot", "support-bot-2"))
    # A tampered artifact is invisible to manifest-only discovery but fails full validation.
    data = bytearray((three / ADAPTER_FILE).read_bytes())
    data[-1] ^= 1
    (three / ADAPTER_FILE).write_bytes(bytes(data))

    found = discover_checkpoints(registry, "support-bot")
    assert [(c.global_step, c.valid) for c in found] == [(3, True), (7, True), (9, False)]
    assert found[0].manifest.checkpoint_id == "sft-step-00000003"
    assert (
        found[1].manifest_sha256
        == hashlib.sha256((found[1].path / MANIFEST_FILENAME).read_bytes()).hexdigest()
    )
    assert "'.incomplete' sentinel" in found[2].error and found[2].manifest is None
    assert [c for c in found if c.valid][-1].global_step == 7  # the newest valid one
    assert [c.global_step for c in discover_checkpoints(registry, "support-bot-2")] == [5]
    assert discover_checkpoints(registry, "nobody") == []
    assert discover_checkpoints(tmp_path / "missing", "support-bot") == []
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(three)
