"""What a writer supplies for a checkpoint manifest, and the SFT records derived from the config.

A `ManifestDraft` is the manifest minus what the publisher computes itself (`schema_version`,
`manifest_type`, `checkpoint_kind`, `checkpoint_id`, `files`: the writer computes `files` itself,
docs/checkpoints.md#manifest). `sft_manifest_draft` builds the SFT draft from the resolved
`SftConfig` so the optimizer, scheduler, RNG and state-file records always agree with it.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kiln_train.checkpoint.epoch_order import EPOCH_ORDER_ALGORITHM
from kiln_train.checkpoint.errors import CheckpointError
from kiln_train.checkpoint.manifest import (
    ADAPTER_FILE,
    CHECKPOINT_KIND,
    DATA_SOURCE_KIND,
    EPOCH_ORDER_STREAM,
    LOOP_STATE_FILE,
    LORA_INIT_ALGORITHM,
    LORA_INIT_STREAM,
    MANIFEST_TYPE,
    OPTIMIZER_FILE,
    SCHEDULER_KIND,
    SCHEMA_VERSION,
    CheckpointManifest,
    DataIdentity,
    FileRecord,
    OptimizerRecord,
    PrecisionPolicy,
    Progress,
    RngStates,
    SchedulerRecord,
    StateFiles,
    checkpoint_id_for,
    describe_model_error,
    strip_sha256_prefix,
)
from kiln_train.ground.digest import utc_now_rfc3339
from kiln_train.optim.kinds import keeps_state
from kiln_train.sft_config import TRAINING_PROFILE, SftConfig


@dataclass(frozen=True)
class ManifestDraft:
    """The manifest fields a writer owns; the publisher adds identity and `files`."""

    training_kind: str
    adapter_name: str
    effective_config: dict[str, Any]
    precision_policy: PrecisionPolicy
    progress: Progress
    data: DataIdentity
    rng_states: RngStates
    optimizer: OptimizerRecord
    scheduler: SchedulerRecord
    state_files: StateFiles
    auxiliary_state: dict[str, Any]
    created_at: str = field(default_factory=utc_now_rfc3339)

    @property
    def checkpoint_id(self) -> str:
        return checkpoint_id_for(self.progress.global_step)

    def to_manifest(self, files: dict[str, FileRecord]) -> CheckpointManifest:
        """The complete (shape-checked, not yet rule-checked) manifest with the computed `files`."""
        value = {
            "schema_version": SCHEMA_VERSION,
            "manifest_type": MANIFEST_TYPE,
            "checkpoint_kind": CHECKPOINT_KIND,
            "checkpoint_id": self.checkpoint_id,
            "training_kind": self.training_kind,
            "adapter_name": self.adapter_name,
            "created_at": self.created_at,
            "effective_config": self.effective_config,
            "precision_policy": self.precision_policy.model_dump(mode="json"),
            "progress": self.progress.model_dump(mode="json"),
            "data": self.data.model_dump(mode="json"),
            "rng_states": self.rng_states.model_dump(mode="json", by_alias=True),
            "optimizer": self.optimizer.model_dump(mode="json"),
            "scheduler": self.scheduler.model_dump(mode="json"),
            "state_files": self.state_files.model_dump(mode="json"),
            "auxiliary_state": self.auxiliary_state,
            "files": {path: record.model_dump(mode="json") for path, record in files.items()},
        }
        try:
            return CheckpointManifest.model_validate(value)
        except ValidationError as exc:
            raise CheckpointError(describe_model_error("checkpoint manifest draft", exc)) from None


def checkpoint_effective_config(config: SftConfig) -> dict[str, Any]:
    """`effective_config`: the resolved config's JSON minus `resume_checkpoint` (docs/checkpoints.md#manifest)."""
    if config.learning_rate is None or config.seed is None:
        raise CheckpointError("effective_config: learning_rate and seed must be resolved (SftConfig.resolve)")
    value = config.to_json()
    value.pop("resume_checkpoint", None)
    return value


def sft_optimizer_record(config: SftConfig, global_step: int) -> OptimizerRecord:
    """`optimizer`: kind, step, resolved hyperparameters, the state file when the optimizer keeps state."""
    return OptimizerRecord.model_validate(
        {
            "kind": config.optimizer.kind,
            "step": global_step,
            "hyperparameters": {
                "learning_rate": config.resolved_learning_rate(),
                "optimizer": config.optimizer.model_dump(mode="json"),
            },
            "state_file": OPTIMIZER_FILE if keeps_state(config.optimizer.kind) else None,
        }
    )


def sft_scheduler_record(config: SftConfig, global_step: int) -> SchedulerRecord:
    """`scheduler`: the fixed constant schedule of `native_online_lora_v1`."""
    return SchedulerRecord.model_validate(
        {
            "kind": SCHEDULER_KIND,
            "step": global_step,
            "state": {
                "training_profile": TRAINING_PROFILE,
                "learning_rate": config.resolved_learning_rate(),
                "microbatch_conversations": 1,
                "gradient_accumulation_steps": 1,
                "warmup_steps": 0,
                "gradient_clipping": "none",
            },
        }
    )


def sft_rng_states(seed: int, epoch_index: int) -> RngStates:
    """Both streams seeded with the effective seed; the shuffle stream sits at the epoch."""
    return RngStates.model_validate(
        {
            EPOCH_ORDER_STREAM: {"algorithm": EPOCH_ORDER_ALGORITHM, "seed": seed, "position": epoch_index},
            LORA_INIT_STREAM: {"algorithm": LORA_INIT_ALGORITHM, "seed": seed, "position": 0},
        }
    )


def sft_state_files(optimizer_kind: str) -> StateFiles:
    """The SFT layout: adapter, optimizer state (when the optimizer keeps any), loop state."""
    return StateFiles(
        adapter_parameters=ADAPTER_FILE,
        optimizer_state=OPTIMIZER_FILE if keeps_state(optimizer_kind) else None,
        loss_history=LOOP_STATE_FILE,
    )


def sft_manifest_draft(
    *,
    config: SftConfig,
    adapter_name: str,
    precision_policy: dict[str, Any],
    global_step: int,
    total_steps: int,
    epoch_index: int,
    cursor_in_epoch: int,
    data_order: list[int],
    content_sha256: str,
    item_count: int,
    auxiliary_state: dict[str, Any],
    created_at: str | None = None,
) -> ManifestDraft:
    """The SFT draft; `config` must be resolved, `content_sha256` may carry the `sha256:` prefix."""
    try:
        policy = PrecisionPolicy.model_validate(precision_policy)
        progress = Progress(
            global_step=global_step,
            total_steps=total_steps,
            epoch_index=epoch_index,
            cursor_in_epoch=cursor_in_epoch,
            data_order=list(data_order),
        )
        data = DataIdentity(
            source_kind=DATA_SOURCE_KIND,
            content_sha256=strip_sha256_prefix(content_sha256),
            item_count=item_count,
        )
    except ValidationError as exc:
        raise CheckpointError(describe_model_error("checkpoint manifest draft", exc)) from None
    effective = checkpoint_effective_config(config)
    extra = {} if created_at is None else {"created_at": created_at}
    return ManifestDraft(
        training_kind="sft",
        adapter_name=adapter_name,
        effective_config=effective,
        precision_policy=policy,
        progress=progress,
        data=data,
        rng_states=sft_rng_states(config.seed, epoch_index),
        optimizer=sft_optimizer_record(config, global_step),
        scheduler=sft_scheduler_record(config, global_step),
        state_files=sft_state_files(config.optimizer.kind),
        auxiliary_state=auxiliary_state,
        **extra,
    )
