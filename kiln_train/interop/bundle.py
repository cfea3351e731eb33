"""SFT export bundles `<name>.kiln-hf/` (schema `kiln.hf-trl-export.v1`, docs/interop.md).

A bundle is everything a TRL run needs to repeat what Kiln would train, and everything a later
import needs to recognise it:

    kiln_hf_export.json          the manifest (below)
    train.jsonl                  one line per optimizer step, in Kiln's order
    ingestion_receipt.json       the `kiln.sft-ingestion.v1` receipt of the rows
    tokenizer.json               the resident runner's tokenizer
    config.json                  the resident model's config
    chat_template_training.jinja Kiln's training template ({% generation %} around each answer)
    initial_adapter/             adapter_config.json + adapter_model.safetensors Kiln starts from
    train.py, requirements.lock  the pinned TRL runner and the versions it runs on
    README.md                    how to run it

A `train.jsonl` line holds the step (1-based), its epoch and position, the row's index in the
source and its `kiln.sft-parsed-row.v1` hash, the parsed row itself, the messages and tools as
Kiln hands them to the template, and Kiln's token ids and supervised token ranges for the row, so
the runner can refuse a run whose tokenization differs from Kiln's before any step (`bundle_rows`).

The manifest binds the base model, tokenizer and template identities, the LoRA shape and the ten
targets, the optimizer and seed, the data order, a table of how closely the runner follows the
native profile (`bundle_fidelity`), and the SHA-256 of every other file. `bundle_digest` is the
SHA-256 of the manifest's canonical JSON without that one field, so it covers every file (through
its hash) and every recorded fact.

Torch-free: the api builds bundles (the initial adapter comes from `lora_init`).
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path

from kiln_train.artifacts.adapter import ADAPTER_CONFIG, ADAPTER_MODEL, adapter_config
from kiln_train.checkpoint.epoch_order import EPOCH_ORDER_ALGORITHM
from kiln_train.data.chat_template import TRAINING_TEMPLATE_FILE
from kiln_train.data.ingestion import IngestionResult
from kiln_train.data.labels import MASK_CONTRACT
from kiln_train.errors import invalid_request
from kiln_train.ground.digest import json_sha256, sha256_prefixed
from kiln_train.ground.durable_files import fsync_dir, fsync_tree, rename_no_replace, write_new_file
from kiln_train.interop import safetensors_io
from kiln_train.interop.bundle_fidelity import profile_fidelity
from kiln_train.interop.bundle_rows import step_orders, train_lines
from kiln_train.interop.errors import HF_EXPORT_ALREADY_EXISTS, HF_EXPORT_UNSUPPORTED, InteropError
from kiln_train.interop.lora_init import LORA_INIT_ALGORITHM
from kiln_train.model.config import LORA_TARGET_MODULES, Qwen35Config
from kiln_train.sft_config import TRAINING_PROFILE, SftConfig
from kiln_train.train.guards import DIVERGENCE_MARGIN, DIVERGENCE_RATIO

EXPORT_SCHEMA = "kiln.hf-trl-export.v1"
BUNDLE_SUFFIX = ".kiln-hf"
MANIFEST = "kiln_hf_export.json"
TRAIN_FILE = "train.jsonl"
RECEIPT_FILE = "ingestion_receipt.json"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"
TEMPLATE_FILE = "chat_template_training.jinja"
INITIAL_ADAPTER_DIR = "initial_adapter"
RUNNER_FILE = "train.py"
LOCK_FILE = "requirements.lock"
README_FILE = "README.md"
STAGING_MARK = ".incomplete-"
# One path segment for `<name>.kiln-hf` and its hidden staging directory.
EXPORT_NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_EXPORT_NAME_RE = re.compile(EXPORT_NAME_PATTERN[1:-1])
# Packages whose exact version `train.py` insists on (they decide rendering, numerics and the
# adapter format); the lock pins the rest of their closure too, which the runner only records.
ENFORCED_PINS = ("torch", "transformers", "trl", "peft", "accelerate", "tokenizers", "safetensors", "jinja2")
SUPPORTED_OPTIMIZERS = ("sgd", "adam_w")


def runner_bytes(name: str) -> bytes:
    """A file of the runner package data (`train.py`, `requirements.lock`)."""
    return resources.files("kiln_train.interop").joinpath("runner", name).read_bytes()


def parse_lock(text: str) -> dict[str, str]:
    """`name==version` lines of requirements.lock (comments and blanks skipped)."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def check_export_name(name: str) -> str:
    if not isinstance(name, str) or not _EXPORT_NAME_RE.fullmatch(name):
        raise invalid_request(f"name {name!r} must match {EXPORT_NAME_PATTERN}")
    return name


def bundle_dir_name(name: str) -> str:
    return f"{name}{BUNDLE_SUFFIX}"


def is_staging(entry: str) -> bool:
    return entry.startswith(".") and STAGING_MARK in entry


def refuse_unsupported_optimizer(kind: str) -> None:
    """Muon cannot be exported: the pinned stack has no optimizer that computes Kiln's update."""
    if kind in SUPPORTED_OPTIMIZERS:
        return
    if kind == "muon":
        raise InteropError(
            HF_EXPORT_UNSUPPORTED,
            "config.optimizer.kind 'muon' cannot be exported: the pinned TRL runner (trl 1.16.0, torch "
            "2.13.0) has no optimizer that computes Kiln's Muon update. torch.optim.Muon keeps its "
            "momentum as an interpolation (lerp), orthogonalises in bfloat16 and clamps the "
            "normalisation, where Kiln accumulates momentum, runs Newton-Schulz in float32 on a "
            "power-of-two pre-scaled matrix and scales by 0.2*sqrt(max(rows, cols)); a TRL run "
            "would train a different adapter. Export with sgd or adam_w",
        )
    raise InteropError(HF_EXPORT_UNSUPPORTED, f"config.optimizer.kind {kind!r} cannot be exported")


# ----- what the bundle binds about the resident runner -------------------------------------------


@dataclass(frozen=True)
class ResidentFacts:
    """The resident runner as an export or an import sees it (from its `runners` row)."""

    model_dir: Path
    model: Qwen35Config
    identity: dict  # kiln_train.artifacts.provenance.model_identity
    base_weights_sha256: str
    base_weight_dtype: str  # contract dtype: f32 | bf16
    lora_dtype: str
    loss_route: str
    runner_id: str | None = None
    execution_identity_digest: str | None = None

    @classmethod
    def of_resident(cls, resident) -> ResidentFacts:
        """The facts of a loaded `kiln_train.train.resident.ResidentModel` (a library caller's)."""
        return cls(
            model_dir=Path(resident.model_dir),
            model=resident.config,
            identity=dict(resident.identity),
            base_weights_sha256=resident.base_weights_sha256,
            base_weight_dtype=resident.backend.base_weight_dtype,
            lora_dtype=resident.backend.lora_dtype,
            loss_route=resident.backend.sft_loss_route,
            execution_identity_digest=resident.execution_identity_digest,
        )

    def base_model(self) -> dict:
        return {
            "model_config_sha256": self.identity["model_config_sha256"],
            "base_weights_sha256": self.base_weights_sha256,
            "architecture": "qwen3_5",
            "num_hidden_layers": self.model.num_hidden_layers,
            "hidden_size": self.model.hidden_size,
            "vocab_size": self.model.vocab_size,
        }

    def tokenizer(self) -> dict:
        return {
            "tokenizer_vocab_sha256": self.identity["tokenizer_vocab_sha256"],
            "tokenizer_config_sha256": self.identity.get("tokenizer_config_sha256"),
        }

    def template(self) -> dict:
        return {
            "chat_template_sha256": self.identity.get("chat_template_sha256"),
            "training_chat_template_sha256": self.identity["training_chat_template_sha256"],
        }


@dataclass(frozen=True)
class InitialAdapter:
    """The adapter both runs start from: Kiln's seeded init, or an input adapter's tensors."""

    tensors: dict[str, tuple[str, tuple[int, ...], bytes]]
    source: str  # "seeded" | "input_adapter"
    seed: int
    input_adapter: dict | None = None  # {"name", "adapter_model_sha256"}


# ----- the manifest --------------------------------------------------------------------------------


def optimizer_record(config: SftConfig) -> dict:
    return {"learning_rate": config.learning_rate, **config.optimizer.model_dump(mode="json")}


def _file_entry(data: bytes) -> dict:
    return {"sha256": sha256_prefixed(data), "bytes": len(data)}


def manifest_digest(manifest: dict) -> str:
    """`bundle_digest`: SHA-256 of the canonical JSON of the manifest without `bundle_digest`."""
    body = {k: v for k, v in manifest.items() if k != "bundle_digest"}
    return json_sha256(body)


def _readme(name: str, manifest: dict) -> bytes:
    lock = parse_lock(runner_bytes(LOCK_FILE).decode("utf-8"))
    pins = " ".join(f"{p}=={lock[p]}" for p in ENFORCED_PINS if p in lock)
    return (
        f"# {name}{BUNDLE_SUFFIX}: a Kiln SFT export for TRL\n\n"
        f"{manifest['data']['rows_kept']} admitted row(s) x {manifest['schedule']['epochs']} epoch(s) = "
        f"{manifest['schedule']['total_steps']} optimizer step(s), LoRA r={manifest['lora']['rank']} "
        f"alpha={manifest['lora']['alpha']:g}, optimizer {manifest['optimizer']['kind']} at "
        f"lr {manifest['optimizer']['learning_rate']:g}, seed {manifest['seed']}.\n\n"
        "Run it with the pinned stack (a fresh virtual environment):\n\n"
        "    pip install -r requirements.lock\n"
        "    python train.py --model /path/to/the/base/model --output-dir trl-output\n\n"
        f"train.py checks every file of this bundle against {MANIFEST}, the installed versions "
        f"({pins}), the base model's config and weights against the recorded identities, and every "
        "row's token ids and supervised positions against Kiln's before the first step. It writes "
        "adapter_config.json, adapter_model.safetensors, step_losses.jsonl and kiln_hf_result.json "
        "into the output directory; `kiln train hf import-peft --bundle trl-output --name NAME` "
        "registers the adapter with the Kiln server that made this bundle.\n"
    ).encode()


def build_bundle(
    directory: Path,
    *,
    name: str,
    resident: ResidentFacts,
    config: SftConfig,
    ingestion: IngestionResult,
    sources: dict[int, object],
    initial: InitialAdapter,
    created_at: datetime | None = None,
) -> dict:
    """Write a complete bundle into the empty `directory`; return its manifest.

    `config` is the effective config (`SftConfig.resolve()`: seed and learning rate set);
    `sources` maps each kept row's index to its source object (the inline example or the decoded
    JSONL line); `initial` is the adapter both runs start from.
    """
    refuse_unsupported_optimizer(config.optimizer.kind)
    if config.seed is None or config.learning_rate is None:
        raise ValueError("build_bundle needs the effective config (SftConfig.resolve())")
    orders = step_orders(config.seed, config.epochs, len(ingestion.rows))
    files = _bundle_files(resident, config, ingestion, sources, orders, initial)
    _check_identity(files, resident)
    manifest: dict = {
        "schema": EXPORT_SCHEMA,
        "name": name,
        "created_at": (created_at or datetime.now(UTC)).isoformat().replace("+00:00", "Z"),
        "training_profile": TRAINING_PROFILE,
        "base_model": {**resident.base_model(), "config_file": CONFIG_FILE},
        "tokenizer": {**resident.tokenizer(), "file": TOKENIZER_FILE},
        "template": {**resident.template(), "file": TEMPLATE_FILE, "generation_blocks": True},
        "resident_runner": {
            "runner_id": resident.runner_id,
            "execution_identity_digest": resident.execution_identity_digest,
            "base_weight_dtype": resident.base_weight_dtype,
            "lora_dtype": resident.lora_dtype,
            "loss_route": resident.loss_route,
        },
        "lora": _lora_record(config, initial, files),
        "optimizer": optimizer_record(config),
        "seed": str(config.seed),
        "schedule": _schedule_record(config, len(ingestion.rows), orders),
        "data": _data_record(ingestion),
        "trl_runner": _runner_record(resident, files),
        "profile_fidelity": profile_fidelity(config, resident),
    }
    manifest["files"] = {}  # README.md is written from the manifest, then hashed with the rest
    files[README_FILE] = _readme(name, manifest)
    manifest["files"] = {rel: _file_entry(data) for rel, data in sorted(files.items())}
    manifest["bundle_digest"] = manifest_digest(manifest)
    (directory / INITIAL_ADAPTER_DIR).mkdir()
    for rel, data in files.items():
        write_new_file(directory / rel, data)
    write_new_file(directory / MANIFEST, (json.dumps(manifest, indent=2, ensure_ascii=False) + "\n").encode())
    return manifest


def _bundle_files(
    resident: ResidentFacts,
    config: SftConfig,
    ingestion: IngestionResult,
    sources: dict[int, object],
    orders: list[list[int]],
    initial: InitialAdapter,
) -> dict[str, bytes]:
    """Every file of the bundle but the README and the manifest, by path inside the bundle."""
    model_dir = Path(resident.model_dir)
    return {
        TRAIN_FILE: train_lines(
            ingestion, sources, orders, config.max_length if config.truncation == "right" else None
        ),
        RECEIPT_FILE: (json.dumps(ingestion.receipt, indent=2, ensure_ascii=False) + "\n").encode("utf-8"),
        TOKENIZER_FILE: (model_dir / TOKENIZER_FILE).read_bytes(),
        CONFIG_FILE: (model_dir / CONFIG_FILE).read_bytes(),
        TEMPLATE_FILE: TRAINING_TEMPLATE_FILE.read_bytes(),
        f"{INITIAL_ADAPTER_DIR}/{ADAPTER_MODEL}": safetensors_io.dump(initial.tensors, {"format": "pt"}),
        f"{INITIAL_ADAPTER_DIR}/{ADAPTER_CONFIG}": (
            json.dumps(adapter_config(config.lora_rank, config.lora_alpha), indent=2) + "\n"
        ).encode("utf-8"),
        RUNNER_FILE: runner_bytes(RUNNER_FILE),
        LOCK_FILE: runner_bytes(LOCK_FILE),
    }


def _lora_record(config: SftConfig, initial: InitialAdapter, files: dict[str, bytes]) -> dict:
    return {
        "rank": config.lora_rank,
        "alpha": config.lora_alpha,
        "scale": config.lora_alpha / config.lora_rank,
        "target_modules": list(LORA_TARGET_MODULES),
        "dropout": 0.0,
        "bias": "none",
        "initial_adapter": {
            "source": initial.source,
            "algorithm": LORA_INIT_ALGORITHM if initial.source == "seeded" else None,
            "seed": str(initial.seed),
            "input_adapter": initial.input_adapter,
            "dir": INITIAL_ADAPTER_DIR,
            "adapter_model_sha256": sha256_prefixed(files[f"{INITIAL_ADAPTER_DIR}/{ADAPTER_MODEL}"]),
        },
    }


def _schedule_record(config: SftConfig, n: int, orders: list[list[int]]) -> dict:
    return {
        "epochs": config.epochs,
        "rows_kept": n,
        "total_steps": config.epochs * n,
        "batch_size": 1,
        "gradient_accumulation_steps": 1,
        "learning_rate_schedule": "constant",
        "warmup_steps": 0,
        "max_grad_norm": None,
        "order_algorithm": EPOCH_ORDER_ALGORITHM,
        "epoch_orders": orders,
        "divergence_guard": {"ratio": DIVERGENCE_RATIO, "margin": DIVERGENCE_MARGIN},
    }


def _data_record(ingestion: IngestionResult) -> dict:
    receipt = ingestion.receipt
    return {
        "source": receipt["source"],
        "source_locator": receipt.get("source_locator"),
        "invalid_row_policy": receipt["invalid_row_policy"],
        "rows_read": receipt["rows_read"],
        "rows_kept": receipt["rows_kept"],
        "rows_rejected": receipt["rows_rejected"],
        "kept_corpus_sha256": receipt["kept_corpus_sha256"],
        "ingestion_receipt_sha256": json_sha256(receipt),
        "mask_contract": MASK_CONTRACT,
        "total_tokens": ingestion.total_tokens,
        "total_supervised_tokens": ingestion.total_supervised_tokens,
        "train_file": TRAIN_FILE,
        "receipt_file": RECEIPT_FILE,
    }


def _runner_record(resident: ResidentFacts, files: dict[str, bytes]) -> dict:
    lock = parse_lock(files[LOCK_FILE].decode("utf-8"))
    return {
        "script": RUNNER_FILE,
        "requirements": LOCK_FILE,
        "enforced_pins": {p: lock[p] for p in ENFORCED_PINS if p in lock},
        "dtype": "float32" if resident.base_weight_dtype == "f32" else "bfloat16",
        "command": "python train.py --model <base model directory> --output-dir trl-output",
    }


def _check_identity(files: dict[str, bytes], resident: ResidentFacts) -> None:
    """The copied files must be the ones the resident runner pinned (a model directory changed
    under a running worker would otherwise export another model's tokenizer or config)."""
    pairs = (
        (TOKENIZER_FILE, resident.identity["tokenizer_vocab_sha256"]),
        (CONFIG_FILE, resident.identity["model_config_sha256"]),
        (TEMPLATE_FILE, resident.identity["training_chat_template_sha256"]),
    )
    for rel, pinned in pairs:
        got = sha256_prefixed(files[rel])
        if got != pinned:
            raise InteropError(
                HF_EXPORT_UNSUPPORTED,
                f"{rel} in the resident model directory has digest {got} but the resident runner pinned "
                f"{pinned}; restart the worker on the model it serves before exporting",
            )


def publish_bundle(exports_dir: Path, name: str, build) -> Path:
    """Build a bundle in a hidden staging directory, then rename it to `<name>.kiln-hf` (never
    over an existing name). `build(directory)` writes the files. Nothing is left on failure."""
    exports_dir.mkdir(parents=True, exist_ok=True)
    target = exports_dir / bundle_dir_name(name)
    if target.exists():
        raise InteropError(HF_EXPORT_ALREADY_EXISTS, f"export {name!r} already exists")
    staging = exports_dir / f".{bundle_dir_name(name)}{STAGING_MARK}{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        build(staging)
        fsync_tree(staging)
        try:
            rename_no_replace(staging, target)
        except FileExistsError:
            raise InteropError(HF_EXPORT_ALREADY_EXISTS, f"export {name!r} already exists") from None
        fsync_dir(exports_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


# ----- reading a bundle back ----------------------------------------------------------------------


def read_manifest(bundle: Path) -> dict:
    return json.loads((bundle / MANIFEST).read_text(encoding="utf-8"))


def verify_bundle(bundle: Path) -> dict:
    """The manifest of a bundle whose files and digest are intact; ValueError naming the first
    file or field that is not (the runner makes the same checks before it trains)."""
    manifest = read_manifest(bundle)
    if manifest.get("schema") != EXPORT_SCHEMA:
        raise ValueError(f"{MANIFEST}: schema is {manifest.get('schema')!r}, not {EXPORT_SCHEMA}")
    for rel, entry in sorted(manifest["files"].items()):
        path = bundle / rel
        if not path.is_file():
            raise ValueError(f"{rel} is missing from the bundle")
        got = sha256_prefixed(path.read_bytes())
        if got != entry["sha256"]:
            raise ValueError(f"{rel} has sha256 {got}, the manifest records {entry['sha256']}")
    digest = manifest_digest(manifest)
    if digest != manifest.get("bundle_digest"):
        raise ValueError(
            f"{MANIFEST}: bundle_digest {manifest.get('bundle_digest')} does not recompute ({digest})"
        )
    return manifest
