"""Probe: model directories that used to load silently wrong, crash with a traceback or allocate.

Every refusal is a KilnError with code training_backend_unsupported naming the file and field.
"""

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

from kiln_train.data.chat_template import ChatTemplateSourceError, load_model_chat_template
from kiln_train.data.tokenizer import TokenizerFileError, load_tokenizer
from kiln_train.errors import TRAINING_BACKEND_UNSUPPORTED, KilnError
from kiln_train.model import load_model
from kiln_train.model.config import parse_config
from kiln_train.model.resident import load_resident
from kiln_train.model.tiny import text_config, wrapper_config, write_tiny_checkpoint

SMALL = {"vocab_size": 160, "bos_token_id": None, "eos_token_id": None}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("src"), "tiny", seed=5, overrides=SMALL, with_tokenizer=False
    )


@pytest.fixture(scope="module")
def full(tmp_path_factory, qwen_tokenizer):
    """A complete checkpoint (tokenizer, chat template) for load_resident."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("full"), "tiny", seed=5, tokenizer=qwen_tokenizer)


def copy(src, dest):
    shutil.copytree(src, dest, symlinks=True)
    return dest


def refused(call, *args) -> KilnError:
    with pytest.raises(KilnError) as err:
        call(*args)
    assert err.value.code == TRAINING_BACKEND_UNSUPPORTED
    return err.value


def config_with(**changes) -> dict:
    text = text_config("tiny", SMALL)
    text.update(changes)
    return wrapper_config(text)


# ----- config.json: sizes beyond any real model are refused before anything is built ---------------


@pytest.mark.parametrize(
    ("field", "value", "ceiling"),
    [
        ("vocab_size", 10**12, 1 << 24),
        ("vocab_size", 10**30, 1 << 24),  # was: TypeError from torch.empty (int64 overflow)
        ("hidden_size", 10**9, 1 << 20),
        ("num_hidden_layers", 10**7, 1024),  # was: minutes building modules on the meta device
        ("num_hidden_layers", 10**12, 1024),  # was: MemoryError building layer_types
        ("head_dim", 10**7, 1 << 20),
    ],
)
def test_huge_sizes_are_refused_at_parse(field, value, ceiling):
    changes = {field: value}
    if field == "num_hidden_layers":
        changes["layer_types"] = None
    with pytest.raises(KilnError) as err:
        parse_config(config_with(**changes))
    assert (
        f"field {field!r} (in text_config) is {value}, beyond the largest supported value {ceiling}"
        in str(err.value)
    )


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


def test_a_long_bogus_layer_types_list_is_not_echoed_whole():
    with pytest.raises(KilnError) as err:
        parse_config(config_with(layer_types=["linear_attention"] * 100_000))
    assert "(100000 entries)" in str(err.value) and len(str(err.value)) < 2000


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": -5.0, "partial_rotary_factor": 0.25}},
            "rope_theta -5.0",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 0, "partial_rotary_factor": 0.25}},
            "must be positive",
        ),
        ({"hidden_act": "gelu"}, "field 'hidden_act' (in text_config) is 'gelu'; only 'silu' is implemented"),
        ({"attention_bias": True}, "field 'attention_bias' (in text_config) is True"),
        (
            {"quantization_config": {"quant_method": "fp8"}},
            "text_config has a quantization_config (quant_method 'fp8')",
        ),
    ],
)
def test_configs_kiln_would_compute_differently_are_refused(changes, needle):
    """Each of these used to load and silently run other math than transformers (NaN RoPE tables from
    θ <= 0, SiLU in place of the configured activation, no q/k/v/o biases, unquantized reads)."""
    with pytest.raises(KilnError) as err:
        parse_config(config_with(**changes))
    assert needle in str(err.value)


def test_the_supported_spellings_still_parse():
    assert (
        parse_config(
            config_with(hidden_act="silu", attention_bias=False, quantization_config=None)
        ).hidden_size
        == 64
    )
    wrapper = config_with()
    wrapper["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(KilnError, match=r"config.json has a quantization_config \(quant_method 'gptq'\)"):
        parse_config(wrapper)


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
    """Was: the weights were read from outside the directory, and the execution identity (digests of
    the directory's own *.safetensors) did not cover them; with no shard inside, load_resident raised
    a bare ValueError."""
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


# ----- tokenizer and template files -------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "EOF while parsing"),
        (b'{"version": 1}', "invalid type"),
        (b"\xff\xfe\x00", "valid UTF-8"),
    ],
)
def test_a_corrupt_tokenizer_json_is_a_named_load_error(full, tmp_path, content, needle):
    """Was: a bare `Exception` from tokenizers, which `kiln worker` and `kiln data inspect` printed as
    a traceback."""
    dest = copy(full, tmp_path / "m")
    (dest / "tokenizer.json").write_bytes(content)
    for call in (load_tokenizer, load_resident):
        with pytest.raises(TokenizerFileError) as err:
            call(dest)
        assert err.value.code == TRAINING_BACKEND_UNSUPPORTED
        assert err.value.file == str(dest / "tokenizer.json") and needle in err.value.message


def _template_in_tokenizer_config(dest, value):
    os.remove(dest / "chat_template.jinja")
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg["chat_template"] = value
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: (d / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}"), "chat_template.jinja in"),
        (
            lambda d: _template_in_tokenizer_config(d, [{"name": "default", "template": "x"}]),
            "field 'chat_template' is a list of named templates, not a template string",
        ),
        (lambda d: _template_in_tokenizer_config(d, 5), "field 'chat_template' is a number"),
        (
            lambda d: (
                os.remove(d / "chat_template.jinja"),
                (d / "tokenizer_config.json").write_text("{oops"),
            ),
            "tokenizer_config.json in",
        ),
        (
            lambda d: (os.remove(d / "chat_template.jinja"), (d / "tokenizer_config.json").write_text("[1]")),
            "must be a JSON object, got list",
        ),
    ],
)
def test_unreadable_template_sources_are_named_by_load_resident(full, tmp_path, mutate, needle):
    """Were: UnicodeDecodeError / JSONDecodeError / AttributeError tracebacks, or the misleading
    "the model directory has no chat template" for a tokenizer_config.json that has one."""
    dest = copy(full, tmp_path / "m")
    mutate(dest)
    with pytest.raises(ChatTemplateSourceError) as err:
        load_resident(dest)
    assert needle in err.value.message and err.value.file in ("chat_template.jinja", "tokenizer_config.json")
    assert err.value.code == "training_backend_unsupported"
    # The same reading serves `kiln data inspect --model` (torch-free): the same named error.
    with pytest.raises(ChatTemplateSourceError) as again:
        load_model_chat_template(dest)
    assert again.value.message == err.value.message


def test_memory_stays_small_for_a_refused_config(ckpt, tmp_path):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dest = copy(ckpt, tmp_path / "m")
    config = json.loads((dest / "config.json").read_text())
    config["text_config"]["vocab_size"] = 10**12
    (dest / "config.json").write_text(json.dumps(config))
    refused(load_model, dest)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB
