"""kiln_train: the native Qwen3.5 LoRA SFT library (usable with no server).

Torch is imported lazily: `import kiln_train` stays cheap, and the api imports only the
torch-free modules (sft_config, ingestion, chat_template, tokenizer, memory, model_config).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_model": "kiln_train.model",
    "Qwen35Model": "kiln_train.model",
    "attach_lora": "kiln_train.model",
    "train_sft": "kiln_train.train.trainer",
    "ingest_examples": "kiln_train.data.ingestion",
    "ingest_jsonl": "kiln_train.data.ingestion",
    "load_tokenizer": "kiln_train.data.tokenizer",
    "build_tokenizer": "kiln_train.data.tokenizer",
    "parse_sft_config": "kiln_train.sft_config",
    "SftConfig": "kiln_train.sft_config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln_train' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
