"""Checkpoints load_model refuses, naming the tensor, the file and expected vs got shape
(`ModelCheckpointError`), or the path and field; sharded indexes may name only files of the model
directory; a refused config allocates nothing."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln_train.errors import TRAINING_BACKEND_UNSUPPORTED, KilnError
from kiln_train.model import ModelCheckpointError, load_model
from kiln_train.model.tiny import write_tiny_checkpoint
from tests.kiln_train.model.checkpoint_edits import copy_checkpoint, edit_config

OVERRIDES = {"vocab_size": 96, "bos_token_id": None, "eos_token_id": None}
PREFIX = "model.language_model."
QKV = PREFIX + "layers.0.linear_attn.in_proj_qkv.weight"

SMALL = {"vocab_size": 160, "bos_token_id": None, "eos_token_id": None}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("src"), "tiny", seed=4, overrides=OVERRIDES, with_tokenizer=False
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("src"), "tiny", seed=5, overrides=SMALL, with_tokenizer=False
    )


def copy(src, dest):
    shutil.copytree(src, dest, symlinks=True)
    return dest


def refused(call, *args) -> KilnError:
    with pytest.raises(KilnError) as err:
        call(*args)
    assert err.value.code == TRAINING_BACKEND_UNSUPPORTED
    return err.value


def _load_error(path) -> ModelCheckpointError:
    with pytest.raises(ModelCheckpointError) as err:
        load_model(path)
    assert err.value.code == TRAINING_BACKEND_UNSUPPORTED
    return err.value


def test_a_missing_tensor_names_its_checkpoint_key_and_shape(source, tmp_path):
    tensors = load_file(str(source / "model.safetensors"))
    tensors.pop(QKV)
    err = _load_error(copy_checkpoint(source, tmp_path / "m", tensors))
    assert err.tensor == QKV
    assert f"checkpoint (model.safetensors) is missing tensor(s) '{QKV}' (shape (128, 64))" in err.message


def test_a_wrong_shape_names_file_tensor_and_both_shapes(source, tmp_path):
    tensors = load_file(str(source / "model.safetensors"))
    keys = sorted(tensors)
    tensors[QKV] = torch.zeros(96, 64, dtype=torch.bfloat16)
    dest, weight_map = copy_checkpoint(
        source, tmp_path / "s", tensors, shards={"a.safetensors": keys[:30], "b.safetensors": keys[30:]}
    )
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    err = _load_error(dest)
    assert (err.tensor, err.file) == (QKV, weight_map[QKV])
    assert f"tensor '{QKV}' in {weight_map[QKV]} has shape (96, 64), expected (128, 64)" in err.message


def test_an_unknown_tensor_names_its_file(source, tmp_path):
    tensors = load_file(str(source / "model.safetensors"))
    tensors[PREFIX + "layers.1.linear_attn.conv1d.bias"] = torch.zeros(128)
    err = _load_error(copy_checkpoint(source, tmp_path / "u", tensors))
    assert err.file == "model.safetensors"
    assert f"unexpected tensor '{PREFIX}layers.1.linear_attn.conv1d.bias' in model.safetensors" in err.message


def test_moe_tensors_under_a_dense_config_are_called_moe(source, tmp_path):
    tensors = load_file(str(source / "model.safetensors"))
    tensors[PREFIX + "layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(8, 64)
    err = _load_error(copy_checkpoint(source, tmp_path / "e", tensors))
    assert "Mixture-of-Experts tensor" in err.message


def test_a_moe_checkpoint_is_refused_before_its_tensors_are_read(source, tmp_path):
    dest = copy_checkpoint(source, tmp_path / "moe")
    edit_config(dest, lambda c: c["text_config"].update(num_experts=8, num_experts_per_tok=2))
    with pytest.raises(KilnError, match="Mixture-of-Experts model .*num_experts=8"):
        load_model(dest)


def test_an_index_listing_a_tensor_its_shard_lacks(source, tmp_path):
    tensors = load_file(str(source / "model.safetensors"))
    keys = sorted(tensors)
    dest, weight_map = copy_checkpoint(source, tmp_path / "i", tensors, shards={"a.safetensors": keys[:20]})
    weight_map.update(dict.fromkeys(keys[20:], "a.safetensors"))
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    err = _load_error(dest)
    assert (err.tensor, err.file) == (keys[20], "a.safetensors")
    assert f"lists tensor '{keys[20]}' in shard a.safetensors, which does not contain it" in err.message


def test_an_index_pointing_at_a_missing_shard(source, tmp_path):
    tensors = load_file(str(source / "model.safetensors"))
    keys = sorted(tensors)
    dest, weight_map = copy_checkpoint(source, tmp_path / "ms", tensors, shards={"a.safetensors": keys[:20]})
    weight_map.update(dict.fromkeys(keys[20:], "b.safetensors"))
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    err = _load_error(dest)
    assert err.file == "b.safetensors"
    assert "shard b.safetensors listed in model.safetensors.index.json" in err.message
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a.safetensors"]}))
    assert "has no valid weight_map" in _load_error(dest).message


def test_unreadable_files_are_named(source, tmp_path):
    dest = copy_checkpoint(source, tmp_path / "c")
    (dest / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    err = _load_error(dest)
    assert err.file == "model.safetensors" and "is not a readable safetensors file" in err.message
    (dest / "config.json").write_text("{not json")
    with pytest.raises(KilnError, match="config.json is not readable JSON") as cfg_err:
        load_model(dest)
    assert cfg_err.value.code == TRAINING_BACKEND_UNSUPPORTED


# ----- token ids beyond the vocabulary ------------------------------------------------------------


def test_token_ids_outside_the_vocabulary_are_a_clear_error(source):
    model = load_model(source)
    with pytest.raises(ValueError, match="token id 96 is outside the model's vocabulary \\(vocab_size 96\\)"):
        model.logits(torch.tensor([[1, 96, 2]]))
    with pytest.raises(ValueError, match="token id -1 is outside"):
        model.logits(torch.tensor([[-1]]))


# ----- paths and sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p.joinpath("config.json"), "is not a directory"),
        (lambda p: p / "nope", "does not exist"),
    ],
)
def test_a_model_path_that_is_not_a_directory_says_so(ckpt, make, needle):
    err = refused(load_model, make(ckpt))
    assert needle in err.message


def test_a_huge_vocabulary_is_refused_by_load_model_without_allocating(ckpt, tmp_path):
    """Run in a child with a 2 GiB address-space cap: any real allocation of the config's shapes dies."""
    dest = copy(ckpt, tmp_path / "huge")
    config = json.loads((dest / "config.json").read_text())
    config["text_config"]["vocab_size"] = 10**12
    (dest / "config.json").write_text(json.dumps(config))
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "from kiln_train.errors import KilnError\n"
        "from kiln_train.model import load_model\n"
        "try:\n"
        f"    load_model({str(dest)!r})\n"
        "except KilnError as exc:\n"
        "    print('REFUSED', exc.message)\n"
        # VmHWM, not ru_maxrss: the latter keeps the forking parent's (pytest's) size across exec.
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
        "print('MAXRSS_KB', hwm)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED" in out.stdout and "'vocab_size'" in out.stdout
    rss_kb = int(out.stdout.split("MAXRSS_KB")[1])
    assert rss_kb < 1_500_000  # imports only (torch + safetensors), no model-sized allocation


def test_memory_stays_small_for_a_refused_config(ckpt, tmp_path):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dest = copy(ckpt, tmp_path / "m")
    config = json.loads((dest / "config.json").read_text())
    config["text_config"]["vocab_size"] = 10**12
    (dest / "config.json").write_text(json.dumps(config))
    refused(load_model, dest)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB


# ----- sharded index: shards must be files of the directory -------------------------------------


def _sharded(ckpt, dest, weight_map_text: str | None = None, names=None):
    dest.mkdir()
    shutil.copy(ckpt / "config.json", dest / "config.json")
    tensors = load_file(str(ckpt / "model.safetensors"))
    save_file(tensors, str(dest / "s1.safetensors"))
    if weight_map_text is None:
        weight_map_text = json.dumps({"weight_map": {k: names(k) for k in tensors}})
    (dest / "model.safetensors.index.json").write_text(weight_map_text)
    return dest, tensors


@pytest.mark.parametrize("where", ["parent", "absolute", "subdir"])
def test_an_index_pointing_outside_the_directory_is_refused(ckpt, tmp_path, where):
    """Shards are read from the model directory only: the execution identity (digests of the
    directory's own *.safetensors) must cover every weight that is loaded."""
    outside = tmp_path / "outside.safetensors"
    save_file(load_file(str(ckpt / "model.safetensors")), str(outside))
    name = {"parent": "../outside.safetensors", "absolute": str(outside), "subdir": "sub/s1.safetensors"}[
        where
    ]
    dest, _ = _sharded(ckpt, tmp_path / "m", names=lambda k: name)
    err = refused(load_model, dest)
    assert err.file == "model.safetensors.index.json" and repr(name) in err.message
    assert "not a file name in the model directory" in err.message


def test_a_symlinked_shard_is_a_file_of_the_directory(ckpt, tmp_path):
    """The Hugging Face cache stores snapshot files as symlinks into ../../blobs: they must load."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    save_file(load_file(str(ckpt / "model.safetensors")), str(blobs / "abc"))
    dest, tensors = _sharded(ckpt, tmp_path / "snap", names=lambda k: "s1.safetensors")
    os.remove(dest / "s1.safetensors")
    os.symlink(blobs / "abc", dest / "s1.safetensors")
    model = load_model(dest)
    assert torch.equal(
        model.embed_tokens.weight.float(), tensors["model.language_model.embed_tokens.weight"].float()
    )


def test_an_index_naming_one_tensor_in_two_shards_is_refused(ckpt, tmp_path):
    text = '{"weight_map": {"model.language_model.norm.weight": "s1.safetensors", "model.language_model.norm.weight": "s2.safetensors"}}'
    dest, _ = _sharded(ckpt, tmp_path / "m", weight_map_text=text)
    err = refused(load_model, dest)
    assert "has no valid weight_map" in err.message and "appears twice" in err.message
