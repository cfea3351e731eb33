"""Atomic publication: layout, refusal to overwrite, bad input, crash at every stage.

See docs/checkpoints.md#publication.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save_file

from kiln_train.checkpoint import (
    ADAPTER_FILE,
    LOOP_STATE_FILE,
    MANIFEST_FILENAME,
    OPTIMIZER_FILE,
    CheckpointError,
    discover_checkpoints,
    load_checkpoint,
    publish_checkpoint,
)
from kiln_train.checkpoint import publish as publish_module
from tests.kiln_train.checkpoint.checkpoint_support import (
    LORA_KEY,
    PUBLICATION_STAGES,
    artifacts,
    auxiliary_state,
    draft,
    loop_state,
    publish,
)

NAME = "support-bot-checkpoint-step-00000007.kiln-checkpoint"


def _entries(registry: Path) -> list[str]:
    return sorted(os.listdir(registry))


def test_publishes_the_contract_layout(tmp_path):
    arts = artifacts(7)
    published = publish_checkpoint(tmp_path, draft(7), arts)
    assert published.path == tmp_path / NAME
    assert _entries(tmp_path) == [NAME]
    assert sorted(os.listdir(published.path)) == sorted(
        [MANIFEST_FILENAME, ADAPTER_FILE, OPTIMIZER_FILE, LOOP_STATE_FILE]
    )
    manifest_bytes = (published.path / MANIFEST_FILENAME).read_bytes()
    assert published.manifest_sha256 == hashlib.sha256(manifest_bytes).hexdigest()
    body = json.loads(manifest_bytes)
    assert body["checkpoint_id"] == "sft-step-00000007"
    for rel, data in arts.items():
        assert (published.path / rel).read_bytes() == data
        assert body["files"][rel]["size_bytes"] == len(data)
        assert body["files"][rel]["sha256"] == hashlib.sha256(data).hexdigest()
    assert body["files"][ADAPTER_FILE]["role"] == "adapter-parameters"
    assert body["files"][OPTIMIZER_FILE]["role"] == "optimizer-state"
    assert body["files"][LOOP_STATE_FILE]["role"] == "loss-history"
    assert published.total_bytes == sum(len(d) for d in arts.values()) + len(manifest_bytes)
    assert published.publish_ms > 0.0
    assert oct(os.stat(published.path).st_mode & 0o777) == "0o755"


def test_writer_callables_and_sgd(tmp_path):
    a = torch.randn(2, 8)

    def write_adapter(path: Path) -> None:
        save_file({LORA_KEY.format("A"): a}, str(path))

    arts = {ADAPTER_FILE: write_adapter, LOOP_STATE_FILE: loop_state(3).to_bytes()}
    published = publish_checkpoint(tmp_path, draft(3, "sgd"), arts)
    loaded = load_checkpoint(published.path)
    assert torch.equal(load(loaded.read_verified(ADAPTER_FILE))[LORA_KEY.format("A")], a)
    assert "optimizer_state" not in published.manifest.to_json()["state_files"]


def test_never_overwrites(tmp_path):
    first = publish(tmp_path, 7)
    before = {p.name: p.read_bytes() for p in first.path.iterdir()}
    with pytest.raises(CheckpointError, match="already exists; checkpoint names are never overwritten"):
        publish(tmp_path, 7)
    assert {p.name: p.read_bytes() for p in first.path.iterdir()} == before
    assert _entries(tmp_path) == [NAME]


def test_an_existing_empty_directory_is_not_replaced(tmp_path):
    (tmp_path / NAME).mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        publish(tmp_path, 7)
    assert os.listdir(tmp_path / NAME) == []


def test_a_name_taken_during_publication_is_not_replaced(tmp_path, monkeypatch):
    # The target appears after the early existence check: the no-replace rename must refuse it.
    original = publish_module.remove_sentinel

    def squat(staging: Path) -> None:
        original(staging)
        (tmp_path / NAME).mkdir()

    monkeypatch.setattr(publish_module, "remove_sentinel", squat)
    with pytest.raises(CheckpointError, match="already exists"):
        publish(tmp_path, 7)
    assert _entries(tmp_path) == [NAME]
    assert os.listdir(tmp_path / NAME) == []


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d, a: (d, {k: v for k, v in a.items() if k != OPTIMIZER_FILE}), "no artifact was given"),
        (lambda d, a: (d, {**a, "notes.txt": b"x"}), "artifacts['notes.txt']: no role"),
        (lambda d, a: (d, {**a, "../escape.bin": b"x"}), "not a normalised relative path"),
        (
            lambda d, a: (d, {**a, LOOP_STATE_FILE: loop_state(6).to_bytes()}),
            "global_step 6 differs from progress",
        ),
        (lambda d, a: (d, {**a, LOOP_STATE_FILE: b"{}"}), "sft_loop_state.json"),
        (
            lambda d, a: (draft(7, training_runtime_planning_identity={"schema": "x"}), a),
            "training_runtime_planning_identity.schema",
        ),
    ],
)
def test_bad_input_leaves_nothing_behind(tmp_path, mutate, message):
    d, a = mutate(draft(7), artifacts(7))
    with pytest.raises(CheckpointError) as info:
        publish_checkpoint(tmp_path, d, a)
    assert message in info.value.message
    assert _entries(tmp_path) == []


def test_roles_for_extra_files(tmp_path):
    arts = {**artifacts(7), "rng/state.bin": b"\x00\x01"}
    published = publish_checkpoint(tmp_path, draft(7), arts, roles={"rng/state.bin": "rng-state"})
    assert published.manifest.files["rng/state.bin"].role == "rng-state"
    assert load_checkpoint(published.path).files["rng/state.bin"].size_bytes == 2
    with pytest.raises(CheckpointError, match="conflicts with the state_files role"):
        publish_checkpoint(tmp_path / "other", draft(7), artifacts(7), roles={ADAPTER_FILE: "ema-state"})


@pytest.mark.parametrize("kind", ["extra file", "symlink", "hard link", "no file"])
def test_the_staging_file_set_is_checked(tmp_path, kind):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"outside")
    registry = tmp_path / "adapters"
    data = artifacts(7)[ADAPTER_FILE]

    def writer(path: Path) -> None:
        if kind == "symlink":
            os.symlink(outside, path)
            return
        if kind == "hard link":
            path.write_bytes(data)
            os.link(path, outside.with_name("second-link.bin"))
            return
        if kind == "extra file":
            path.write_bytes(data)
            path.with_name("scratch.tmp").write_bytes(b"left over")

    with pytest.raises(CheckpointError) as info:
        publish_checkpoint(registry, draft(7), {**artifacts(7), ADAPTER_FILE: writer})
    expected = {
        "extra file": "unexpected ['scratch.tmp']",
        "symlink": "did not create a regular file",
        "hard link": "has 2 hard links",
        "no file": "did not create a regular file",
    }[kind]
    assert expected in info.value.message
    assert _entries(registry) == []


class SimulatedCrash(BaseException):
    """Stands for process death: not an `Exception`, so the publisher cannot clean up."""


def _inject(monkeypatch, stage: str, when: str, error: BaseException) -> None:
    original = getattr(publish_module, stage)

    def crashing(*args, **kwargs):
        if when == "before":
            raise error
        original(*args, **kwargs)
        raise error

    monkeypatch.setattr(publish_module, stage, crashing)


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("stage", PUBLICATION_STAGES)
def test_a_crash_at_any_stage_leaves_nothing_loadable(tmp_path, monkeypatch, stage, when):
    with monkeypatch.context() as patch:
        _inject(patch, stage, when, SimulatedCrash())
        with pytest.raises(SimulatedCrash):
            publish(tmp_path, 7)

    renamed = PUBLICATION_STAGES.index(stage) > PUBLICATION_STAGES.index("rename_into_place") or (
        stage == "rename_into_place" and when == "after"
    )
    stale = [name for name in _entries(tmp_path) if name != NAME]
    if renamed:
        # The rename happened: the name holds a complete checkpoint.
        assert load_checkpoint(tmp_path / NAME).manifest.checkpoint_id == "sft-step-00000007"
        assert stale == []
        return
    assert not (tmp_path / NAME).exists()
    assert discover_checkpoints(tmp_path, "support-bot") == []
    for name in stale:
        assert name.startswith(f".{NAME}.incomplete-")
        with pytest.raises(CheckpointError):
            load_checkpoint(tmp_path / name)
    if stage == "write_sentinel" and when == "after":
        (staging,) = stale
        assert (tmp_path / staging / ".incomplete").read_bytes() == b"sft-step-00000007\n"
    # A later writer publishes the same name beside the stale staging directory.
    again = publish(tmp_path, 7)
    assert load_checkpoint(again.path).manifest.checkpoint_id == "sft-step-00000007"
    assert _entries(tmp_path) == sorted([NAME, *stale])


@pytest.mark.parametrize("stage", ["write_artifacts", "hash_artifacts", "write_manifest", "remove_sentinel"])
def test_an_ordinary_failure_removes_the_staging_directory(tmp_path, monkeypatch, stage):
    with monkeypatch.context() as patch:
        _inject(patch, stage, "after", OSError(28, "No space left on device"))
        with pytest.raises(OSError, match="No space left"):
            publish(tmp_path, 7)
    assert _entries(tmp_path) == []
    publish(tmp_path, 7)
    assert _entries(tmp_path) == [NAME]


def test_an_invalid_auxiliary_state_is_rejected_before_writing(tmp_path):
    d = draft(7)
    bad = type(d)(**{**d.__dict__, "auxiliary_state": auxiliary_state(loop_state_type="x")})
    with pytest.raises(CheckpointError, match="auxiliary_state.loop_state_type"):
        publish_checkpoint(tmp_path, bad, artifacts(7))
    assert _entries(tmp_path) == []
