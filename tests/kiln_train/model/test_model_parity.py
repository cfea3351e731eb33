"""Oracle parity: our Qwen3.5 logits vs transformers' Qwen3_5ForCausalLM on the same weights (f32).

Tolerance: max |Δlogit| ≤ 1e-5 · max |logit| (transformers is the reference; qwen35.md §2, §4).
"""

from __future__ import annotations

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
