"""Adapter publication against a name taken at the last moment (DESIGN §4: names are never
overwritten). The adapter's rename used plain rename(2), which silently replaces an empty
directory created under the final name after the existence check; checkpoints already used the
no-replace rename."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln_train.artifacts import adapter as adapter_module
from kiln_train.artifacts.adapter import publish_adapter
from kiln_train.errors import KilnError


def _publish(registry, name):
    tensors = {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 3)}
    return publish_adapter(
        registry,
        name,
        tensors,
        rank=2,
        alpha=4.0,
        build_receipt=lambda output: {"status": "success", "output": output},
        build_manifest=lambda receipt, hashes: {"adapter_name": name, **hashes},
    )


def test_an_empty_directory_taking_the_name_at_the_last_moment_is_not_replaced(tmp_path, monkeypatch):
    registry = tmp_path / "adapters"
    registry.mkdir()
    name = "raced"
    target = registry / name
    real_fsync_dir = adapter_module.fsync_dir

    def synced_then_taken(path):
        real_fsync_dir(path)
        if Path(path).name.startswith(f".{name}.incomplete-"):  # the staging is complete: another
            target.mkdir()  # publisher (an import, a restore) takes the name right before the rename

    monkeypatch.setattr(adapter_module, "fsync_dir", synced_then_taken)
    with pytest.raises(KilnError) as refused:
        _publish(registry, name)
    monkeypatch.undo()
    assert refused.value.code == "adapter_already_exists"
    assert target.is_dir() and list(target.iterdir()) == []  # theirs, untouched
    assert sorted(p.name for p in registry.iterdir()) == [name]  # no staging directory left behind


def test_publication_still_works(tmp_path):
    path = _publish(tmp_path / "adapters", "fine")
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json",
        "adapter_manifest.json",
        "adapter_model.safetensors",
        "train_receipt.json",
    ]
