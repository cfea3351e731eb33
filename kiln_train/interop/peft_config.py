"""Check 2 of a PEFT import: an `adapter_config.json` Kiln can represent (docs/interop.md#import).

peft_type LORA, an integer rank, a finite positive alpha, target_modules a list drawn from the ten
Qwen3.5 targets, and no option Kiln cannot represent (DoRA, rsLoRA, biases, per-module ranks or
alphas, modules_to_save, layer subsets, fan-in-fan-out, an initialisation that rewrote the base
weights, ...).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from kiln_train.artifacts.adapter import ADAPTER_CONFIG
from kiln_train.ground import json_bounded
from kiln_train.interop.errors import import_invalid
from kiln_train.model.config import LORA_TARGET_MODULES

# The keys `check_peft_config` reads itself.
_SHAPE_KEYS = ("peft_type", "task_type", "r", "lora_alpha", "target_modules")
# adapter_config.json keys that only describe the run or the file (any value).
_DESCRIPTIVE = frozenset(
    {
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "auto_mapping",
        "peft_version",
        "lora_dropout",  # dropout shapes training only; the trained adapter is plain LoRA
        "megatron_core",
        "qalora_group_size",  # meaningful only with use_qalora, which is refused
        "ensure_weight_tying",  # meaningful only with modules_to_save / trainable tokens, refused
        "eva_config",  # EVA only chooses the initial A; rank redistribution would show in rank_pattern
    }
)
# Initialisations after which the adapter is a plain delta on the original base weights (PiSSA,
# OLoRA, LoftQ, CorDA and LoRA-GA rewrite the base weights instead).
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")

# Options Kiln represents only when unset (None, False, {}, [] or ""): option -> why.
_UNSET_ONLY = {
    "use_dora": "DoRA adds a magnitude vector Kiln does not train or load",
    "use_rslora": "rsLoRA scales by alpha/sqrt(r); Kiln scales by alpha/r",
    "use_qalora": "QA-LoRA pools the input; Kiln's LoRA does not",
    "lora_bias": "Kiln trains no LoRA biases",
    "fan_in_fan_out": "Kiln stores A as [r, in] and B as [out, r]",
    "modules_to_save": "Kiln trains the LoRA pairs only",
    "trainable_token_indices": "Kiln trains no token embeddings",
    "target_parameters": "Kiln adapts modules, not parameters",
    "rank_pattern": "Kiln uses one rank for every target",
    "alpha_pattern": "Kiln uses one alpha for every target",
    "layers_to_transform": "Kiln adapts every layer",
    "layers_pattern": "Kiln adapts every layer",
    "exclude_modules": "Kiln adapts every layer of a target",
    "layer_replication": "Kiln does not replicate layers",
    "alora_invocation_tokens": "activated LoRA changes when the adapter applies",
    "megatron_config": "Kiln adapters have none",
    "loftq_config": "LoftQ rewrites the base weights",
    "corda_config": "CorDA rewrites the base weights",
    "lora_ga_config": "LoRA-GA rewrites the base weights",
}
# Options with another neutral value: option -> (whether a value is neutral, why).
_NEUTRAL_VALUES: dict[str, tuple[Callable[[object], bool], str]] = {
    "bias": (lambda v: v in (None, "none"), "Kiln trains no biases"),
    "init_lora_weights": (
        lambda v: v in _PLAIN_INITS,
        "this initialisation rewrites the base weights, so the adapter is not a delta on the resident model",
    ),
}
_UNKNOWN = "Kiln does not know this PEFT option"


def _falsy(value) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


def check_peft_config(data: bytes) -> tuple[int, float, list[str], dict]:
    """(rank, alpha, targets, the config) of an adapter_config.json Kiln can represent."""
    try:
        cfg = json_bounded.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise import_invalid(f"{ADAPTER_CONFIG} is not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise import_invalid(f"{ADAPTER_CONFIG} is not a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise import_invalid(
            f"{ADAPTER_CONFIG}: peft_type is {cfg.get('peft_type')!r}; Kiln imports LORA adapters"
        )
    task = cfg.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise import_invalid(f"{ADAPTER_CONFIG}: task_type is {task!r}; Kiln adapters are CAUSAL_LM")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise import_invalid(f"{ADAPTER_CONFIG}: r must be a positive integer, got {r!r}")
    alpha = cfg.get("lora_alpha")
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise import_invalid(f"{ADAPTER_CONFIG}: lora_alpha must be a finite positive number, got {alpha!r}")
    targets = _check_targets(cfg.get("target_modules"))
    _check_options(cfg)
    return r, float(alpha), list(targets), cfg


def _check_targets(targets) -> list[str]:
    if isinstance(targets, str):
        raise import_invalid(
            f"{ADAPTER_CONFIG}: target_modules is the pattern {targets!r}; Kiln imports adapters that list "
            f"their modules, drawn from {list(LORA_TARGET_MODULES)}"
        )
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise import_invalid(f"{ADAPTER_CONFIG}: target_modules must be a non-empty list of module names")
    for target in targets:
        if target not in LORA_TARGET_MODULES:
            raise import_invalid(
                f"{ADAPTER_CONFIG}: target module {target!r} is not one of Kiln's ten LoRA targets "
                f"{list(LORA_TARGET_MODULES)}"
            )
    if len(set(targets)) != len(targets):
        raise import_invalid(f"{ADAPTER_CONFIG}: target_modules lists a module twice")
    return targets


def _check_options(cfg: dict) -> None:
    """Every other key must be descriptive or hold its neutral value (the first in name order is named)."""
    for key in sorted(cfg):
        if key in _SHAPE_KEYS or key in _DESCRIPTIVE:
            continue
        value = cfg[key]
        neutral, why = _NEUTRAL_VALUES.get(key) or (_falsy, _UNSET_ONLY.get(key, _UNKNOWN))
        if not neutral(value):
            raise import_invalid(
                f"{ADAPTER_CONFIG}: {key} = {json.dumps(value)} cannot be represented: {why}"
            )
