"""What a checkpoint manifest must mean, beyond its shape (docs/checkpoints.md#manifest,
docs/checkpoints.md#bound-identities).

`validate_manifest` runs every rule that needs only the manifest: the manifest checks, the SFT
cross-bindings (seed, learning rate, optimizer, data arithmetic, the recomputed epoch order) and
the resumability gates of docs/checkpoints.md#resume (round-to-nearest only, the v4 planning
identity, the full SFT auxiliary state). The writer runs it before publishing, the loader after parsing, status
discovery on its own. Each failure is a `CheckpointError` naming the field.
"""

from __future__ import annotations

import math
import posixpath
import re
from typing import Any

from pydantic import ValidationError

from kiln_train.artifacts.provenance import shard_aggregate, verify_provenance_digest
from kiln_train.checkpoint.epoch_order import epoch_order
from kiln_train.checkpoint.errors import CheckpointError
from kiln_train.checkpoint.manifest import (
    BASE_ADAPTER_AUX_KEY,
    BASE_ADAPTER_IDENTITY_KEYS,
    CHECKPOINT_PLAN_AUX_KEY,
    CHECKPOINT_PLAN_KEYS,
    MAX_FILES,
    MAX_RELPATH_BYTES,
    PLANNING_KERNEL_PATHS_KEY,
    RESERVED_NAMES,
    ROUND_TO_NEAREST,
    SFT_AUXILIARY_KEYS,
    SFT_LOOP_STATE_TYPE,
    SFT_PLANNING_SCHEMA,
    STATE_FILE_ROLES,
    VALIDATION_AUX_KEY,
    VALIDATION_EVALUATION_KEYS,
    VALIDATION_HISTORY_AUX_KEY,
    VALIDATION_IDENTITY_KEYS,
    CheckpointManifest,
    check_identifier,
    checkpoint_id_for,
)
from kiln_train.ground.backend import SFT_LOSS_ROUTES
from kiln_train.kernels.paths import check_kernel_paths
from kiln_train.optim.kinds import keeps_state
from kiln_train.sft_config import SftConfig, describe_validation_error


def check_relpath(field: str, path: str) -> None:
    """A `files` key: relative, normalised, `/`-separated, <= 1024 bytes, not a reserved name."""
    problem = None
    if not path:
        problem = "is empty"
    elif len(path.encode("utf-8")) > MAX_RELPATH_BYTES:
        problem = f"exceeds {MAX_RELPATH_BYTES} bytes"
    elif "\\" in path or "\0" in path:
        problem = "contains a backslash or NUL"
    elif path.startswith("/"):
        problem = "is absolute"
    elif posixpath.normpath(path) != path or any(part in ("", ".", "..") for part in path.split("/")):
        problem = "is not a normalised relative path"
    elif path in RESERVED_NAMES or posixpath.basename(path) in RESERVED_NAMES:
        problem = "is a reserved name"
    if problem:
        raise CheckpointError(f"{field}: path {path!r} {problem}")


def _check_progress(m: CheckpointManifest) -> None:
    p, item_count = m.progress, m.data.item_count
    if p.global_step > p.total_steps:
        raise CheckpointError(
            f"progress.global_step: {p.global_step} exceeds progress.total_steps {p.total_steps}"
        )
    if p.cursor_in_epoch > len(p.data_order):
        raise CheckpointError(
            f"progress.cursor_in_epoch: {p.cursor_in_epoch} exceeds len(progress.data_order) {len(p.data_order)}"
        )
    if p.global_step < p.total_steps and not p.data_order:
        raise CheckpointError("progress.data_order: empty while the run is unfinished")
    if p.data_order:
        if len(p.data_order) != item_count:
            raise CheckpointError(
                f"progress.data_order: has {len(p.data_order)} entries, data.item_count is {item_count}"
            )
        if sorted(p.data_order) != list(range(item_count)):
            raise CheckpointError(
                f"progress.data_order: not a permutation of 0..{item_count - 1} (entries must be unique and "
                f"< data.item_count)"
            )
    for name, step in (("optimizer.step", m.optimizer.step), ("scheduler.step", m.scheduler.step)):
        if step != p.global_step:
            raise CheckpointError(f"{name}: {step} differs from progress.global_step {p.global_step}")


def _check_files(m: CheckpointManifest) -> None:
    if not 1 <= len(m.files) <= MAX_FILES:
        raise CheckpointError(f"files: {len(m.files)} entries; a checkpoint holds 1..={MAX_FILES} files")
    for path in m.files:
        check_relpath(f"files[{path!r}]", path)
    for member, path in m.state_files.present().items():
        check_relpath(f"state_files.{member}", path)
        record = m.files.get(path)
        if record is None:
            raise CheckpointError(f"state_files.{member}: {path!r} is not listed in files")
        if record.role != STATE_FILE_ROLES[member]:
            raise CheckpointError(
                f"files[{path!r}].role: {record.role!r}, but state_files.{member} requires "
                f"{STATE_FILE_ROLES[member]!r}"
            )
    if (m.optimizer.state_file is None) != (m.state_files.optimizer_state is None):
        raise CheckpointError(
            "optimizer.state_file: must be present exactly when state_files.optimizer_state is present"
        )
    if m.optimizer.state_file is not None and m.optimizer.state_file != m.state_files.optimizer_state:
        raise CheckpointError(
            f"optimizer.state_file: {m.optimizer.state_file!r} differs from state_files.optimizer_state "
            f"{m.state_files.optimizer_state!r}"
        )


def _effective_sft_config(m: CheckpointManifest) -> SftConfig:
    cfg = m.effective_config
    if "resume_checkpoint" in cfg:
        raise CheckpointError("effective_config.resume_checkpoint: must not be recorded in a checkpoint")
    try:
        config = SftConfig.model_validate(cfg)
    except ValidationError as exc:
        raise CheckpointError(f"effective_config: {describe_validation_error(exc)}") from None
    if config.learning_rate is None:
        raise CheckpointError("effective_config.learning_rate: must be the resolved learning rate, not null")
    if config.seed is None:
        raise CheckpointError("effective_config.seed: must be the effective seed, not null")
    return config


def _check_sft_bindings(m: CheckpointManifest) -> None:
    config = _effective_sft_config(m)
    p, d, opt = m.progress, m.data, m.optimizer
    if m.checkpoint_id != checkpoint_id_for(p.global_step):
        raise CheckpointError(
            f"checkpoint_id: {m.checkpoint_id!r} is not {checkpoint_id_for(p.global_step)!r} for global step "
            f"{p.global_step}"
        )
    lr = config.learning_rate
    if opt.hyperparameters.learning_rate != lr:
        raise CheckpointError(
            f"optimizer.hyperparameters.learning_rate: {opt.hyperparameters.learning_rate!r} differs from "
            f"effective_config.learning_rate {lr!r}"
        )
    if m.scheduler.state.learning_rate != lr:
        raise CheckpointError(
            f"scheduler.state.learning_rate: {m.scheduler.state.learning_rate!r} differs from "
            f"effective_config.learning_rate {lr!r}"
        )
    if opt.kind != config.optimizer.kind or opt.hyperparameters.optimizer != config.optimizer:
        raise CheckpointError("optimizer.hyperparameters.optimizer: differs from effective_config.optimizer")
    if opt.hyperparameters.optimizer.kind != opt.kind:
        raise CheckpointError(
            f"optimizer.kind: {opt.kind!r} differs from optimizer.hyperparameters.optimizer.kind "
            f"{opt.hyperparameters.optimizer.kind!r}"
        )
    if keeps_state(opt.kind) != (m.state_files.optimizer_state is not None):
        raise CheckpointError(
            f"state_files.optimizer_state: {opt.kind} {'requires an' if keeps_state(opt.kind) else 'has no'} "
            "optimizer state file"
        )
    if m.state_files.loss_history is None:
        raise CheckpointError("state_files.loss_history: an SFT checkpoint must carry its loop state")
    for name, stream in (("epoch-order", m.rng_states.epoch_order), ("lora-init", m.rng_states.lora_init)):
        if stream.seed != config.seed:
            raise CheckpointError(
                f"rng_states.{name}.seed: {stream.seed} differs from effective_config.seed {config.seed}"
            )
    if m.rng_states.epoch_order.position != p.epoch_index:
        raise CheckpointError(
            f"rng_states.epoch-order.position: {m.rng_states.epoch_order.position} differs from "
            f"progress.epoch_index {p.epoch_index}"
        )
    if m.rng_states.lora_init.position != 0:
        raise CheckpointError(f"rng_states.lora-init.position: {m.rng_states.lora_init.position}, expected 0")
    # One conversation per optimizer step: the step count is fixed by epochs and kept rows.
    if p.total_steps != config.epochs * d.item_count:
        raise CheckpointError(
            f"progress.total_steps: {p.total_steps} is not effective_config.epochs {config.epochs} x "
            f"data.item_count {d.item_count}"
        )
    if p.epoch_index * d.item_count + p.cursor_in_epoch != p.global_step:
        raise CheckpointError(
            f"progress.global_step: {p.global_step} is not epoch_index {p.epoch_index} x item_count "
            f"{d.item_count} + cursor_in_epoch {p.cursor_in_epoch}"
        )
    if p.data_order and p.data_order != epoch_order(config.seed, p.epoch_index, d.item_count):
        raise CheckpointError(
            f"progress.data_order: differs from the seeded order for epoch {p.epoch_index} "
            f"(kiln-py.epoch-order.v1, seed {config.seed})"
        )


def _check_sft_resumable(m: CheckpointManifest) -> None:
    rounding = m.precision_policy.stochastic_rounding
    if rounding != {"mode": ROUND_TO_NEAREST}:
        raise CheckpointError(
            f"precision_policy.stochastic_rounding: the checkpoint records {rounding!r}; product training is "
            "round-to-nearest only, so a legacy stochastic-rounding checkpoint is not resumable"
        )
    aux = m.auxiliary_state
    missing = [key for key in SFT_AUXILIARY_KEYS if key not in aux]
    if missing:
        raise CheckpointError(
            f"auxiliary_state.{missing[0]}: required for an SFT checkpoint (missing: {', '.join(missing)}); "
            "legacy checkpoints are not resumable"
        )
    if aux["loop_state_type"] != SFT_LOOP_STATE_TYPE:
        raise CheckpointError(
            f"auxiliary_state.loop_state_type: {aux['loop_state_type']!r} is not {SFT_LOOP_STATE_TYPE!r}"
        )
    _check_planning_identity(aux["training_runtime_planning_identity"])
    shards = aux["base_weight_shard_manifest"]
    if not isinstance(shards, dict) or not isinstance(shards.get("aggregate_sha256"), str):
        raise CheckpointError(
            "auxiliary_state.base_weight_shard_manifest: must be a kiln.base-weight-shards.v1 object with "
            "aggregate_sha256"
        )
    if aux["base_model_weights_sha256"] != shards["aggregate_sha256"]:
        raise CheckpointError(
            f"auxiliary_state.base_model_weights_sha256: {aux['base_model_weights_sha256']!r} differs from "
            f"base_weight_shard_manifest.aggregate_sha256 {shards['aggregate_sha256']!r}"
        )
    try:
        recomputed = shard_aggregate(shards["shards"])
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CheckpointError(
            "auxiliary_state.base_weight_shard_manifest.shards: must list {filename, size_bytes, sha256} records"
        ) from None
    if recomputed != shards["aggregate_sha256"]:
        raise CheckpointError(
            f"auxiliary_state.base_weight_shard_manifest.aggregate_sha256: {shards['aggregate_sha256']!r} is not "
            f"the kiln.base-model-content.v1 aggregate of its shards {recomputed!r}"
        )
    provenance = aux["execution_provenance"]
    if not isinstance(provenance, dict) or not _non_empty_str(provenance.get("provenance_sha256")):
        raise CheckpointError(
            "auxiliary_state.execution_provenance: must be a full execution-provenance object with "
            "provenance_sha256"
        )
    if not verify_provenance_digest(provenance):
        raise CheckpointError(
            "auxiliary_state.execution_provenance.provenance_sha256: does not cover the recorded provenance"
        )
    if aux["training_precision_policy"] != m.precision_policy.model_dump(mode="json"):
        raise CheckpointError("auxiliary_state.training_precision_policy: differs from precision_policy")
    for key in (
        "model_config_sha256",
        "tokenizer_config_sha256",
        "chat_template_sha256",
        "training_chat_template_sha256",
        "kiln_train_version",
        "gradient_checkpoint_plan_sha256",
        "ingestion_receipt_sha256",
        "valid_indices_sha256",
    ):
        if not _non_empty_str(aux[key]):
            raise CheckpointError(f"auxiliary_state.{key}: must be a non-empty string")
    _check_base_adapter_lineage(m)
    _check_recorded_plan(m)
    _check_validation(m)


def checkpoint_plan_problem(plan: object, grad_checkpoint_segments: object) -> str | None:
    """Why `plan` is not a valid `auxiliary_state.gradient_checkpoint_plan` of a run whose
    effective config says `grad_checkpoint_segments` (None when it is valid)."""
    if not isinstance(plan, dict) or set(plan) != set(CHECKPOINT_PLAN_KEYS):
        return f"must be an object with exactly {', '.join(CHECKPOINT_PLAN_KEYS)}"
    segments, auto, budget = plan["max_segments"], plan["auto"], plan["budget_bytes"]
    if not isinstance(segments, int) or isinstance(segments, bool) or segments < 1:
        return f"max_segments: {segments!r} is not an integer >= 1"
    if not isinstance(auto, bool):
        return f"auto: {auto!r} is not a boolean"
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        return f"budget_bytes: {budget!r} is not null or an integer >= 0"
    if not auto and budget is not None:
        return "budget_bytes: a fixed plan's rows do not depend on a budget; it records null"
    if segments != (grad_checkpoint_segments or 1):
        return (
            f"max_segments: {segments} differs from effective_config.grad_checkpoint_segments "
            f"{grad_checkpoint_segments!r}"
        )
    return None


def _check_recorded_plan(m: CheckpointManifest) -> None:
    if CHECKPOINT_PLAN_AUX_KEY not in m.auxiliary_state:
        return
    problem = checkpoint_plan_problem(
        m.auxiliary_state[CHECKPOINT_PLAN_AUX_KEY], m.effective_config.get("grad_checkpoint_segments")
    )
    if problem is not None:
        raise CheckpointError(f"auxiliary_state.{CHECKPOINT_PLAN_AUX_KEY}: {problem}")


_SHA256_RE = re.compile(r"sha256:[0-9a-f]{64}")


def _count(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _check_validation(m: CheckpointManifest) -> None:
    """`auxiliary_state.validation` (the held-out corpus and schedule) and
    `auxiliary_state.validation_history` (the evaluations up to this step): both or neither."""
    aux = m.auxiliary_state
    identity, history = aux.get(VALIDATION_AUX_KEY), aux.get(VALIDATION_HISTORY_AUX_KEY)
    field, hfield = f"auxiliary_state.{VALIDATION_AUX_KEY}", f"auxiliary_state.{VALIDATION_HISTORY_AUX_KEY}"
    if (VALIDATION_AUX_KEY in aux) != (VALIDATION_HISTORY_AUX_KEY in aux):
        raise CheckpointError(f"{field} and {hfield}: a run with validation records both, any other neither")
    if VALIDATION_AUX_KEY not in aux:
        return
    if not isinstance(identity, dict) or set(identity) != set(VALIDATION_IDENTITY_KEYS):
        raise CheckpointError(
            f"{field}: must be an object with exactly {', '.join(VALIDATION_IDENTITY_KEYS)}"
        )
    if identity["schema"] != "kiln.sft-validation.v1":
        raise CheckpointError(f"{field}.schema: {identity['schema']!r} is not 'kiln.sft-validation.v1'")
    if identity["source"] not in ("inline", "dataset_path", "holdout"):
        raise CheckpointError(
            f"{field}.source: {identity['source']!r} is not inline, dataset_path or holdout"
        )
    for key in ("rows", "supervised_tokens"):
        if not _count(identity[key], 1):
            raise CheckpointError(f"{field}.{key}: {identity[key]!r} is not an integer >= 1")
    if not isinstance(identity["corpus_sha256"], str) or not _SHA256_RE.fullmatch(identity["corpus_sha256"]):
        raise CheckpointError(
            f"{field}.corpus_sha256: {identity['corpus_sha256']!r} is not sha256:<64 lowercase hex>"
        )
    if identity["interval_steps"] is not None and not _count(identity["interval_steps"], 1):
        raise CheckpointError(
            f"{field}.interval_steps: {identity['interval_steps']!r} is not null or an integer >= 1"
        )
    if not isinstance(history, list):
        raise CheckpointError(f"{hfield}: must be a list of evaluations")
    previous = -1
    for i, entry in enumerate(history):
        where = f"{hfield}[{i}]"
        if not isinstance(entry, dict) or set(entry) != set(VALIDATION_EVALUATION_KEYS):
            raise CheckpointError(
                f"{where}: must be an object with exactly {', '.join(VALIDATION_EVALUATION_KEYS)}"
            )
        step, epoch, loss, accuracy = (entry[k] for k in VALIDATION_EVALUATION_KEYS)
        if not _count(step, 0) or step <= previous or step > m.progress.global_step:
            raise CheckpointError(
                f"{where}.global_step: {step!r} is not an integer above the previous evaluation's and at most "
                f"progress.global_step {m.progress.global_step}"
            )
        if not _count(epoch, 0) or epoch > m.progress.epoch_index:
            raise CheckpointError(
                f"{where}.epoch: {epoch!r} is not an integer in 0..=progress.epoch_index {m.progress.epoch_index}"
            )
        if isinstance(loss, bool) or not isinstance(loss, int | float) or not math.isfinite(loss) or loss < 0:
            raise CheckpointError(f"{where}.loss: {loss!r} is not a finite non-negative number")
        if isinstance(accuracy, bool) or not isinstance(accuracy, int | float) or not 0 <= accuracy <= 1:
            raise CheckpointError(f"{where}.token_accuracy: {accuracy!r} is not a number in [0, 1]")
        previous = step


def _check_base_adapter_lineage(m: CheckpointManifest) -> None:
    """`auxiliary_state.base_adapter` is the identity of `effective_config.base_adapter`: present
    only for a warm-started run, and then naming that adapter's directory."""
    field = f"auxiliary_state.{BASE_ADAPTER_AUX_KEY}"
    name = m.effective_config.get("base_adapter")
    identity = m.auxiliary_state.get(BASE_ADAPTER_AUX_KEY)
    if identity is None:
        if BASE_ADAPTER_AUX_KEY in m.auxiliary_state:
            raise CheckpointError(f"{field}: null; omit it when the run did not start from a base adapter")
        if name is not None:
            raise CheckpointError(
                f"effective_config.base_adapter: {name!r}, but the checkpoint records no {field} identity "
                "of the adapter the run started from"
            )
        return
    if name is None:
        raise CheckpointError(
            f"{field}: present, but effective_config.base_adapter is null (the run did not warm-start)"
        )
    if not isinstance(identity, dict) or set(identity) != set(BASE_ADAPTER_IDENTITY_KEYS):
        raise CheckpointError(
            f"{field}: must be an object with exactly {', '.join(BASE_ADAPTER_IDENTITY_KEYS)}"
        )
    path = identity["path"]
    if not _non_empty_str(path) or posixpath.basename(path.rstrip("/")) != name:
        raise CheckpointError(
            f"{field}.path: {path!r} is not the directory of effective_config.base_adapter {name!r}"
        )
    digest = identity["adapter_model_sha256"]
    if not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
        raise CheckpointError(f"{field}.adapter_model_sha256: {digest!r} is not sha256:<64 lowercase hex>")
    size = identity["adapter_model_bytes"]
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise CheckpointError(f"{field}.adapter_model_bytes: {size!r} is not a positive byte count")


def _check_planning_identity(identity: Any) -> None:
    field = "auxiliary_state.training_runtime_planning_identity"
    if not isinstance(identity, dict):
        raise CheckpointError(f"{field}: must be an object")
    schema = identity.get("schema")
    if schema != SFT_PLANNING_SCHEMA:
        raise CheckpointError(
            f"{field}.schema: {schema!r} is not the SFT planning identity {SFT_PLANNING_SCHEMA!r}; a checkpoint "
            "planned under another schema is planning drift and not resumable"
        )
    route = identity.get("sft_loss_route")
    if route not in SFT_LOSS_ROUTES:
        raise CheckpointError(f"{field}.sft_loss_route: {route!r} is not one of {', '.join(SFT_LOSS_ROUTES)}")
    if PLANNING_KERNEL_PATHS_KEY in identity:
        try:
            check_kernel_paths(identity[PLANNING_KERNEL_PATHS_KEY])
        except ValueError as exc:
            raise CheckpointError(f"{field}.{PLANNING_KERNEL_PATHS_KEY}: {exc}") from None


def _non_empty_str(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def validate_manifest(m: CheckpointManifest) -> None:
    """Every manifest-only rule (docs/checkpoints.md#manifest, #bound-identities, #resume), in
    order; raises `CheckpointError`."""
    check_identifier("adapter_name", m.adapter_name)
    check_identifier("checkpoint_id", m.checkpoint_id)
    if m.training_kind != "sft":
        raise CheckpointError(
            f"training_kind: {m.training_kind!r} checkpoints cannot be read by this SFT trainer"
        )
    _check_progress(m)
    _check_files(m)
    _check_sft_bindings(m)
    _check_sft_resumable(m)
