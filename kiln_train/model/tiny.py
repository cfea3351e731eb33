"""Tiny random Qwen3.5 checkpoints in the real Hugging Face layout (for tests, demos, benchmarks).

`write_tiny_checkpoint(out_dir, preset, seed)` writes a complete checkpoint directory:
- `config.json`: the VL wrapper (`Qwen3_5ForConditionalGeneration`, model_type `qwen3_5`) with a
  `text_config` (model_type `qwen3_5_text`) that carries layer_types, rope_parameters (θ 1e7,
  partial rotary 0.25, an mRoPE section summing to rotary_dim/2, interleaved), the tie flag,
  `mtp_num_hidden_layers: 1` and `dtype: bfloat16` — the shape of the real Qwen3.5 configs
  (docs/model.md#configuration).
- `model.safetensors`: trunk tensors under `model.language_model.` and the MTP block under `mtp.`
  (docs/model.md#loading), stored in bfloat16 like the real checkpoints (or in the dtype an override of
  `dtype` names: float32, float16). Every value is drawn in f32
  and rounded to bf16 once, so a loader that upcasts to f32 (the CPU backend, transformers with
  dtype=float32) sees exactly the same numbers on both sides of a parity test.
- the tokenizer (`kiln_train.data.tokenizer.write_tokenizer`), `chat_template.jinja` (the pinned
  template shipped in kiln_train/data/templates), `generation_config.json` (eos [248046, 248044]).

Weights are random but shaped like a trained model: linears N(0, 0.02²); the embedding (and an untied
head) N(0, 1/hidden), rows of norm ~1 as in trained checkpoints, so LoRA can move the logits; block and
q/k norm offsets N(0, 0.1²) (non-zero, so an offset-norm bug shows); the GDN gated norm 1 + N(0, 0.1²);
A_log = log U(1, 16); dt_bias 1 + N(0, 0.1²); the depthwise conv U(±1/√K) (torch's Conv1d init).
One CPU generator seeded with `seed` draws the tensors in sorted-name order, so the same seed gives a
byte-identical directory.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

from kiln_train.data.chat_template import CHAT_TEMPLATE_FILE, TEMPLATE_DIR
from kiln_train.model.config import CONFIG_FILE, FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Config, parse_config
from kiln_train.model.loader import SINGLE_FILE
from kiln_train.model.random_init import write_random_init_mark

TEMPLATE_FILES = {
    "think": TEMPLATE_DIR / "qwen3_5_chat_template.jinja",  # 4B and larger
    "nothink": TEMPLATE_DIR / "qwen3_5_nothink_chat_template.jinja",  # 2B, 0.8B
}
STORAGE_DTYPE = torch.bfloat16
# The `dtype` a text_config may name (override) and the tensor dtype stored for it.
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
BOS_ID = PAD_ID = 248044
EOS_IDS = [248046, 248044]

PRESETS: dict[str, dict] = {
    "tiny": {
        "vocab_size": 248320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
    },
    "small": {
        "vocab_size": 248320,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
    },
}


def mrope_section(rotary_dim: int) -> list[int]:
    """Three T/H/W slot counts summing to rotary_dim/2, shaped like Qwen's [11, 11, 10]."""
    half = rotary_dim // 2
    base, extra = divmod(half, 3)
    return [base + (extra > 0), base + (extra > 1), base]


def text_config(preset: str = "tiny", overrides: dict | None = None) -> dict:
    """The `text_config` object of a preset, with `overrides` applied on top."""
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}; expected one of {sorted(PRESETS)}")
    shape = dict(PRESETS[preset])
    overrides = dict(overrides or {})
    shape.update({k: v for k, v in overrides.items() if k not in ("rope_parameters",)})
    layers = shape["num_hidden_layers"]
    interval = int(shape.get("full_attention_interval", 4))
    layer_types = shape.pop("layer_types", None) or [
        FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)
    ]
    prf = float(shape.pop("partial_rotary_factor", 0.25))
    rotary_dim = int(shape["head_dim"] * prf)
    rope = {
        "rope_type": "default",
        "rope_theta": float(shape.pop("rope_theta", 10_000_000.0)),
        "partial_rotary_factor": prf,
        "mrope_section": mrope_section(rotary_dim),
        "mrope_interleaved": True,
    }
    rope.update(overrides.get("rope_parameters", {}))
    cfg = {
        "model_type": "qwen3_5_text",
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "initializer_range": 0.02,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": BOS_ID,
        "pad_token_id": None,
        "dtype": "bfloat16",
    }
    cfg.update(shape)
    cfg["layer_types"] = list(layer_types)
    cfg["rope_parameters"] = rope
    return dict(sorted(cfg.items()))


def wrapper_config(text: dict) -> dict:
    """The VL wrapper `config.json` around a text_config (docs/model.md#configuration)."""
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "dtype": "bfloat16",
        "text_config": text,
    }


def _attention_shapes(cfg: Qwen35Config, root: str) -> dict[str, tuple[int, ...]]:
    d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return {
        f"{root}.self_attn.q_proj.weight": (h * hd * 2, d),
        f"{root}.self_attn.k_proj.weight": (kv * hd, d),
        f"{root}.self_attn.v_proj.weight": (kv * hd, d),
        f"{root}.self_attn.o_proj.weight": (d, h * hd),
        f"{root}.self_attn.q_norm.weight": (hd,),
        f"{root}.self_attn.k_norm.weight": (hd,),
    }


def _block_shapes(cfg: Qwen35Config, root: str) -> dict[str, tuple[int, ...]]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    return {
        f"{root}.input_layernorm.weight": (d,),
        f"{root}.post_attention_layernorm.weight": (d,),
        f"{root}.mlp.gate_proj.weight": (f, d),
        f"{root}.mlp.up_proj.weight": (f, d),
        f"{root}.mlp.down_proj.weight": (d, f),
    }


def checkpoint_shapes(
    cfg: Qwen35Config, *, prefix: str = "model.language_model."
) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3.5 text checkpoint with its shape: trunk, lm_head if untied, MTP."""
    d, nv = cfg.hidden_size, cfg.linear_num_value_heads
    shapes = {f"{prefix}embed_tokens.weight": (cfg.vocab_size, d), f"{prefix}norm.weight": (d,)}
    for i, kind in enumerate(cfg.layer_types):
        root = f"{prefix}layers.{i}"
        shapes.update(_block_shapes(cfg, root))
        if kind == FULL_ATTENTION:
            shapes.update(_attention_shapes(cfg, root))
        else:
            la = f"{root}.linear_attn"
            shapes.update(
                {
                    f"{la}.in_proj_qkv.weight": (cfg.linear_conv_dim, d),
                    f"{la}.in_proj_z.weight": (cfg.linear_value_dim, d),
                    f"{la}.in_proj_b.weight": (nv, d),
                    f"{la}.in_proj_a.weight": (nv, d),
                    f"{la}.conv1d.weight": (cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim),
                    f"{la}.A_log": (nv,),
                    f"{la}.dt_bias": (nv,),
                    f"{la}.norm.weight": (cfg.linear_value_head_dim,),
                    f"{la}.out_proj.weight": (d, cfg.linear_value_dim),
                }
            )
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    if cfg.mtp_num_hidden_layers:
        shapes.update(
            {
                "mtp.pre_fc_norm_embedding.weight": (d,),
                "mtp.pre_fc_norm_hidden.weight": (d,),
                "mtp.fc.weight": (d, 2 * d),
                "mtp.norm.weight": (d,),
            }
        )
        for j in range(cfg.mtp_num_hidden_layers):
            shapes.update(_block_shapes(cfg, f"mtp.layers.{j}"))
            shapes.update(_attention_shapes(cfg, f"mtp.layers.{j}"))
    return shapes


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One f32 tensor drawn from the initialisation this name calls for (see module docstring)."""
    kw = {"generator": gen}
    dev = gen.device
    if name.endswith(".A_log"):
        return torch.empty(shape, device=dev).uniform_(1.0, 16.0, **kw).log()
    if name.endswith(".dt_bias") or name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, device=dev, **kw)
    if name.endswith("conv1d.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return torch.empty(shape, device=dev).uniform_(-bound, bound, **kw)
    if len(shape) == 1:  # every other vector is a (1+w) RMSNorm offset
        return 0.1 * torch.randn(shape, device=dev, **kw)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        # Rows of norm ~1, like a trained model's: with 0.02 a narrow model's logits could move by
        # barely a nat, and a tied-head tiny model could hardly learn anything through LoRA.
        return shape[-1] ** -0.5 * torch.randn(shape, device=dev, **kw)
    return 0.02 * torch.randn(shape, device=dev, **kw)


def random_tensors(
    cfg: Qwen35Config, seed: int, dtype: torch.dtype = STORAGE_DTYPE, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor, drawn in sorted-name order from one generator on `device`
    (CPU draws are what checkpoints store; other devices give other, equally seeded, streams)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return {
        name: _draw(name, shape, gen).to(dtype).contiguous()
        for name, shape in sorted(checkpoint_shapes(cfg).items())
    }


def generation_config() -> dict:
    return {"bos_token_id": BOS_ID, "eos_token_id": list(EOS_IDS), "pad_token_id": PAD_ID}


def write_tiny_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    *,
    overrides: dict | None = None,
    tokenizer=None,
    with_tokenizer: bool = True,
    chat_template: str = "think",
    device: str = "cpu",
) -> Path:
    """Write a complete random Qwen3.5 checkpoint directory; returns its path.

    `overrides` replaces text_config fields (shapes, layer_types, tie_word_embeddings, ...);
    `tokenizer` is a prebuilt `tokenizers.Tokenizer` (building one takes ~3 s);
    `with_tokenizer=False` skips the tokenizer files (model-only tests); `chat_template` picks the
    official template the checkpoint ships: "think" (Qwen3.5-4B and larger) or "nothink" (2B and
    smaller). `device` draws the weights there (`random_tensors`): a GPU draws a 4B checkpoint in
    seconds, other values than the CPU's.
    """
    from safetensors.torch import save_file

    from kiln_train.data.tokenizer import write_tokenizer

    if chat_template not in TEMPLATE_FILES:
        raise ValueError(f"chat_template {chat_template!r} is not one of {sorted(TEMPLATE_FILES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = text_config(preset, overrides)
    config = wrapper_config(text)
    rope = text["rope_parameters"]
    rotary_dim = int(text["head_dim"] * rope["partial_rotary_factor"])
    if rotary_dim % 2 or rotary_dim < 2:
        raise ValueError(f"head_dim {text['head_dim']} x partial_rotary_factor must give an even rotary dim")
    cfg = parse_config(config)
    _write_json(out / CONFIG_FILE, config)
    _write_json(out / "generation_config.json", generation_config())
    weights = out / SINGLE_FILE
    storage = STORAGE_DTYPES.get(text["dtype"])
    if storage is None:
        raise ValueError(f"dtype {text['dtype']!r} is not one of {sorted(STORAGE_DTYPES)}")
    tensors = {name: t.cpu() for name, t in random_tensors(cfg, seed, dtype=storage, device=device).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    del tensors
    weights.chmod(_readable_mode(0o644))  # safetensors creates it owner-only; share it like the rest
    if with_tokenizer:
        write_tokenizer(out, tokenizer)
        shutil.copyfile(TEMPLATE_FILES[chat_template], out / CHAT_TEMPLATE_FILE)
    write_random_init_mark(out, preset, seed)
    return out


def _readable_mode(mode: int) -> int:
    """`mode` filtered through the process umask (what open() would have given)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
