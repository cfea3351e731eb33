"""Exact training checkpoints (`.kiln-checkpoint`, docs/checkpoints.md): format, atomic publication,
strict loading, resume comparison, the SFT loop state and the epoch order. Torch-free.

The trainer writes with `sft_manifest_draft` + `publish_checkpoint`, reads with
`load_checkpoint`, and admits a resume with `compare_for_resume`; status uses
`discover_checkpoints`.
"""

from __future__ import annotations

from kiln_train.checkpoint.draft import (
    ManifestDraft,
    checkpoint_effective_config,
    sft_manifest_draft,
    sft_optimizer_record,
    sft_rng_states,
    sft_scheduler_record,
    sft_state_files,
)
from kiln_train.checkpoint.epoch_order import EPOCH_ORDER_ALGORITHM, epoch_order
from kiln_train.checkpoint.errors import CheckpointError
from kiln_train.checkpoint.load import (
    PEFT_MESSAGE,
    DiscoveredCheckpoint,
    LoadedCheckpoint,
    checkpoint_names,
    discover_checkpoints,
    load_checkpoint,
    read_checkpoint_manifest,
)
from kiln_train.checkpoint.loop_state import (
    GradNormStats,
    SftLoopState,
    check_loop_state_progress,
    parse_loop_state,
    validate_loop_state,
)
from kiln_train.checkpoint.manifest import (
    ADAPTER_FILE,
    BASE_ADAPTER_AUX_KEY,
    CHECKPOINT_PLAN_AUX_KEY,
    CHECKPOINT_PLAN_KEYS,
    CHECKPOINT_SUFFIX,
    LOOP_STATE_FILE,
    MANIFEST_FILENAME,
    OPTIMIZER_FILE,
    PLANNING_KERNEL_PATHS_KEY,
    SENTINEL_FILENAME,
    SFT_AUXILIARY_KEYS,
    SFT_LOOP_STATE_TYPE,
    SFT_PLANNING_SCHEMA,
    VALIDATION_AUX_KEY,
    VALIDATION_HISTORY_AUX_KEY,
    CheckpointManifest,
    checkpoint_dir_name,
    checkpoint_id_for,
    parse_manifest_bytes,
)
from kiln_train.checkpoint.publish import PublishedCheckpoint, publish_checkpoint
from kiln_train.checkpoint.resume_expectation import (
    ResumeExpectation,
    checkpoint_lineage,
    compare_for_resume,
    seed_for_resume,
    sft_resume_expectation,
    verify_queued_checkpoint,
    with_checkpoint_lineage,
)
from kiln_train.checkpoint.rules import validate_manifest

__all__ = [
    "ADAPTER_FILE",
    "BASE_ADAPTER_AUX_KEY",
    "CHECKPOINT_PLAN_AUX_KEY",
    "CHECKPOINT_PLAN_KEYS",
    "CHECKPOINT_SUFFIX",
    "EPOCH_ORDER_ALGORITHM",
    "LOOP_STATE_FILE",
    "MANIFEST_FILENAME",
    "OPTIMIZER_FILE",
    "PEFT_MESSAGE",
    "PLANNING_KERNEL_PATHS_KEY",
    "SENTINEL_FILENAME",
    "SFT_AUXILIARY_KEYS",
    "SFT_LOOP_STATE_TYPE",
    "SFT_PLANNING_SCHEMA",
    "VALIDATION_AUX_KEY",
    "VALIDATION_HISTORY_AUX_KEY",
    "CheckpointError",
    "CheckpointManifest",
    "DiscoveredCheckpoint",
    "GradNormStats",
    "LoadedCheckpoint",
    "ManifestDraft",
    "PublishedCheckpoint",
    "ResumeExpectation",
    "SftLoopState",
    "check_loop_state_progress",
    "checkpoint_lineage",
    "checkpoint_names",
    "checkpoint_dir_name",
    "checkpoint_effective_config",
    "checkpoint_id_for",
    "compare_for_resume",
    "discover_checkpoints",
    "epoch_order",
    "load_checkpoint",
    "parse_loop_state",
    "parse_manifest_bytes",
    "publish_checkpoint",
    "read_checkpoint_manifest",
    "seed_for_resume",
    "sft_manifest_draft",
    "sft_optimizer_record",
    "sft_resume_expectation",
    "sft_rng_states",
    "sft_scheduler_record",
    "sft_state_files",
    "validate_loop_state",
    "validate_manifest",
    "verify_queued_checkpoint",
    "with_checkpoint_lineage",
]
