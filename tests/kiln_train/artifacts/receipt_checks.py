"""Reader checks that tests apply to every `train_receipt.json` a run writes: the envelope and the
SFT cross-bindings between its sections; and the key order of the adapter_config.json beside it."""

from __future__ import annotations

from kiln_train.artifacts.receipt import RECEIPT_TYPE
from kiln_train.errors import FAILURE_REASONS

# docs/artifacts.md#adapter-config: adapter_config.json's keys, in the order they are written.
ADAPTER_CONFIG_KEYS = ["r", "lora_alpha", "target_modules", "task_type", "bias", "peft_type"]


def validate_receipt(receipt: dict) -> None:
    """Reader validation of docs/artifacts.md#receipt-fields: envelope and SFT cross-bindings.

    Raises ValueError."""
    if receipt.get("schema_version") != 1 or receipt.get("receipt_type") != RECEIPT_TYPE:
        raise ValueError("not a kiln_train_receipt v1")
    if not receipt.get("adapter_name"):
        raise ValueError("adapter_name must be non-empty")
    status = receipt.get("status")
    if status not in ("success", "failed"):
        raise ValueError(f"bad status {status!r}")
    if status == "success" and receipt.get("failure_reason") is not None:
        raise ValueError("a successful receipt has no failure_reason")
    if status == "failed" and receipt.get("failure_reason") not in FAILURE_REASONS:
        raise ValueError(f"unknown failure_reason {receipt.get('failure_reason')!r}")
    if receipt["hyperparameters"].get("mode") != "sft":
        raise ValueError("hyperparameters.mode must be sft")
    ing = receipt["data"].get("sft_ingestion")
    if ing is None:
        raise ValueError("SFT receipts carry data.sft_ingestion")
    td = receipt["training_data"]
    if td["source"] != ing["source"] or td["path"] != ing.get("source_locator"):
        raise ValueError("training_data source/path disagree with data.sft_ingestion")
    if td["sha256"] != ing["kept_corpus_sha256"]:
        raise ValueError("training_data.sha256 differs from the kept-corpus digest")
    if receipt["data"]["examples_read"] != ing["rows_read"]:
        raise ValueError("data.examples_read differs from rows_read")
    if receipt["data"]["examples_filtered"] != ing["rows_rejected"]:
        raise ValueError("data.examples_filtered differs from rows_rejected")
    if receipt["config"].get("invalid_row_policy") != ing["invalid_row_policy"]:
        raise ValueError("config.invalid_row_policy differs from the ingestion policy")
    tok, hashes = receipt["tokenizer"], receipt["config_hashes"]
    if tok.get("training_chat_template_hash") != hashes.get("training_chat_template_hash"):
        raise ValueError("training chat template digests disagree")
    prov = receipt["runtime"].get("execution_provenance")
    if prov is not None:
        prov_tmpl = prov.get("model", {}).get("training_chat_template_sha256")
        if prov_tmpl is not None and prov_tmpl != tok.get("training_chat_template_hash"):
            raise ValueError("execution provenance template digest disagrees with the tokenizer section")
    if receipt["runtime"].get("sft_loss_route") is None:
        raise ValueError("runtime.sft_loss_route is required for SFT")
