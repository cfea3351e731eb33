"""Qwen3.5 text-model shape, read from a Hugging Face `config.json` (docs/model.md#configuration).

Torch-free: the api uses it for memory admission and the optimizer support report.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln_train.errors import backend_unsupported
from kiln_train.ground.limits import MAX_DIMENSION, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB_SIZE

CONFIG_FILE = "config.json"
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# The ten LoRA targets of the contract, in the contract's order (docs/training-profile.md#lora): the
# full-attention projections, the Gated DeltaNet projections, then the MLP's.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
GDN_TARGETS = ("in_proj_qkv", "in_proj_z", "out_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# How the trainer draws the initial LoRA A matrices (B starts at zero): recorded in checkpoints and
# export bundles, reproduced torch-free by kiln_train.interop.lora_init.
LORA_INIT_ALGORITHM = "kiln-py.seeded-lora-init.v1"
LORA_TARGET_MODULES = ATTENTION_TARGETS + GDN_TARGETS + MLP_TARGETS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# The canonical Qwen3.5-4B text config (docs/model.md#configuration): 8 full-attention layers at
# (i+1) % 4 == 0.
QWEN35_4B_TEXT_CONFIG = {
    "vocab_size": 248320,
    "hidden_size": 2560,
    "intermediate_size": 9216,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "dtype": "bfloat16",
}


@dataclass(frozen=True)
class Projection:
    """One trained linear projection: its HF module path (without `model.` root) and shape."""

    layer: int
    module: str  # e.g. "layers.3.self_attn.q_proj"
    target: str  # e.g. "q_proj"
    in_features: int
    out_features: int


@dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = True
    mtp_num_hidden_layers: int = 0
    max_position_embeddings: int = 262144
    dtype: str = "bfloat16"
    eos_token_id: int | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ----- derived shapes -------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 4)

    def projections(self) -> list[Projection]:
        """Every trained projection of the trunk, layer by layer, in target order."""
        h, out = self.hidden_size, []
        for i, kind in enumerate(self.layer_types):
            if kind == FULL_ATTENTION:
                attn = "self_attn"
                shapes = {
                    "q_proj": (h, self.num_attention_heads * self.head_dim * 2),
                    "k_proj": (h, self.num_key_value_heads * self.head_dim),
                    "v_proj": (h, self.num_key_value_heads * self.head_dim),
                    "o_proj": (self.num_attention_heads * self.head_dim, h),
                }
            else:
                attn = "linear_attn"
                shapes = {
                    "in_proj_qkv": (h, self.linear_conv_dim),
                    "in_proj_z": (h, self.linear_value_dim),
                    "out_proj": (self.linear_value_dim, h),
                }
            for target, (fin, fout) in shapes.items():
                out.append(Projection(i, f"layers.{i}.{attn}.{target}", target, fin, fout))
            for target, (fin, fout) in {
                "gate_proj": (h, self.intermediate_size),
                "up_proj": (h, self.intermediate_size),
                "down_proj": (self.intermediate_size, h),
            }.items():
                out.append(Projection(i, f"layers.{i}.mlp.{target}", target, fin, fout))
        return out

    def lora_elements_per_rank(self) -> int:
        """Σ (in + out) over trained projections: LoRA elements = this × rank."""
        return sum(p.in_features + p.out_features for p in self.projections())

    def model_maximum_rank(self) -> int:
        """Smallest in/out dimension over trained projections (docs/optimizers.md#rank-ranges)."""
        return min(min(p.in_features, p.out_features) for p in self.projections())

    def max_feature_dim(self) -> int:
        return max(max(p.in_features, p.out_features) for p in self.projections())

    def base_parameter_count(self) -> int:
        """Trunk parameters (embedding once if tied), excluding MTP."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        n = v * h + h  # embedding + final norm
        if not self.tie_word_embeddings:
            n += v * h
        for kind in self.layer_types:
            n += 2 * h + 3 * h * f  # two norms + MLP
            if kind == FULL_ATTENTION:
                n += h * self.num_attention_heads * self.head_dim * 2
                n += 2 * h * self.num_key_value_heads * self.head_dim
                n += self.num_attention_heads * self.head_dim * h + 2 * self.head_dim
            else:
                nv = self.linear_num_value_heads
                n += h * self.linear_conv_dim + h * self.linear_value_dim + 2 * h * nv
                n += self.linear_conv_dim * self.linear_conv_kernel_dim + 2 * nv
                n += self.linear_value_head_dim + self.linear_value_dim * h
        return n

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d["layer_types"] = list(self.layer_types)
        return d


def _pick(d: dict, *names, default=None):
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


# Fields every Qwen3.5 text config must carry: transformers' class defaults for them are the 9B
# shape, so a checkpoint that omits one cannot be loaded by guessing.
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)
QWEN35_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# Keys that only Mixture-of-Experts configs carry (Qwen3.5-MoE, Qwen3-Next, Qwen3-MoE, Mixtral...).
MOE_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
# transformers' Qwen3_5TextConfig defaults for the optional fields.
DEFAULT_ROPE_THETA = 10_000.0
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4
PLAIN_ROPE_TYPES = ("default", "mrope")


# Sanity ceilings (kiln_train/ground/limits.py): a config beyond them is corrupt.
FIELD_MAXIMA = {
    "vocab_size": MAX_VOCAB_SIZE,
    "num_hidden_layers": MAX_LAYERS,
    "mtp_num_hidden_layers": MAX_LAYERS,
    "full_attention_interval": MAX_LAYERS,
    "max_position_embeddings": MAX_POSITIONS,
}
SUPPORTED_ACTIVATIONS = ("silu", "swish")


class _ConfigFieldError(ValueError):
    pass


def _int_field(d: dict, name: str, *, default=None, minimum: int = 1, where: str = "") -> int:
    """An integer field (an integral float is accepted), at least `minimum`, at most its ceiling."""
    value = d.get(name)
    if value is None:
        if default is None:
            raise _ConfigFieldError(f"missing required field {name!r}{where}")
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
    ):
        raise _ConfigFieldError(f"field {name!r}{where} must be an integer, got {value!r}")
    if int(value) < minimum:
        raise _ConfigFieldError(f"field {name!r}{where} must be at least {minimum}, got {value!r}")
    maximum = FIELD_MAXIMA.get(name, MAX_DIMENSION)
    if int(value) > maximum:
        raise _ConfigFieldError(
            f"field {name!r}{where} is {int(value)}, beyond the largest supported value {maximum} "
            "(a corrupt or foreign config.json)"
        )
    return int(value)


def _short_repr(value) -> str:
    """repr() cut to a readable length (a corrupt config may hold a list of millions of entries)."""
    import reprlib

    short = reprlib.Repr()
    short.maxlist = short.maxtuple = short.maxdict = 12
    short.maxstring = short.maxother = 80
    text = short.repr(value)
    if isinstance(value, list | tuple) and len(value) > 12:
        text += f" ({len(value)} entries)"
    return text


def _float_field(d: dict, name: str, default: float, *, where: str = "") -> float:
    value = d.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _ConfigFieldError(f"field {name!r}{where} must be a finite number, got {value!r}")
    return float(value)


def _refuse_foreign(raw: dict, text: dict) -> None:
    """Mixture-of-Experts and non-Qwen3.5 configs are refused, never loaded as a dense model."""
    for scope, d in ((CONFIG_FILE, raw), ("text_config", text)):
        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        archs = [str(a) for a in archs] if isinstance(archs, list) else [str(archs)]
        signs = [f"{k}={d[k]!r}" for k in MOE_KEYS if d.get(k) not in (None, 0, [], False)]
        if isinstance(model_type, str) and "moe" in model_type.lower():
            signs.insert(0, f"model_type={model_type!r}")
        signs += [f"architectures={a!r}" for a in archs if "moe" in a.lower()]
        if signs:
            what = ", ".join(signs)
            raise backend_unsupported(
                f"{scope} describes a Mixture-of-Experts model ({what}); only dense Qwen3.5 "
                f"models (model_type {' / '.join(QWEN35_MODEL_TYPES)}) can be trained"
            )
        quant = d.get("quantization_config")
        if quant not in (None, {}):
            method = quant.get("quant_method") if isinstance(quant, dict) else None
            raise backend_unsupported(
                f"{scope} has a quantization_config (quant_method {method!r}): quantized checkpoints "
                "are not supported; use the bf16 base checkpoint"
            )
        if model_type is not None and model_type not in QWEN35_MODEL_TYPES:
            raise backend_unsupported(
                f"{scope} has model_type {model_type!r}; only Qwen3.5 text models "
                f"(model_type {' / '.join(QWEN35_MODEL_TYPES)}) are supported"
            )


def stated_tie(raw: dict) -> bool | None:
    """The tie_word_embeddings that `config.json` states unambiguously, else None.

    None when neither the VL wrapper nor its text_config states it, or when they disagree
    (transformers' VL class then reads the wrapper's flag and its text-only class the
    text_config's, so the two classes would build different heads from one directory).
    """
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    flags = {f for f in (raw.get("tie_word_embeddings"), text.get("tie_word_embeddings")) if f is not None}
    return flags.pop() if len(flags) == 1 else None


def parse_config(raw: dict) -> Qwen35Config:
    """Parse a Qwen3.5 `config.json` object, with or without the VL wrapper (`text_config`).

    Shape fields (REQUIRED_FIELDS) must be present; optional fields take transformers'
    `Qwen3_5TextConfig` defaults (rope θ 1e4, partial rotary 0.25, a full-attention layer every
    4th, conv kernel 4, eps 1e-6, untied head). The VL wrapper's own `tie_word_embeddings` wins
    over the text_config's, as in `Qwen3_5ForConditionalGeneration`. MoE configs, other model
    types and RoPE scaling are refused with `training_backend_unsupported` naming the field.
    """
    if not isinstance(raw, dict):
        raise backend_unsupported(f"config.json must be a JSON object, got {type(raw).__name__}")
    if "text_config" in raw and not isinstance(raw["text_config"], dict):
        raise backend_unsupported("config.json field 'text_config' must be an object")
    text = raw.get("text_config", raw)
    where = " (in text_config)" if text is not raw else ""
    _refuse_foreign(raw, text)
    try:
        ints = {name: _int_field(text, name, where=where) for name in REQUIRED_FIELDS}
        layer_types = _layer_types(text, ints["num_hidden_layers"], where)
        rope_theta, prf = _rope(text, ints["head_dim"], where)
        _refuse_unimplemented(text, where)
        eps = _float_field(text, "rms_norm_eps", 1e-6, where=where)
        if eps <= 0:
            raise _ConfigFieldError(f"field 'rms_norm_eps'{where} must be positive, got {eps}")
        tie = _tie_word_embeddings(raw, text)
        dtype = _pick(
            text, "dtype", "torch_dtype", default=_pick(raw, "dtype", "torch_dtype", default="bfloat16")
        )
        eos = _eos_token_id(raw, text)
        cfg = Qwen35Config(
            **ints,
            linear_conv_kernel_dim=_int_field(text, "linear_conv_kernel_dim", default=4, where=where),
            layer_types=layer_types,
            rms_norm_eps=eps,
            rope_theta=rope_theta,
            partial_rotary_factor=prf,
            tie_word_embeddings=tie,
            mtp_num_hidden_layers=_int_field(
                text, "mtp_num_hidden_layers", default=0, minimum=0, where=where
            ),
            max_position_embeddings=_int_field(text, "max_position_embeddings", default=262144, where=where),
            dtype=str(dtype),
            eos_token_id=eos,
            extra=dict(raw),
        )
    except _ConfigFieldError as exc:
        raise backend_unsupported(f"config.json is not a usable Qwen3.5 text config: {exc}") from None
    _check_head_groups(cfg)
    return cfg


def _layer_types(text: dict, layers: int, where: str) -> tuple[str, ...]:
    """Each layer's attention kind: `layer_types` as given, else a full-attention layer every
    `full_attention_interval`-th."""
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = _int_field(
            text, "full_attention_interval", default=DEFAULT_FULL_ATTENTION_INTERVAL, where=where
        )
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
    if (
        not isinstance(layer_types, list | tuple)
        or len(layer_types) != layers
        or any(t not in (FULL_ATTENTION, LINEAR_ATTENTION) for t in layer_types)
    ):
        raise _ConfigFieldError(
            f"field 'layer_types'{where} must list {layers} of {FULL_ATTENTION!r}/{LINEAR_ATTENTION!r}, "
            f"got {_short_repr(layer_types)}"
        )
    return tuple(layer_types)


def _rope(text: dict, head_dim: int, where: str) -> tuple[float, float]:
    """(rope θ, partial rotary factor): plain RoPE only, rope_parameters winning over top-level keys."""
    rope = _pick(text, "rope_parameters", "rope_scaling", default={})
    if not isinstance(rope, dict):
        raise _ConfigFieldError(f"field 'rope_parameters'{where} must be an object, got {rope!r}")
    rope_type = _pick(rope, "rope_type", "type", default="default")
    if rope_type not in PLAIN_ROPE_TYPES:
        raise _ConfigFieldError(
            f"rope_parameters.rope_type {rope_type!r}{where} (RoPE scaling) is not supported; "
            "only the plain Qwen3.5 RoPE ('default') is implemented"
        )
    top = _float_field(text, "rope_theta", DEFAULT_ROPE_THETA, where=where)
    rope_theta = _float_field(rope, "rope_theta", top, where=" (in rope_parameters)")
    top = _float_field(text, "partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR, where=where)
    prf = _float_field(rope, "partial_rotary_factor", top, where=" (in rope_parameters)")
    rotary_dim = int(head_dim * prf)
    if not 0.0 < prf <= 1.0 or rotary_dim % 2:
        # transformers rotates int(head_dim·factor) channels with rotate-half; an odd count has
        # no rotate-half split (0 is fine: no channel rotates).
        raise _ConfigFieldError(
            f"partial_rotary_factor {prf} of head_dim {head_dim} gives rotary dim {rotary_dim}; "
            "it must be even, with the factor in (0, 1]"
        )
    if rope_theta <= 0:
        raise _ConfigFieldError(f"rope_theta {rope_theta}{where} must be positive")
    return rope_theta, prf


def _refuse_unimplemented(text: dict, where: str) -> None:
    """Activations and attention biases Kiln's Qwen3.5 layers do not implement."""
    act = text.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        # transformers builds the MLP from hidden_act; Kiln's Qwen3.5 MLP is SwiGLU (silu) only.
        raise _ConfigFieldError(f"field 'hidden_act'{where} is {act!r}; only 'silu' is implemented")
    if text.get("attention_bias") not in (None, False):
        raise _ConfigFieldError(
            f"field 'attention_bias'{where} is {text.get('attention_bias')!r}; Qwen3.5 attention has "
            "no biases and Kiln implements none"
        )


def _tie_word_embeddings(raw: dict, text: dict) -> bool:
    tie = _pick(raw, "tie_word_embeddings", default=_pick(text, "tie_word_embeddings", default=False))
    if not isinstance(tie, bool):
        raise _ConfigFieldError(f"field 'tie_word_embeddings' must be true or false, got {tie!r}")
    return tie


def _eos_token_id(raw: dict, text: dict) -> int | None:
    """The end-of-sequence id (the first of a list), from the text config or the wrapper."""
    eos = _pick(text, "eos_token_id", default=_pick(raw, "eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int)):
        raise _ConfigFieldError(f"field 'eos_token_id' must be an integer or a list of them, got {eos!r}")
    return eos


def _check_head_groups(cfg: Qwen35Config) -> None:
    """Grouped heads must divide evenly: value heads over key heads (GDN), query over KV heads."""
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads != 0:
        raise backend_unsupported(
            f"config.json: linear_num_value_heads ({cfg.linear_num_value_heads}) must be a multiple of "
            f"linear_num_key_heads ({cfg.linear_num_key_heads})"
        )
    if cfg.num_attention_heads % cfg.num_key_value_heads != 0:
        raise backend_unsupported(
            f"config.json: num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({cfg.num_key_value_heads})"
        )


def load_config(model_dir: str | Path) -> Qwen35Config:
    root = Path(model_dir)
    if not root.exists():
        raise backend_unsupported(f"model directory {model_dir} does not exist")
    if not root.is_dir():
        raise backend_unsupported(
            f"model directory {model_dir} is not a directory (give the checkpoint's folder)"
        )
    path = root / CONFIG_FILE
    if not path.is_file():
        raise backend_unsupported(f"no config.json in model directory {model_dir}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise backend_unsupported(f"{path} is not readable JSON: {exc}") from None
    return parse_config(raw)
