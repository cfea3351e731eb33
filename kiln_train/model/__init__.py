"""The native Qwen3.5 text model with LoRA (DESIGN §3; qwen35.md §2).

Public interface: `load_model`, `Qwen35Model`, `attach_lora`, `LoraSet`.
"""

from kiln_train.model.checkpointing import segment_bounds
from kiln_train.model.delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
)
from kiln_train.model.loader import CheckpointError, load_model, load_state_into, load_tensors_into
from kiln_train.model.lora import LORA_INIT_ALGORITHM, LoraSet, attach_lora, lora_key
from kiln_train.model.qwen35 import Qwen35Model

__all__ = [
    "LORA_INIT_ALGORITHM",
    "CheckpointError",
    "LoraSet",
    "Qwen35Model",
    "attach_lora",
    "chunk_gated_delta_rule",
    "gated_delta_rule",
    "load_model",
    "load_state_into",
    "load_tensors_into",
    "lora_key",
    "recurrent_gated_delta_rule",
    "segment_bounds",
]
