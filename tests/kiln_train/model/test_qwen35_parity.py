"""Oracle parity: our Qwen3.5 logits vs transformers' Qwen3_5ForCausalLM on the same weights (f32).

Tolerance: max |Δlogit| ≤ 1e-5 · max |logit| (transformers is the reference; qwen35.md §2, §4).

On checkpoints that transformers itself writes, over many Qwen3.5 shapes: each case builds a
random `Qwen3_5ForCausalLM` (text config, prefix `model.`) or `Qwen3_5ForConditionalGeneration` (VL
wrapper with a small vision tower, prefix `model.language_model.`, vision tensors to ignore) with
transformers 5.x, perturbs the zero norm offsets so they matter, `save_pretrained`s it (sharded or
not, f32 or bf16), and compares our logits with transformers' at T = 1, 63, 65 and > 200.
"""

from __future__ import annotations

import json

import pytest
import torch

from kiln_train.model import load_model
from kiln_train.model.tiny import write_tiny_checkpoint

NO_SPECIAL_IDS = {"bos_token_id": None, "eos_token_id": None}

CONFIGS = {
    # tiny preset shape (GVA 2 key -> 4 value heads, GQA 4/2), 3 GDN + 1 full, tied
    "tiny_gva2": {"vocab_size": 512, **NO_SPECIAL_IDS},
    # GVA ratio 3, a different layer pattern, untied head, no GQA
    "gva3_untied": {
        "vocab_size": 384,
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_hidden_layers": 5,
        "layer_types": [
            "full_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
        ],
        "num_attention_heads": 3,
        "num_key_value_heads": 3,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 6,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 12,
        "tie_word_embeddings": False,
        **NO_SPECIAL_IDS,
    },
    # GQA group 4, wider rotary (partial factor 0.5), longer conv kernel, all-GDN then full
    "gqa4_rope_half": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "linear_conv_kernel_dim": 3,
        "rope_theta": 10000.0,
        **NO_SPECIAL_IDS,
    },
}


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, (name, overrides) in enumerate(CONFIGS.items()):
        out[name] = write_tiny_checkpoint(
            tmp_path_factory.mktemp(name), "tiny", seed=10 + i, overrides=overrides, with_tokenizer=False
        )
    return out


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


CASES = [
    ("tiny_gva2", 2, 1),
    ("tiny_gva2", 1, 100),
    ("tiny_gva2", 1, 230),
    ("gva3_untied", 2, 1),
    ("gva3_untied", 2, 75),
    ("gva3_untied", 1, 211),
    ("gqa4_rope_half", 1, 64),
    ("gqa4_rope_half", 2, 129),
]


@pytest.mark.parametrize("name,batch,length", CASES)
def test_logits_match_transformers(checkpoints, name, batch, length):
    ours = load_model(checkpoints[name])
    ref_model = _hf_model(checkpoints[name])
    vocab = ours.config.vocab_size
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        got = ours.logits(ids)
        ref = ref_model(ids).logits
    assert got.shape == ref.shape == (batch, length, vocab)
    assert _relative_error(got, ref) < 1e-5
    assert ref.abs().max().item() > 0.1


def test_full_vocab_logits_match_transformers(tmp_path):
    path = write_tiny_checkpoint(tmp_path, "tiny", seed=7, with_tokenizer=False)
    ours = load_model(path)
    assert ours.config.vocab_size == 248320
    ids = torch.randint(0, 248077, (1, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours.logits(ids)
        ref = _hf_model(path)(ids).logits
    assert _relative_error(got, ref) < 1e-5


def test_loads_what_transformers_saves_and_matches(tmp_path):
    """A text-only `Qwen3_5ForCausalLM.save_pretrained` directory (prefix `model.`, sharded)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
    )
    ref_model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():  # make the zero-initialised norm offsets matter
        for name, p in ref_model.named_parameters():
            if p.dim() == 1 and not name.endswith(("A_log", "dt_bias")):
                p.add_(0.1 * torch.randn_like(p))
    ref_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_model(tmp_path)
    ids = torch.randint(0, 300, (2, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert _relative_error(ours.logits(ids), ref_model(ids).logits) < 1e-5


# ----- checkpoints transformers writes, over many shapes ------------------------------------------


L, F = "linear_attention", "full_attention"


def rope(theta=1e7, factor=0.25, **extra):
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor, **extra}


BASE = {
    "vocab_size": 301,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}

# name -> (text config overrides, VL wrapper?, save options)
SAVED_CASES = {
    "irregular_layers_untied": ({"num_hidden_layers": 5, "layer_types": [F, L, F, F, L]}, False, {}),
    "full_attention_first_gdn_rest_vl": ({"layer_types": [F, L, L, L], "rope_parameters": rope()}, True, {}),
    "interval_3_tied_sharded": (
        {"num_hidden_layers": 6, "full_attention_interval": 3, "tie_word_embeddings": True},
        False,
        {"max_shard_size": "20KB"},
    ),
    "top_level_rope_half": ({"rope_theta": 5e5, "partial_rotary_factor": 0.5}, False, {}),
    "full_rotary_bf16_vl_sharded": (
        {"rope_parameters": rope(1e6, 1.0), "tie_word_embeddings": True},
        True,
        {"max_shard_size": "16KB", "dtype": torch.bfloat16},
    ),
    "head_dim_not_hidden_over_heads_kv1": (
        {"hidden_size": 40, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 24},
        False,
        {},
    ),
    "kv_eq_heads_gva_1": (
        {
            "num_attention_heads": 3,
            "num_key_value_heads": 3,
            "linear_num_key_heads": 3,
            "linear_num_value_heads": 3,
        },
        False,
        {"dtype": torch.bfloat16},
    ),
    "gva_3_key_ne_value_dim_conv_2": (
        {
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 6,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 12,
            "linear_conv_kernel_dim": 2,
        },
        True,
        {},
    ),
    "gva_4_key_gt_value_dim_conv_5": (
        {
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 4,
            "linear_conv_kernel_dim": 5,
        },
        False,
        {},
    ),
    "odd_vocab_tied_conv_3": (
        {"vocab_size": 257, "tie_word_embeddings": True, "linear_conv_kernel_dim": 3},
        True,
        {},
    ),
    "real_config_extra_keys_mtp": (
        {
            "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
            "attn_output_gate": True,
            "output_gate_type": "swish",
            "mamba_ssm_dtype": "float32",
            "rope_parameters": rope(mrope_section=[1, 1, 0], mrope_interleaved=True),
        },
        True,
        {},
    ),
    "single_gdn_layer": ({"num_hidden_layers": 1, "layer_types": [L]}, False, {}),
    "all_full_attention_no_rotary": (
        {"num_hidden_layers": 2, "layer_types": [F, F], "head_dim": 2, "num_attention_heads": 4},
        False,
        {},
    ),
}
VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def _build(overrides: dict, vl: bool, seed: int):
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    torch.manual_seed(seed)
    text = {**BASE, **overrides}
    if vl:
        tie = text.pop("tie_word_embeddings", False)
        vision = {**VISION, "out_hidden_size": text["hidden_size"]}
        model = Qwen3_5ForConditionalGeneration(
            Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie)
        )
    else:
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and not name.endswith(("A_log", "dt_bias")):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))  # zero offsets would hide norm bugs
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model.eval()


def _reference(model, path, vl: bool):
    """What transformers computes from the saved directory (the VL class reads the wrapper's tie flag)."""
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    cls = Qwen3_5ForConditionalGeneration if vl else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", sorted(SAVED_CASES))
def test_logits_match_transformers_on_its_own_checkpoint(name, tmp_path):
    overrides, vl, save = SAVED_CASES[name]
    model = _build(overrides, vl, seed=len(name))
    save = dict(save)
    dtype = save.pop("dtype", None)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(tmp_path, **save)
    if "max_shard_size" in save:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    config = json.loads((tmp_path / "config.json").read_text())
    assert ("text_config" in config) == vl

    ours = load_model(tmp_path)
    assert ours.dtype == torch.float32
    ref_model = _reference(model, tmp_path, vl)
    assert ours.config.tie_word_embeddings == (ours.lm_head is None)
    assert ours.config.layer_types == tuple(ref_model.config.get_text_config().layer_types)
    vocab = ours.config.vocab_size
    for length in (1, 63, 65, 211):
        batch = 2 if length < 100 else 1
        ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            got = ours.logits(ids)
            ref = ref_model(ids, use_cache=False).logits
        assert got.shape == ref.shape == (batch, length, vocab)
        scale = ref.abs().max().item()
        assert scale > 0.1
        assert (got - ref).abs().max().item() <= 1e-5 * scale, (name, length)
