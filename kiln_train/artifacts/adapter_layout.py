"""The file names of an adapter registry: what a published adapter directory holds, and where
a failed run's receipt goes. Import-free, so every package can name these files."""

from __future__ import annotations

# A published adapter directory `<registry>/<name>/`.
ADAPTER_MODEL = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
TRAIN_RECEIPT = "train_receipt.json"
ADAPTER_MANIFEST = "adapter_manifest.json"
CANARY_STATUS = "adapter_canary_status.json"  # only when the run's adapter smoke test ran
# A failed run's receipt: `<registry>/.failed/<name>/<run id>.train_receipt.json`.
FAILED_RECEIPTS_DIR = ".failed"
