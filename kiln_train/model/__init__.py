"""The native Qwen3.5 text model with LoRA (docs/ARCHITECTURE.md#packages).

Public interface: `load_model`, `Qwen35Model`, `attach_lora`, `LoraSet`. The torch modules load
on first use, so the torch-free parts of this package (`config`, the model's `config.json`
reading that the api's memory admission needs) import without torch.
"""

from __future__ import annotations

from kiln_train import lazy_getattr

_EXPORTS = {
    "segment_bounds": "kiln_train.model.checkpointing",
    "chunk_gated_delta_rule": "kiln_train.model.delta_rule",
    "gated_delta_rule": "kiln_train.model.delta_rule",
    "recurrent_gated_delta_rule": "kiln_train.model.delta_rule",
    "ModelCheckpointError": "kiln_train.model.loader",
    "load_model": "kiln_train.model.loader",
    "load_state_into": "kiln_train.model.loader",
    "load_tensors_into": "kiln_train.model.loader",
    "LORA_INIT_ALGORITHM": "kiln_train.model.lora",
    "LoraSet": "kiln_train.model.lora",
    "attach_lora": "kiln_train.model.lora",
    "lora_key": "kiln_train.model.lora",
    "Qwen35Model": "kiln_train.model.qwen35",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
