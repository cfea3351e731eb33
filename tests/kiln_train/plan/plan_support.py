"""Model sizes, backends and argument sets shared by the memory-admission tests."""

from __future__ import annotations

from kiln_train.ground.backend import KT_TAPE_FLCE, backend_for_device
from kiln_train.model.config import QWEN35_4B_TEXT_CONFIG, parse_config
from kiln_train.model.tiny import PRESETS
from kiln_train.plan.memory import estimate
from kiln_train.plan.segments import plan_segments

# The `small` preset of kiln_train.model.tiny: 8 narrow layers under the full vocabulary.
SMALL = parse_config({**PRESETS["small"], "dtype": "bfloat16"})

CUDA = backend_for_device("cuda")
CPU = backend_for_device("cpu")

# Qwen3.5-4B text config (docs/model.md#configuration).
QWEN35_4B = parse_config(QWEN35_4B_TEXT_CONFIG)


def est(config=QWEN35_4B, **kw):
    args = {
        "max_seq_len": 4096,
        "max_supervised_tokens": 2048,
        "lora_rank": 16,
        "optimizer_kind": "adam_w",
        "num_segments": 8,
        "loss_route": KT_TAPE_FLCE,
        "backend": CUDA,
        "weights_resident": False,
    }
    args.update(kw)
    return estimate(config, **args)


def plan(available, config=QWEN35_4B, **kw):
    args = {
        "max_seq_len": 4096,
        "max_supervised_tokens": 2048,
        "lora_rank": 16,
        "optimizer_kind": "adam_w",
        "loss_route": KT_TAPE_FLCE,
        "backend": CUDA,
        "weights_resident": True,
        "available_bytes": available,
    }
    args.update(kw)
    return plan_segments(config, **args)


def sized_config(hidden, inter, layers, heads, kv, v_heads, tied):
    return parse_config(
        {
            **QWEN35_4B_TEXT_CONFIG,
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "linear_num_value_heads": v_heads,
            "tie_word_embeddings": tied,
            "layer_types": [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
            ],
        }
    )


# The released sizes: 0.8B / 4B / 9B / 27B (docs/model.md#configuration).
SIZES = {
    "0.8b": sized_config(1024, 3584, 24, 8, 2, 16, True),
    "4b": parse_config(QWEN35_4B_TEXT_CONFIG),
    "9b": sized_config(4096, 12288, 32, 16, 4, 32, False),
    "27b": sized_config(5120, 17408, 64, 24, 4, 48, False),
}
NARROW = sized_config(256, 512, 4, 2, 1, 16, True)


def common(**kw):
    args = {
        "max_seq_len": 4096,
        "max_supervised_tokens": 2048,
        "lora_rank": 16,
        "optimizer_kind": "muon",
        "loss_route": KT_TAPE_FLCE,
        "backend": CUDA,
        "weights_resident": True,
    }
    args.update(kw)
    return args


def best_total(config, **kw):
    return min(
        estimate(config, num_segments=s, **common(**kw)).total for s in range(1, config.num_hidden_layers + 1)
    )
