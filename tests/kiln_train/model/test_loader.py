"""Checkpoint loading: layouts (wrapper or not, single or sharded, prefixes), MTP/vision, errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kiln_train.errors import TRAINING_BACKEND_UNSUPPORTED, KilnError
from kiln_train.model import ModelCheckpointError, load_model
from kiln_train.model.tiny import write_tiny_checkpoint
from tests.kiln_train.model.checkpoint_edits import copy_checkpoint, edit_config

OVERRIDES = {"vocab_size": 160, "bos_token_id": None, "eos_token_id": None}
SMALL_VOCAB = {"vocab_size": 96, "bos_token_id": None, "eos_token_id": None}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("src"), "tiny", seed=8, overrides=OVERRIDES, with_tokenizer=False
    )


@pytest.fixture(scope="module")
def reference_logits(ckpt):
    ids = torch.randint(0, 160, (1, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return ids, load_model(ckpt).logits(ids)


def _copy_with(ckpt, dest, tensors, config=None):
    dest.mkdir(parents=True, exist_ok=True)
    config = config or json.loads((ckpt / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def _same_logits(path, reference_logits):
    ids, ref = reference_logits
    with torch.no_grad():
        assert torch.equal(load_model(path).logits(ids), ref)


def test_loads_every_trunk_tensor_in_the_backend_dtype(ckpt):
    model = load_model(ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    buffers = dict(model.named_buffers())
    for key, value in tensors.items():
        if key.startswith("model.language_model."):
            local = key.removeprefix("model.language_model.")
            assert buffers[local].dtype == torch.float32
            assert torch.equal(buffers[local], value.float()), key
    assert len(buffers) == sum(k.startswith("model.language_model.") for k in tensors)
    assert model.mtp_tensor_names == sorted(k for k in tensors if k.startswith("mtp."))
    assert "mtp.fc.weight" in model.mtp_tensor_names
    assert not any(b.is_meta for b in model.buffers())
    assert load_model(ckpt, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_text_only_config_and_model_prefix(ckpt, tmp_path, reference_logits):
    tensors = load_file(str(ckpt / "model.safetensors"))
    renamed = {k.replace("model.language_model.", "model."): v for k, v in tensors.items()}
    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    _same_logits(_copy_with(ckpt, tmp_path / "plain", renamed, config=text), reference_logits)


def test_sharded_checkpoint_with_index(ckpt, tmp_path, reference_logits):
    tensors = load_file(str(ckpt / "model.safetensors"))
    dest = tmp_path / "sharded"
    dest.mkdir()
    shutil.copy(ckpt / "config.json", dest / "config.json")
    keys = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((keys[::3], keys[1::3], keys[2::3])):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: tensors[k] for k in part}, str(dest / name))
        weight_map.update({k: name for k in part})
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _same_logits(dest, reference_logits)
    (dest / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelCheckpointError, match="model-00002-of-00003.safetensors"):
        load_model(dest)


def test_vision_tensors_and_tied_head_copy_are_ignored(ckpt, tmp_path, reference_logits):
    tensors = load_file(str(ckpt / "model.safetensors"))
    extra = {
        **tensors,
        "model.visual.patch_embed.proj.weight": torch.zeros(4, 3),
        "model.visual.blocks.0.norm1.weight": torch.zeros(4),
        "lm_head.weight": tensors["model.language_model.embed_tokens.weight"].clone(),
    }
    _same_logits(_copy_with(ckpt, tmp_path / "vl", extra), reference_logits)


def test_untied_head_is_loaded_and_required(ckpt, tmp_path):
    tensors = load_file(str(ckpt / "model.safetensors"))
    config = json.loads((ckpt / "config.json").read_text())
    config["tie_word_embeddings"] = False
    config["text_config"]["tie_word_embeddings"] = False
    head = torch.randn(160, 64).to(torch.bfloat16)
    model = load_model(_copy_with(ckpt, tmp_path / "untied", {**tensors, "lm_head.weight": head}, config))
    assert torch.equal(model.lm_head_weight, head.float())
    assert model.lm_head_weight is not model.embed_tokens.weight
    with pytest.raises(ModelCheckpointError, match="lm_head.weight") as err:
        load_model(_copy_with(ckpt, tmp_path / "headless", tensors, config))
    assert err.value.tensor == "lm_head.weight"


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda t: t.pop("model.language_model.layers.1.linear_attn.A_log"), "layers.1.linear_attn.A_log"),
        (lambda t: t.update({"model.language_model.layers.0.mlp.extra.weight": torch.zeros(2)}), "mlp.extra"),
        (lambda t: t.update({"vision_tower.weight": torch.zeros(2)}), "vision_tower.weight"),
        (
            lambda t: t.update({"model.language_model.norm.weight": torch.zeros(63)}),
            "model.language_model.norm.weight",
        ),
        (
            lambda t: t.update(
                {"model.embed_tokens.weight": t["model.language_model.embed_tokens.weight"].clone()}
            ),
            "duplicates",
        ),
        (
            lambda t: t.update(
                {"model.language_model.layers.0.linear_attn.dt_bias": torch.zeros(4, dtype=torch.int32)}
            ),
            "unsupported dtype",
        ),
    ],
)
def test_bad_checkpoints_raise_a_named_error(ckpt, tmp_path, mutate, needle):
    tensors = load_file(str(ckpt / "model.safetensors"))
    mutate(tensors)
    with pytest.raises(ModelCheckpointError, match=needle) as err:
        load_model(_copy_with(ckpt, tmp_path / "bad", tensors))
    assert isinstance(err.value, KilnError) and err.value.code == TRAINING_BACKEND_UNSUPPORTED
    assert err.value.tensor is not None


def test_missing_files_raise(tmp_path, ckpt):
    with pytest.raises(KilnError, match="config.json"):
        load_model(tmp_path)
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelCheckpointError, match="model.safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ModelCheckpointError, match="weight_map"):
        load_model(tmp_path)


def test_tensors_are_read_lazily_from_the_mapped_file(ckpt):
    """Shapes are checked from the header before any tensor is read (safe_open slices)."""
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        view = f.get_slice("model.language_model.embed_tokens.weight")
        assert tuple(view.get_shape()) == (160, 64) and view.get_dtype() == "BF16"


def test_in_memory_tensors_load_like_the_file(ckpt, reference_logits):
    from kiln_train.model import Qwen35Model, load_tensors_into
    from kiln_train.model.config import load_config

    with torch.device("meta"):
        model = Qwen35Model(load_config(ckpt))
    tensors = load_file(str(ckpt / "model.safetensors"))
    load_tensors_into(model, tensors)
    ids, ref = reference_logits
    with torch.no_grad():
        assert torch.equal(model.logits(ids), ref)
    assert model.mtp_tensor_names == sorted(k for k in tensors if k.startswith("mtp."))
    tensors.pop("model.language_model.norm.weight")
    with pytest.raises(ModelCheckpointError, match="norm.weight"):
        load_tensors_into(model, tensors)


PEAK_RSS_SCRIPT = """
import sys, torch
from kiln_train.model import load_model

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

torch.zeros(1)
base = kib("VmRSS")
model = load_model(sys.argv[1])
size = sum(b.numel() * b.element_size() for b in model.buffers())
print(size, (kib("VmHWM") - base) * 1024)
"""


def test_loading_holds_the_weights_once(tmp_path):
    """Peak RSS while loading ≈ the f32 model + the mapped bf16 file, never a second model copy."""
    import subprocess
    import sys

    path = write_tiny_checkpoint(tmp_path, "tiny", seed=0, with_tokenizer=False)  # full vocab: 61 MiB in f32
    out = subprocess.run(
        [sys.executable, "-c", PEAK_RSS_SCRIPT, str(path)], capture_output=True, text=True, check=True
    )
    model_bytes, peak_delta = map(int, out.stdout.split())
    file_bytes = (path / "model.safetensors").stat().st_size
    assert model_bytes > 60 * 2**20
    assert peak_delta < model_bytes + file_bytes + 16 * 2**20, (model_bytes, file_bytes, peak_delta)


@pytest.mark.parametrize("mtp_layers,with_tensors", [(0, True), (1, False), (2, True)])
def test_mtp_tensors_are_recognised_whatever_the_config_says(tmp_path, mtp_layers, with_tensors):
    source = write_tiny_checkpoint(
        tmp_path / "src",
        "tiny",
        seed=3,
        overrides={**SMALL_VOCAB, "mtp_num_hidden_layers": 2},
        with_tokenizer=False,
    )
    tensors = load_file(str(source / "model.safetensors"))
    mtp = sorted(k for k in tensors if k.startswith("mtp."))
    assert "mtp.layers.1.self_attn.q_proj.weight" in mtp
    if not with_tensors:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    dest = edit_config(
        copy_checkpoint(source, tmp_path / "m", tensors),
        lambda c: c["text_config"].update(mtp_num_hidden_layers=mtp_layers),
    )
    model = load_model(dest)
    assert model.config.mtp_num_hidden_layers == mtp_layers
    assert model.mtp_tensor_names == (mtp if with_tensors else [])
    assert model.config.base_parameter_count() == sum(b.numel() for b in model.buffers())
