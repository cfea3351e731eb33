"""Tiny random Qwen3.5 checkpoints: layout, determinism, realistic values, transformers loads them."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from kiln_train.model import load_model
from kiln_train.model.config import load_config, parse_config
from kiln_train.model.tiny import (
    TEMPLATE_FILES,
    checkpoint_shapes,
    text_config,
    wrapper_config,
    write_tiny_checkpoint,
)

FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "kiln-random-init.json",  # the mark of a random checkpoint (kiln_train/model/random_init.py)
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, qwen_tokenizer):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny", seed=0, tokenizer=qwen_tokenizer)


def test_directory_layout_and_config(tiny_dir):
    assert {p.name for p in tiny_dir.iterdir()} == FILES
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5" and config["tie_word_embeddings"] is True
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_text" and text["dtype"] == "bfloat16"
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["mtp_num_hidden_layers"] == 1
    rope = text["rope_parameters"]
    assert rope["rope_type"] == "default" and rope["rope_theta"] == 1e7
    assert rope["partial_rotary_factor"] == 0.25 and rope["mrope_interleaved"] is True
    assert sum(rope["mrope_section"]) == text["head_dim"] * 0.25 / 2
    cfg = load_config(tiny_dir)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (64, 4, 248320)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim) == (4, 2, 32, 8)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim) == (2, 4, 16)
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 248044, "eos_token_id": [248046, 248044], "pad_token_id": 248044}
    assert (tiny_dir / "chat_template.jinja").read_bytes() == TEMPLATE_FILES["think"].read_bytes()


def test_small_preset_shape():
    cfg = parse_config(wrapper_config(text_config("small")))
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (256, 768, 8)
    assert cfg.layer_types.count("full_attention") == 2
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [3, 7]
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 64)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (2, 4, 64)
    assert cfg.vocab_size == 248320 and cfg.tie_word_embeddings
    shapes = checkpoint_shapes(cfg)
    trunk = sum(math.prod(s) for k, s in shapes.items() if k.startswith("model.language_model."))
    assert trunk == cfg.base_parameter_count()
    assert shapes["mtp.fc.weight"] == (256, 512)
    assert shapes["mtp.layers.0.self_attn.q_proj.weight"] == (512, 256)


def test_tensors_are_realistic(tiny_dir):
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    cfg = load_config(tiny_dir)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == checkpoint_shapes(cfg)
    assert {v.dtype for v in tensors.values()} == {torch.bfloat16}
    assert any(k.startswith("mtp.") for k in tensors) and "lm_head.weight" not in tensors
    p = "model.language_model."
    for key in (
        f"{p}norm.weight",
        f"{p}layers.0.input_layernorm.weight",
        f"{p}layers.3.self_attn.q_norm.weight",
    ):
        offset = tensors[key].float()
        assert 0.03 < offset.std().item() < 0.3 and offset.abs().max().item() > 0.05, key
    a_log = tensors[f"{p}layers.0.linear_attn.A_log"].float()
    assert a_log.min().item() >= 0.0 and a_log.max().item() <= math.log(16.0) + 1e-2
    dt_bias = tensors[f"{p}layers.1.linear_attn.dt_bias"].float()
    gated = tensors[f"{p}layers.1.linear_attn.norm.weight"].float()
    for vec in (dt_bias, gated):
        assert (vec - 1.0).abs().max().item() < 0.5 and (vec - 1.0).abs().max().item() > 0.01
    embed = tensors[f"{p}embed_tokens.weight"].float()
    assert abs(embed.std().item() - cfg.hidden_size**-0.5) < 1e-3  # rows of norm ~1
    assert abs(embed.norm(dim=1).mean().item() - 1.0) < 0.05
    linear = tensors[f"{p}layers.0.mlp.up_proj.weight"].float()
    assert abs(linear.std().item() - 0.02) < 1e-3


def test_same_seed_is_byte_identical_and_seeds_differ(tmp_path, qwen_tokenizer, tiny_dir):
    again = write_tiny_checkpoint(tmp_path / "again", "tiny", seed=0, tokenizer=qwen_tokenizer)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    other = write_tiny_checkpoint(tmp_path / "other", "tiny", seed=1, with_tokenizer=False)
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()
    assert (other / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()


def test_overrides_reshape_the_checkpoint(tmp_path):
    path = write_tiny_checkpoint(
        tmp_path,
        "tiny",
        seed=0,
        overrides={"num_hidden_layers": 2, "tie_word_embeddings": False, "vocab_size": 96, "head_dim": 16},
        with_tokenizer=False,
    )
    cfg = load_config(path)
    assert cfg.layer_types == ("linear_attention", "linear_attention") and not cfg.tie_word_embeddings
    assert cfg.rotary_dim == 4
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["lm_head.weight"].shape == (96, 64)
    assert load_model(path).lm_head_weight.shape == (96, 64)
    with pytest.raises(ValueError, match="unknown tiny preset"):
        write_tiny_checkpoint(tmp_path / "x", "huge")
    with pytest.raises(ValueError, match="even rotary"):
        write_tiny_checkpoint(tmp_path / "y", "tiny", overrides={"head_dim": 6}, with_tokenizer=False)


def test_transformers_loads_the_directory(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    ours = load_model(tiny_dir)
    ids = torch.tensor([[248045, 846, 198, 12675, 248046, 198]])
    with torch.no_grad():
        ref = model(ids).logits
        assert (ours.logits(ids) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert tok.encode("<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False) == [
        248045,
        846,
        198,
        12675,
        248046,
        198,
    ]
    assert tok.chat_template == TEMPLATE_FILES["think"].read_text(encoding="utf-8")


def test_cli_init_tiny(tmp_path, monkeypatch, qwen_tokenizer):
    import kiln_train.data.packaged_tokenizer as packaged_tokenizer
    from kiln_cli.main import cli

    monkeypatch.setattr(packaged_tokenizer, "cached_tokenizer", lambda: qwen_tokenizer)
    out = tmp_path / "m"
    result = CliRunner().invoke(cli, ["model", "init-tiny", str(out), "--seed", "5"])
    assert result.exit_code == 0, result.output
    assert "wrote tiny Qwen3.5 checkpoint" in result.output
    assert {p.name for p in out.iterdir()} == FILES
    direct = write_tiny_checkpoint(tmp_path / "direct", "tiny", seed=5, with_tokenizer=False)
    assert (out / "model.safetensors").read_bytes() == (direct / "model.safetensors").read_bytes()
    again = CliRunner().invoke(cli, ["model", "init-tiny", str(out)])
    assert again.exit_code == 2 and "already exists" in again.output
    before = (out / "model.safetensors").read_bytes()
    idempotent = CliRunner().invoke(cli, ["model", "init-tiny", str(out), "--seed", "9", "--if-missing"])
    assert idempotent.exit_code == 0 and "nothing to do" in idempotent.output
    assert (out / "model.safetensors").read_bytes() == before
    bad = CliRunner().invoke(cli, ["model", "init-tiny", str(tmp_path / "n"), "--preset", "huge"])
    assert bad.exit_code == 2 and not (tmp_path / "n").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["direct", "m"]  # no staging leftovers


def test_tiny_overrides_for_interval_and_storage_dtype(tmp_path):
    path = write_tiny_checkpoint(
        tmp_path,
        "tiny",
        seed=0,
        overrides={
            "num_hidden_layers": 4,
            "full_attention_interval": 2,
            "dtype": "float32",
            "vocab_size": 64,
        },
        with_tokenizer=False,
    )
    text = json.loads((path / "config.json").read_text())["text_config"]
    assert text["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert text["full_attention_interval"] == 2
    tensors = load_file(str(path / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert load_model(path).config.layer_types == tuple(text["layer_types"])
