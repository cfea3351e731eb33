"""Importing a PEFT LoRA adapter into Kiln's registry, after it proved it belongs (docs/interop.md).

An upload is a gzip tar of an adapter directory: `adapter_config.json` and
`adapter_model.safetensors` (required), and from a run of a Kiln export bundle
`kiln_hf_result.json`, `step_losses.jsonl` and optionally the bundle's `kiln_hf_export.json`.
`plan_import` checks, in this order, and names the first difference:

1. the archive: a gzip tar of regular files, at most one directory deep, each name once;
2. `adapter_config.json`: peft_type LORA, an integer rank no larger than the model's ceiling (the
   one a job's rank meets, docs/optimizers.md#rank-ranges), a finite positive alpha, target_modules
   a list drawn from the ten Qwen3.5 targets, and no option Kiln cannot represent (DoRA, rsLoRA,
   biases, per-module ranks or alphas, modules_to_save, layer subsets, fan-in-fan-out, an
   initialisation that rewrote the base weights, ...);
3. `adapter_model.safetensors` against the resident model: every tensor a LoRA A/B weight of a
   listed target on an existing projection, every such projection present, shapes
   `A [r, in]` / `B [out, r]` (a wrong rank is named as one), floating dtypes, finite values;
4. when `kiln_hf_result.json` is present: a finished run (`kiln.hf-trl-result.v1`), whose
   recorded adapter file hashes are the uploaded files', whose export (by bundle digest) is one this
   server published or the uploaded `kiln_hf_export.json`, run by that bundle's own `train.py`,
   on the rank, alpha and targets the adapter claims, with the base model, tokenizer and training
   template identities of the resident runner.

Structural problems (1-3, and a run that did not finish) are `peft_import_invalid` (400);
provenance problems (4) are `peft_import_mismatch` (409). Nothing is written before every check
passed. `publish_import` then writes the adapter Kiln can warm-start from: the tensors under
Kiln's key names (a VL-class prefix is normalised), Kiln's `adapter_config.json`, targets the
upload did not train filled with a zero-delta pair (B = 0, A from `kiln-py.seeded-lora-init.v1`
so the pair can still learn), `adapter_manifest.json`, the import receipt
`kiln_import_receipt.json` (schema `kiln.hf-peft-import.v1`) and the run's own files, in a
staging directory renamed into place (names are never overwritten).

The checks live in `peft_upload` (1), `peft_config` (2), `peft_tensors` (3) and `peft_run` (4);
this module plans and publishes. Torch-free: the api runs it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from kiln_train.artifacts.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_MANIFEST,
    ADAPTER_MODEL,
    adapter_config,
    check_adapter_name,
    parse_key,
)
from kiln_train.artifacts.receipt import ADAPTER_MANIFEST_TYPE, manifest_layout
from kiln_train.errors import ADAPTER_ALREADY_EXISTS, KilnError
from kiln_train.ground.digest import sha256_prefixed
from kiln_train.ground.durable_files import fsync_dir, rename_no_replace, write_new_file
from kiln_train.interop import safetensors_io
from kiln_train.interop.bundle import MANIFEST, ResidentFacts
from kiln_train.interop.errors import import_invalid
from kiln_train.interop.lora_init import LORA_INIT_ALGORITHM, seeded_lora_tensors
from kiln_train.interop.peft_config import check_peft_config
from kiln_train.interop.peft_run import RESULT_SCHEMA, RUN_ADAPTER_FILES, check_run, get_path
from kiln_train.interop.peft_tensors import check_tensors
from kiln_train.interop.peft_upload import (
    LOSSES_FILE,
    MAX_MEMBERS,
    RESULT_FILE,
    UPLOAD_FILES,
    Upload,
    read_archive,
    read_directory,
)
from kiln_train.model.config import LORA_TARGET_MODULES

__all__ = [
    "IMPORT_RECEIPT",
    "IMPORT_SCHEMA",
    "LOSSES_FILE",
    "MAX_MEMBERS",
    "RESULT_FILE",
    "RESULT_SCHEMA",
    "RUN_ADAPTER_FILES",
    "SOURCE_CONFIG",
    "UPLOAD_FILES",
    "ImportPlan",
    "Upload",
    "check_peft_config",
    "check_run",
    "check_tensors",
    "plan_import",
    "publish_import",
    "read_archive",
    "read_directory",
]

IMPORT_SCHEMA = "kiln.hf-peft-import.v1"
IMPORT_RECEIPT = "kiln_import_receipt.json"
SOURCE_CONFIG = "peft_adapter_config.json"  # the uploaded adapter_config.json, kept as it came
STAGING_MARK = ".incomplete-"


@dataclass
class ImportPlan:
    """Everything `publish_import` writes, decided by `plan_import` (no file written yet)."""

    rank: int
    alpha: float
    targets: list[str]
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]]
    filled: list[str]
    fill_seed: int | None
    key_prefix: str
    upload: Upload
    peft_config: dict
    result: dict | None
    export: dict | None
    resident: ResidentFacts
    checks: list[str] = field(default_factory=list)

    @property
    def vouched(self) -> bool:
        """Whether a run manifest bound the adapter to the resident identities."""
        return self.result is not None


# ----- the plan and the publication -----------------------------------------------------------------


def plan_import(
    upload: Upload, resident: ResidentFacts, find_export: Callable[[str], dict | None]
) -> ImportPlan:
    """Every check, in order; the first failure raises (400 or 409), nothing is written."""
    for name in RUN_ADAPTER_FILES:
        if name not in upload.files:
            raise import_invalid(f"the upload has no {name}; it must hold a PEFT adapter directory")
    checks = ["archive"]
    rank, alpha, targets, cfg = check_peft_config(upload.files[ADAPTER_CONFIG])
    ceiling = resident.model.model_maximum_rank()
    if rank > ceiling:  # before any tensor is shaped or filled at that rank
        raise import_invalid(
            f"{ADAPTER_CONFIG}: r = {rank} is above {ceiling}, the largest LoRA rank of the resident model "
            "(no job could train or warm-start from it)"
        )
    checks.append("adapter_config")
    tensors, prefix = check_tensors(upload.files[ADAPTER_MODEL], resident, rank, targets)
    checks += ["tensor_names_and_shapes", "dtypes", "finite_values"]
    result = export = None
    if RESULT_FILE in upload.files:
        result, export = check_run(upload, resident, rank, alpha, targets, find_export)
        checks += ["run_files", "export_digest", "runner_script", "identities", "lora_shape"]
    filled = [t for t in LORA_TARGET_MODULES if t not in targets]
    fill_seed = None
    if filled:
        fill_seed = int.from_bytes(hashlib.sha256(upload.files[ADAPTER_MODEL]).digest()[:8], "big")
        init = seeded_lora_tensors(resident.model, rank, fill_seed)
        for key, value in init.items():
            if parse_key(key)[2] in filled:
                tensors[key] = value
    return ImportPlan(
        rank=rank,
        alpha=alpha,
        targets=[t for t in LORA_TARGET_MODULES if t in targets],
        tensors=tensors,
        filled=filled,
        fill_seed=fill_seed,
        key_prefix=prefix,
        upload=upload,
        peft_config=cfg,
        result=result,
        export=export,
        resident=resident,
        checks=checks,
    )


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _receipt(name: str, plan: ImportPlan, published: dict, runner_id: str | None) -> dict:
    resident = plan.resident
    run = None
    if plan.result is not None:
        result, export = plan.result, plan.export or {}
        run = {
            "export": {"name": export.get("name"), "bundle_digest": export.get("bundle_digest")},
            "script_sha256": get_path(result, "script.sha256"),
            "versions": result.get("versions"),
            "version_drift": result.get("version_drift"),
            "steps": get_path(result, "run.steps"),
            "final_loss": get_path(result, "losses.final_loss"),
            "losses_sha256": get_path(result, "losses.sha256"),
            "training_data_sha256": get_path(export, "data.kept_corpus_sha256"),
        }
    return {
        "schema": IMPORT_SCHEMA,
        "adapter_name": name,
        "imported_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "origin": "kiln_hf_trl_run" if plan.result is not None else "peft",
        "upload": {
            "files": {
                n: {"sha256": sha256_prefixed(b), "bytes": len(b)}
                for n, b in sorted(plan.upload.files.items())
            },
            "ignored": list(plan.upload.ignored),
        },
        "peft_config": plan.peft_config,
        "adapter": {
            "rank": plan.rank,
            "alpha": plan.alpha,
            "key_prefix": plan.key_prefix,
            "dtypes": sorted({d for d, _, _ in plan.tensors.values()}),
            "tensors": len(plan.tensors),
            "targets_trained": plan.targets,
            "targets_filled": plan.filled,
            "fill": None
            if not plan.filled
            else {"a": LORA_INIT_ALGORITHM, "seed": str(plan.fill_seed), "b": "zeros", "delta": "zero"},
        },
        "run": run,
        "resident": {
            "runner_id": runner_id,
            "model_config_sha256": resident.identity["model_config_sha256"],
            "base_weights_sha256": resident.base_weights_sha256,
            "tokenizer_vocab_sha256": resident.identity["tokenizer_vocab_sha256"],
            "training_chat_template_sha256": resident.identity["training_chat_template_sha256"],
        },
        "identity_vouched_by_run": plan.vouched,
        "checks": plan.checks,
        "published": published,
    }


def _manifest(name: str, plan: ImportPlan, hashes: dict) -> dict:
    """`adapter_manifest.json`: the fields a warm start reads (kiln_train.artifacts.adapter
    .check_adapter_provenance) are set only where a run manifest vouched for them."""
    resident, vouched = plan.resident, plan.vouched
    return {
        "schema_version": 1,
        "manifest_type": ADAPTER_MANIFEST_TYPE,
        "adapter_name": name,
        "safetensors_hash": hashes["safetensors_hash"],
        "config_hash": hashes["config_hash"],
        "receipt_hash": hashes["receipt_hash"],
        "parent_adapter": None,
        "model_config_hash": resident.identity["model_config_sha256"] if vouched else None,
        "training_chat_template_hash": resident.identity["training_chat_template_sha256"]
        if vouched
        else None,
        "base_weight_shard_manifest": {"aggregate_sha256": resident.base_weights_sha256} if vouched else None,
        "execution_provenance": None,
        "training_precision": None,
        "kiln_commit": None,
        "training_data_hash": get_path(plan.export, "data.kept_corpus_sha256") if plan.export else None,
        "training_data_source": "hf_trl_export" if vouched else None,
        "training_data_path": None,
        "openenv_training_data": None,
        **manifest_layout("import_receipt", IMPORT_RECEIPT),
        "origin": "peft_import",
    }


def publish_import(
    adapters_dir: Path,
    name: str,
    plan: ImportPlan,
    *,
    runner_id: str | None = None,
    register: Callable[[Path, dict], None] | None = None,
) -> tuple[Path, dict]:
    """Write the adapter in a hidden staging directory and rename it to `adapters_dir/name`.

    `register(path, receipt)` records it (the api inserts the `adapters` row in the transaction
    it commits); when it raises, the published directory is removed again, so a refused import
    leaves nothing. Returns (path, import receipt).
    """
    check_adapter_name(name)
    adapters_dir.mkdir(parents=True, exist_ok=True)
    target = adapters_dir / name
    # A fixed-length staging name (an adapter name may use the whole 255 bytes of a path segment);
    # the registry's sweep of abandoned `.<x>.incomplete-<hex>` directories covers it too.
    staging = adapters_dir / f".hf-import{STAGING_MARK}{uuid.uuid4().hex}"
    staging.mkdir()
    renamed = False
    try:
        receipt = _write_adapter(staging, name, plan, runner_id)
        fsync_dir(staging)
        try:
            rename_no_replace(staging, target)
        except FileExistsError:
            raise KilnError(ADAPTER_ALREADY_EXISTS, f"adapter {name!r} already exists") from None
        renamed = True
        fsync_dir(adapters_dir)
        if register is not None:
            register(target, receipt)
    except BaseException:
        shutil.rmtree(target if renamed else staging, ignore_errors=True)
        raise
    return target, receipt


def _write_adapter(staging: Path, name: str, plan: ImportPlan, runner_id: str | None) -> dict:
    """Every file of the imported adapter into `staging`; returns the import receipt."""
    model_bytes = safetensors_io.dump(plan.tensors, {"format": "pt"})
    config_bytes = _json_bytes(adapter_config(plan.rank, plan.alpha))
    write_new_file(staging / ADAPTER_MODEL, model_bytes)
    write_new_file(staging / ADAPTER_CONFIG, config_bytes)
    write_new_file(staging / SOURCE_CONFIG, plan.upload.files[ADAPTER_CONFIG])
    for extra in (RESULT_FILE, LOSSES_FILE, MANIFEST):
        if extra in plan.upload.files:
            write_new_file(staging / extra, plan.upload.files[extra])
    published = {
        "adapter_model_sha256": sha256_prefixed(model_bytes),
        "adapter_model_bytes": len(model_bytes),
        "adapter_config_sha256": sha256_prefixed(config_bytes),
    }
    receipt = _receipt(name, plan, published, runner_id)
    receipt_bytes = _json_bytes(receipt)
    write_new_file(staging / IMPORT_RECEIPT, receipt_bytes)
    hashes = {
        "safetensors_hash": published["adapter_model_sha256"],
        "config_hash": published["adapter_config_sha256"],
        "receipt_hash": sha256_prefixed(receipt_bytes),
    }
    write_new_file(staging / ADAPTER_MANIFEST, _json_bytes(_manifest(name, plan, hashes)))
    return receipt
