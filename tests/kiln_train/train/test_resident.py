"""load_resident: the model, tokenizer and template that a worker keeps between jobs; unreadable
tokenizer and template files are named load errors (`training_backend_unsupported`), never a
traceback."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kiln_train.data.chat_template import ChatTemplateSourceError, load_model_chat_template
from kiln_train.data.tokenizer import TokenizerFileError, load_tokenizer
from kiln_train.errors import TRAINING_BACKEND_UNSUPPORTED
from kiln_train.model.loader import ModelCheckpointError
from kiln_train.model.tiny import write_tiny_checkpoint
from kiln_train.train.resident import load_resident


def test_a_tokenizer_with_ids_beyond_the_embedding_is_refused_at_load(tmp_path):
    path = write_tiny_checkpoint(
        tmp_path / "m",
        "tiny",
        seed=3,
        overrides={"vocab_size": 512, "bos_token_id": None, "eos_token_id": None},
    )
    with pytest.raises(ModelCheckpointError) as err:
        load_resident(path)
    assert "vocab_size is 512" in str(err.value)
    assert "248076" in str(err.value)
    assert err.value.file.endswith("tokenizer.json")


def test_a_full_vocabulary_checkpoint_loads_with_its_identity(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", "tiny", seed=3)
    resident = load_resident(path)
    assert resident.config.vocab_size == 248320
    assert resident.tokenizer.get_vocab_size(with_added_tokens=True) == 248077
    assert resident.execution_identity_digest == resident.provenance["provenance_sha256"]
    assert resident.backend.name == "cpu"


def test_the_cpu_resident_records_and_runs_the_torch_kernel_paths(tmp_path):
    """The kernel paths are the backend's (docs/kernels.md#choice): recorded in the provenance
    the execution identity digests, and set on the model's modules."""
    resident = load_resident(write_tiny_checkpoint(tmp_path / "m", "tiny", seed=3))
    kernels = resident.provenance["kernels"]
    assert (
        kernels["paths"]
        == resident.kernel_paths.to_dict()
        == {
            "causal_conv1d_silu": "torch",
            "gated_delta_rule": "torch-chunked",
            "gated_rms_norm": "torch",
            "offset_rms_norm": "torch",
            "swiglu": "torch",
        }
    )
    assert kernels["compiled_features"] == sorted(
        ["chunked-linear-ce", "sdpa-attention", *resident.kernel_paths.features()]
    )
    assert resident.compiled_features == kernels["compiled_features"]
    on_modules = {getattr(m, "kernel_path", None) for m in resident.model.modules()} - {None}
    assert on_modules == {"torch"}
    assert {layer.linear_attn.impl for layer in resident.model.layers if layer.is_linear_attention} == {
        "chunk"
    }


# ----- tokenizer and template files ----------------------------------------------------------------


@pytest.fixture(scope="module")
def full(tmp_path_factory, qwen_tokenizer):
    """A complete checkpoint (tokenizer, chat template) for load_resident."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("full"), "tiny", seed=5, tokenizer=qwen_tokenizer)


def copy(src, dest):
    shutil.copytree(src, dest, symlinks=True)
    return dest


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "EOF while parsing"),
        (b'{"version": 1}', "invalid type"),
        (b"\xff\xfe\x00", "valid UTF-8"),
    ],
)
def test_a_corrupt_tokenizer_json_is_a_named_load_error(full, tmp_path, content, needle):
    """A tokenizer.json the tokenizers library cannot read is a `TokenizerFileError` naming the file,
    which `kiln worker` and `kiln data inspect` report in one line."""
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
    """A template file that is not UTF-8, a tokenizer_config.json that is not JSON or not an object,
    and a `chat_template` field that is not a string are each a `ChatTemplateSourceError` naming the
    file and what is wrong with it."""
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
