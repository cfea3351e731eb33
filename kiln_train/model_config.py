"""Qwen3.5 text-model shape, read from a Hugging Face `config.json` (qwen35.md §1).

Torch-free: the api uses it for memory admission and the optimizer support report.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln_train.errors import backend_unsupported

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# The ten LoRA targets of the contract, in the contract's order (kiln-contract §6.2).
LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
GDN_TARGETS = ("in_proj_qkv", "in_proj_z", "out_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# The canonical Qwen3.5-4B text config (qwen35.md §1.1): 8 full-attention layers at (i+1) % 4 == 0.
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
    def num_full_attention_layers(self) -> int:
        return sum(1 for t in self.layer_types if t == FULL_ATTENTION)

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
        """Smallest in/out dimension over trained projections (kiln-contract §2.2)."""
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


def parse_config(raw: dict) -> Qwen35Config:
    """Parse a Qwen3.5 `config.json` object, with or without the VL wrapper (`text_config`)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    try:
        hidden = int(text["hidden_size"])
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        head_dim = int(_pick(text, "head_dim", default=hidden // heads))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)
            ]
        layer_types = tuple(layer_types)
        if len(layer_types) != layers or any(
            t not in (FULL_ATTENTION, LINEAR_ATTENTION) for t in layer_types
        ):
            raise ValueError(f"layer_types must list {layers} of {FULL_ATTENTION!r}/{LINEAR_ATTENTION!r}")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_theta = float(_pick(rope, "rope_theta", default=_pick(text, "rope_theta", default=1e7)))
        prf = float(
            _pick(rope, "partial_rotary_factor", default=_pick(text, "partial_rotary_factor", default=0.25))
        )
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        dtype = str(
            _pick(
                text, "dtype", "torch_dtype", default=_pick(raw, "dtype", "torch_dtype", default="bfloat16")
            )
        )
        eos = _pick(text, "eos_token_id", default=_pick(raw, "eos_token_id"))
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        cfg = Qwen35Config(
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=head_dim,
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            layer_types=layer_types,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            partial_rotary_factor=prf,
            tie_word_embeddings=bool(tie),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            dtype=dtype,
            eos_token_id=None if eos is None else int(eos),
            extra=dict(raw),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise backend_unsupported(f"config.json is not a Qwen3.5 text config: {exc}") from exc
    if min(cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.vocab_size) <= 0:
        raise backend_unsupported("config.json has non-positive model dimensions")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads != 0:
        raise backend_unsupported("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg.num_attention_heads % cfg.num_key_value_heads != 0:
        raise backend_unsupported("num_attention_heads must be a multiple of num_key_value_heads")
    return cfg


def load_config(model_dir: str | Path) -> Qwen35Config:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise backend_unsupported(f"no config.json in model directory {model_dir}")
    return parse_config(json.loads(path.read_text(encoding="utf-8")))


def file_sha256(path: str | Path) -> str:
    """Plain SHA-256 of a file, 64 lowercase hex (no prefix)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
