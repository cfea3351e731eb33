"""Copies of a tiny checkpoint directory with an edited config.json or other tensors, for the
config and loader tests."""

from __future__ import annotations

import json
import shutil

from safetensors.torch import load_file, save_file


def edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


def copy_checkpoint(source, dest, tensors=None, *, shards=None):
    """A copy of `source` with these tensors, in one file or in named shards with an index."""
    dest.mkdir()
    shutil.copy(source / "config.json", dest / "config.json")
    tensors = load_file(str(source / "model.safetensors")) if tensors is None else tensors
    if shards is None:
        save_file(tensors, str(dest / "model.safetensors"))
        return dest
    weight_map = {}
    for name, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(dest / name))
        weight_map.update(dict.fromkeys(keys, name))
    return dest, weight_map
