"""Where a run's outcome lands: the adapter of a successful run, published with its receipt and
manifest, or the failed receipt of any other."""

from __future__ import annotations

from pathlib import Path

from kiln_train.artifacts import adapter as adapter_io
from kiln_train.artifacts.adapter_layout import FAILED_RECEIPTS_DIR, TRAIN_RECEIPT
from kiln_train.artifacts.fencing import Fence
from kiln_train.artifacts.receipt import RunFacts, adapter_manifest, build_receipt
from kiln_train.train.resident import ResidentModel


def failed_receipt_path(registry: Path, adapter_name: str, run_id: str) -> Path:
    return registry / FAILED_RECEIPTS_DIR / adapter_name / f"{run_id}.{TRAIN_RECEIPT}"


def write_failed_receipt(registry: Path, adapter_name: str, run_id: str, receipt: dict) -> Path:
    path = failed_receipt_path(registry, adapter_name, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(adapter_io.json_bytes(receipt))
    tmp.replace(path)
    return path


def publish_success(
    resident: ResidentModel,
    facts: RunFacts,
    registry: Path,
    tensors: dict,
    *,
    parent_adapter: str | None,
    extra_files: dict[str, bytes] | None = None,
    fence: Fence | None = None,
) -> tuple[Path, dict]:
    scale = facts.alpha / facts.rank
    holder: dict = {}

    def _receipt(output: dict) -> dict:
        holder["receipt"] = build_receipt(
            facts,
            status="success",
            output=output,
            lora_delta_norms=adapter_io.lora_delta_norms(tensors, scale),
        )
        return holder["receipt"]

    path = adapter_io.publish_adapter(
        registry,
        facts.adapter_name,
        tensors,
        rank=facts.rank,
        alpha=facts.alpha,
        build_receipt=_receipt,
        build_manifest=lambda receipt, hashes: adapter_manifest(
            receipt, hashes, parent_adapter=parent_adapter
        ),
        extra_files=extra_files,
        fence=fence,
    )
    return path, holder["receipt"]
