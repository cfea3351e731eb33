"""kiln_train: the native Qwen3.5 LoRA SFT library (usable with no server).

`kiln_train.finetune(model_dir, examples_or_jsonl, config, output_dir)` trains one adapter in
one call (docs/library.md); `train_sft` is the trainer underneath it and under the worker.

Torch is imported lazily: `import kiln_train` stays cheap, and the api imports only the
torch-free modules (sft_config, data ingestion, chat templates, the tokenizer, plan, model config).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

_EXPORTS = {
    "finetune": "kiln_train.train.finetune",
    "KilnError": "kiln_train.errors",
    "StepReport": "kiln_train.train.result",
    "load_resident": "kiln_train.train.resident",
    "load_model": "kiln_train.model",
    "Qwen35Model": "kiln_train.model",
    "attach_lora": "kiln_train.model",
    "train_sft": "kiln_train.train.trainer",
    "TrainRequest": "kiln_train.train.request",
    "TrainResult": "kiln_train.train.result",
    "ingest_examples": "kiln_train.data.ingestion",
    "ingest_jsonl": "kiln_train.data.ingestion",
    "load_tokenizer": "kiln_train.data.tokenizer",
    "build_tokenizer": "kiln_train.data.tokenizer",
    "parse_sft_config": "kiln_train.sft_config",
    "SftConfig": "kiln_train.sft_config",
}

__all__ = sorted(_EXPORTS)


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A package's module-level `__getattr__` that imports each exported name's module on first use."""

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__


__getattr__ = lazy_getattr(__name__, _EXPORTS)
