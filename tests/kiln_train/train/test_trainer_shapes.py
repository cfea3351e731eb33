"""`train_sft` on unusual Qwen3.5 shapes saved by transformers, and its adapter read back by PEFT.

Two full-vocabulary (so the real tokenizer applies) random models written by
`Qwen3_5ForCausalLM.save_pretrained` in bf16 shards: an irregular untied layout with GVA 3, a
single KV head, head_dim ≠ hidden/heads, key dim ≠ value dim, conv kernel 3 and half rotary; and a
tied, interval-2 layout with no GQA/GVA, conv kernel 2 and the narrowest projection only 4 wide.
Each optimizer trains a few steps with two gradient-checkpoint segments; the published adapter,
loaded by PEFT onto transformers' model, must give our model+adapter's logits (1e-4 relative).
The memory estimator, planner and optimizer support report must price these shapes sensibly.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kiln_train.data.tokenizer import write_tokenizer
from kiln_train.errors import KilnError
from kiln_train.ground.backend import KT_TAPE_FLCE, backend_for_device
from kiln_train.model import attach_lora, load_model
from kiln_train.model.config import LORA_TARGET_MODULES
from kiln_train.model.tiny import TEMPLATE_FILES
from kiln_train.plan.memory import estimate
from kiln_train.plan.optimizer_support import check_optimizer_tuple, optimizer_support_report
from kiln_train.plan.segments import max_rank_that_fits, plan_segments
from kiln_train.train.resident import load_resident
from tests.kiln_train.train import trainer_fixtures as fx
from tests.kiln_train.train.trainer_fixtures import conversations, ingest, make_config, train

one_thread = fx.one_thread
pytestmark = pytest.mark.usefixtures("one_thread")

L, F = "linear_attention", "full_attention"
SHAPES = {
    "irregular_gva3_untied": {
        "vocab_size": 248320,
        "hidden_size": 24,
        "intermediate_size": 40,
        "num_hidden_layers": 5,
        "layer_types": [F, L, F, F, L],
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 12,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 3,
        "linear_key_head_dim": 6,
        "linear_value_head_dim": 10,
        "linear_conv_kernel_dim": 3,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    },
    "interval2_tied_narrow": {
        "vocab_size": 248320,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 4,
        "linear_value_head_dim": 2,
        "linear_conv_kernel_dim": 2,
        "tie_word_embeddings": True,
    },
}
# The narrowest trained projection of each shape: k_proj/v_proj out 1·12 = 12 (the value dim 3·10 = 30
# and hidden 24 are wider), and in_proj_z out / out_proj in 2·2 = 4.
MODEL_MAXIMUM = {"irregular_gva3_untied": 12, "interval2_tied_narrow": 4}
OPTIMIZERS = {"sgd": (3, 0.5), "adam_w": (3, 1e-2), "muon": (2, 2e-2)}  # rank, learning rate


@pytest.fixture(scope="module")
def residents(tmp_path_factory, qwen_tokenizer):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        torch.manual_seed(i)
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**shape)).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() == 1 and not pname.endswith(("A_log", "dt_bias")):
                    p.add_(0.1 * torch.randn_like(p))
                elif pname.endswith(("embed_tokens.weight", "lm_head.weight")):
                    p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        path = tmp_path_factory.mktemp(name)
        model.to(torch.bfloat16).save_pretrained(path, max_shard_size="4MB")
        assert (path / "model.safetensors.index.json").is_file()
        write_tokenizer(path, qwen_tokenizer)
        shutil.copyfile(TEMPLATE_FILES["think"], path / "chat_template.jinja")
        out[name] = load_resident(path)
    return out


def _peft_logits(model_dir, adapter_dir, ids):
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_trained_adapter_matches_peft_on_transformers(residents, shape, optimizer, tmp_path):
    resident = residents[shape]
    rank, lr = OPTIMIZERS[optimizer]
    config = make_config(
        seed=5,
        epochs=1,
        lora_rank=rank,
        lora_alpha=float(rank),
        optimizer={"kind": optimizer},
        learning_rate=lr,
        grad_checkpoint_segments=2,
    )
    result = train(resident, config, ingest(resident, conversations(3)), tmp_path, adapter_name="a")
    assert result.status == "success", result.failure_message
    assert result.global_step == 3 and all(math.isfinite(x) for x in result.loss_history)

    tensors = load_file(str(result.adapter_path / "adapter_model.safetensors"))
    expected_pairs = sum(len(LORA_TARGET_MODULES) - (4 if t == L else 3) for t in resident.config.layer_types)
    assert len(tensors) == 2 * expected_pairs
    ours = load_model(resident.model_dir)
    attach_lora(ours, rank, float(rank), seed=0).load_state_dict(tensors)
    ids = torch.randint(0, 248_000, (1, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours.logits(ids)
        plain = resident.model.logits(ids)
    ref = _peft_logits(resident.model_dir, result.adapter_path, ids)
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 1e-4 * scale
    assert (got - plain).abs().max().item() > 1e-3 * scale  # the adapter moved the logits


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_memory_and_optimizer_support_price_the_shape(residents, shape):
    resident = residents[shape]
    config = resident.config
    # model_maximum: the smallest in/out dimension of the trained projections of the real model.
    dims = [
        d
        for name, module in resident.model.named_modules()
        if name.rsplit(".", 1)[-1] in LORA_TARGET_MODULES
        for d in module.weight.shape
    ]
    assert config.model_maximum_rank() == min(dims) == MODEL_MAXIMUM[shape]
    for device in ("cpu", "cuda"):
        report = optimizer_support_report(backend_for_device(device), config)
        ranks = {o["kind"]: o["optimizer_tuple"]["lora_rank"] for o in report["optimizers"]}
        assert {k: r["model_maximum"] for k, r in ranks.items()} == dict.fromkeys(ranks, min(dims))
        assert report["optimizer_tuple_kinds"] == ["muon", "adam_w", "sgd"]
    cpu = backend_for_device("cpu")
    check_optimizer_tuple(cpu, config, "muon", min(dims))
    with pytest.raises(KilnError, match=f"model maximum {min(dims)}"):
        check_optimizer_tuple(cpu, config, "adam_w", min(dims) + 1)

    # The base weights the estimate charges are the trunk tensors the checkpoint stores.
    stored = 0
    for path in resident.model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            stored += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    assert config.base_parameter_count() == stored == sum(b.numel() for b in resident.model.buffers())

    common = {
        "max_seq_len": 512,
        "max_supervised_tokens": 256,
        "optimizer_kind": "adam_w",
        "loss_route": KT_TAPE_FLCE,
        "backend": cpu,
        "weights_resident": False,
    }
    small = estimate(config, lora_rank=1, num_segments=1, **common)
    large = estimate(config, lora_rank=min(dims), num_segments=1, **common)
    assert small.base_weights == 4 * stored and small.total < large.total
    assert large.lora_param_grad == 2 * 4 * config.lora_elements_per_rank() * min(dims)
    split = estimate(config, lora_rank=1, num_segments=config.num_hidden_layers, **common)
    assert split.per_segment_activations < small.per_segment_activations
    plan = plan_segments(config, lora_rank=2, available_bytes=large.total, **common)
    assert plan.num_segments == 1 and plan.breakdown.total <= large.total
    tight = plan_segments(config, lora_rank=1, available_bytes=split.total, **common)
    assert tight.breakdown.fits(split.total)
    assert max_rank_that_fits(config, available_bytes=1 << 40, **common) == min(dims)
    assert max_rank_that_fits(config, available_bytes=small.base_weights, **common) == 0
