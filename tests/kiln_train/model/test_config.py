"""config.json parsing: transformers' defaults for omitted fields, and refusals naming the field.

- Optional config fields take transformers' `Qwen3_5TextConfig` defaults (an untied head, rope θ 1e4),
  checked against transformers' logits on directories whose config omits them.
- MoE configs, other model types, RoPE scaling and configs Kiln would compute differently from
  transformers (activation, biases, quantization, rope θ) are refused (`training_backend_unsupported`)
  instead of being loaded as something else; malformed fields name the field; sizes beyond any real
  model are refused before anything is built.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln_train.errors import TRAINING_BACKEND_UNSUPPORTED, KilnError
from kiln_train.model import load_model
from kiln_train.model.config import parse_config
from kiln_train.model.tiny import text_config, wrapper_config, write_tiny_checkpoint
from tests.kiln_train.model.checkpoint_edits import copy_checkpoint, edit_config

SMALL_TEXT = {
    "vocab_size": 211,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}


OVERRIDES = {"vocab_size": 96, "bos_token_id": None, "eos_token_id": None}
SMALL = {"vocab_size": 160, "bos_token_id": None, "eos_token_id": None}


def _hf_text_checkpoint(path, *, seed=0, **overrides):
    """A random text-only transformers checkpoint (prefix `model.`), norm offsets non-zero."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**SMALL_TEXT, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and not name.endswith(("A_log", "dt_bias")):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    model.save_pretrained(path)
    return path


def _transformers_logits(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def _assert_parity(path, length=150):
    ids = torch.randint(0, SMALL_TEXT["vocab_size"], (1, length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = load_model(path).logits(ids)
    ref = _transformers_logits(path, ids)
    assert (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def config_with(**changes) -> dict:
    text = text_config("tiny", SMALL)
    text.update(changes)
    return wrapper_config(text)


# ----- transformers' defaults for omitted fields ----------------------------------------------------


def test_optional_field_defaults_are_transformers_defaults():
    from transformers import Qwen3_5TextConfig

    hf = Qwen3_5TextConfig(**{k: v for k, v in SMALL_TEXT.items() if k != "layer_types"})
    ours = parse_config({k: v for k, v in SMALL_TEXT.items() if k != "layer_types"})
    assert ours.tie_word_embeddings is hf.tie_word_embeddings is False
    assert ours.rope_theta == hf.rope_parameters["rope_theta"] == 10000.0
    assert ours.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"] == 0.25
    assert ours.layer_types == tuple(hf.layer_types)
    assert ours.linear_conv_kernel_dim == hf.linear_conv_kernel_dim == 4
    assert ours.rms_norm_eps == hf.rms_norm_eps


def test_an_untied_head_is_used_when_config_json_omits_the_tie_flag(tmp_path):
    path = _hf_text_checkpoint(tmp_path, tie_word_embeddings=False)
    edit_config(path, lambda c: c.pop("tie_word_embeddings"))
    model = load_model(path)
    assert model.config.tie_word_embeddings is False and model.lm_head is not None
    _assert_parity(path)


def test_a_headless_checkpoint_without_tie_flag_is_tied(tmp_path):
    path = _hf_text_checkpoint(tmp_path, tie_word_embeddings=True)
    edit_config(path, lambda c: c.pop("tie_word_embeddings"))
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    model = load_model(path)
    assert model.config.tie_word_embeddings is True and model.lm_head is None
    assert model.lm_head_weight is model.embed_tokens.weight


def test_a_stored_head_that_differs_from_the_embedding_is_not_tied(tmp_path):
    """config says tied but the file carries another head: transformers unties and uses it."""
    path = _hf_text_checkpoint(tmp_path, tie_word_embeddings=False)
    edit_config(path, lambda c: c.update(tie_word_embeddings=True))
    model = load_model(path)
    assert model.config.tie_word_embeddings is False
    _assert_parity(path)
    # ... while an identical copy of the embedding keeps the head tied.
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"))
    assert load_model(path).lm_head is None


@pytest.mark.parametrize("wrapper_tie,text_tie", [(True, False), (False, True)])
def test_disagreeing_tie_flags_follow_the_stored_head(tmp_path, wrapper_tie, text_tie):
    """transformers' own VL save writes the wrapper flag only (text_config keeps its default
    False); a directory whose two flags disagree is read by whether it stores a head."""
    source = write_tiny_checkpoint(
        tmp_path / "src", "tiny", seed=2, overrides=OVERRIDES, with_tokenizer=False
    )
    tensors = load_file(str(source / "model.safetensors"))

    def flags(c):
        c["tie_word_embeddings"] = wrapper_tie
        c["text_config"]["tie_word_embeddings"] = text_tie

    headless = edit_config(copy_checkpoint(source, tmp_path / "headless", tensors), flags)
    assert load_model(headless).lm_head is None
    head = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    headed = edit_config(
        copy_checkpoint(source, tmp_path / "headed", {**tensors, "lm_head.weight": head}), flags
    )
    model = load_model(headed)
    assert model.config.tie_word_embeddings is False
    assert torch.equal(model.lm_head_weight, head.float())


def test_rope_defaults_when_config_json_has_no_rope_fields(tmp_path):
    path = _hf_text_checkpoint(tmp_path)
    edit_config(path, lambda c: c.pop("rope_parameters"))
    assert load_model(path).config.rope_theta == 10000.0
    _assert_parity(path, length=220)


def test_a_single_rope_scaling_dict_is_read_like_rope_parameters(tmp_path):
    path = _hf_text_checkpoint(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 3e5})
    edit_config(path, lambda c: c.update(rope_scaling=c.pop("rope_parameters")))
    assert load_model(path).config.rope_theta == 3e5
    _assert_parity(path)


# ----- refusals -------------------------------------------------------------------------------------


def _refused(raw) -> str:
    with pytest.raises(KilnError) as err:
        parse_config(raw)
    assert err.value.code == TRAINING_BACKEND_UNSUPPORTED
    return err.value.message


def _text(**changes):
    text = text_config("tiny")
    for key, value in changes.items():
        if value is None:
            text.pop(key)
        else:
            text[key] = value
    return text


@pytest.mark.parametrize(
    "wrapper_changes,text_changes,needle",
    [
        ({"model_type": "qwen3_5_moe"}, {"model_type": "qwen3_5_moe_text"}, "Mixture-of-Experts"),
        ({}, {"num_experts": 64, "num_experts_per_tok": 8}, "num_experts=64"),
        ({}, {"moe_intermediate_size": 512}, "moe_intermediate_size=512"),
        ({"architectures": ["Qwen3_5MoeForConditionalGeneration"]}, {}, "Qwen3_5MoeForConditionalGeneration"),
        ({}, {"model_type": "qwen3_next"}, "model_type 'qwen3_next'"),
        ({"model_type": "llama"}, {}, "model_type 'llama'"),
    ],
)
def test_moe_and_foreign_configs_are_refused(wrapper_changes, text_changes, needle):
    raw = wrapper_config(_text(**text_changes))
    raw.update(wrapper_changes)
    assert needle in _refused(raw)


def test_a_dense_config_with_experts_disabled_is_accepted():
    assert parse_config(wrapper_config(_text(num_experts=0))).hidden_size == 64


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"hidden_size": None}, "missing required field 'hidden_size' (in text_config)"),
        ({"head_dim": None}, "missing required field 'head_dim'"),
        ({"linear_num_value_heads": None}, "missing required field 'linear_num_value_heads'"),
        ({"linear_num_key_heads": 0}, "'linear_num_key_heads' (in text_config) must be at least 1, got 0"),
        ({"num_key_value_heads": 0}, "'num_key_value_heads' (in text_config) must be at least 1"),
        ({"hidden_size": 64.5}, "'hidden_size' (in text_config) must be an integer, got 64.5"),
        ({"num_hidden_layers": "4"}, "'num_hidden_layers' (in text_config) must be an integer"),
        (
            {"intermediate_size": float("inf")},
            "'intermediate_size' (in text_config) must be an integer, got inf",
        ),
        ({"vocab_size": float("nan")}, "'vocab_size' (in text_config) must be an integer, got nan"),
        ({"rms_norm_eps": 0}, "'rms_norm_eps' (in text_config) must be positive"),
        ({"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
        (
            {"linear_num_key_heads": 3},
            "linear_num_value_heads (4) must be a multiple of linear_num_key_heads (3)",
        ),
        ({"layer_types": ["linear_attention"] * 3}, "'layer_types' (in text_config) must list 4"),
        ({"layer_types": "full_attention"}, "'layer_types' (in text_config) must list 4"),
        ({"layer_types": None, "full_attention_interval": 0}, "'full_attention_interval'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
        ({"rope_parameters": {"partial_rotary_factor": 0.3}}, "gives rotary dim 9; it must be even"),
        ({"rope_parameters": {"partial_rotary_factor": 1.5}}, "partial_rotary_factor 1.5"),
        ({"rope_parameters": "default"}, "'rope_parameters' (in text_config) must be an object"),
        ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
    ],
)
def test_malformed_fields_are_named(changes, needle):
    assert needle in _refused(wrapper_config(_text(**changes)))


def test_non_object_configs_are_refused():
    assert "must be a JSON object" in _refused(["hidden_size"])
    assert "'text_config' must be an object" in _refused({"model_type": "qwen3_5", "text_config": None})


@pytest.mark.parametrize(
    "text",
    [
        text_config("tiny"),
        text_config("small", {"layer_types": ["full_attention"] + ["linear_attention"] * 7}),
        {k: v for k, v in SMALL_TEXT.items() if k != "layer_types"},
        {**SMALL_TEXT, "rope_theta": 5e5, "partial_rotary_factor": 1.0, "tie_word_embeddings": True},
        {**SMALL_TEXT, "head_dim": 2, "eos_token_id": [7, 9]},
    ],
)
def test_the_runner_round_trip_preserves_the_config(text):
    """The worker registers `config.to_dict()`; the api parses it back (api/runner_gate.py)."""
    cfg = parse_config(wrapper_config(text) if "model_type" in text else text)
    again = parse_config(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert again.rotary_dim == cfg.rotary_dim and again.tie_word_embeddings == cfg.tie_word_embeddings


def test_legacy_torch_dtype_key_and_list_eos():
    text = _text(dtype=None, eos_token_id=[248046, 248044])
    text["torch_dtype"] = "float16"
    raw = wrapper_config(text)
    raw.pop("dtype")
    cfg = parse_config(raw)
    assert (cfg.dtype, cfg.dtype_bytes, cfg.eos_token_id) == ("float16", 2, 248046)


# ----- config.json: sizes beyond any real model are refused before anything is built ---------------


@pytest.mark.parametrize(
    ("field", "value", "ceiling"),
    [
        ("vocab_size", 10**12, 1 << 24),
        ("vocab_size", 10**30, 1 << 24),  # beyond int64 element counts
        ("hidden_size", 10**9, 1 << 20),
        ("num_hidden_layers", 10**7, 1024),  # refused before any module is built
        ("num_hidden_layers", 10**12, 1024),  # refused before layer_types is built
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
    """Each of these would make Kiln run other math than transformers (NaN RoPE tables from θ <= 0,
    SiLU in place of the configured activation, no q/k/v/o biases, unquantized reads)."""
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
