"""Response bodies of the api as pydantic models (docs/ARCHITECTURE.md#job-states), shared by the
serializers that build them and by the OpenAPI document that describes them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TrainingState = Literal["queued", "running", "completed", "failed"]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(_Out):
    code: str = Field(description="Stable machine code, e.g. training_invalid_request.")
    message: str
    hint: str


class ErrorEnvelope(_Out):
    error: ErrorBody


class JobModel(_Out):
    path: str = Field(description="The base model directory of the runner admission priced the job against.")
    random_init: dict | None = Field(
        description="A random checkpoint Kiln drew (kiln demo, kiln up without a model): its preset and "
        "seed. Null for a real model. Training on random weights shows the mechanics only."
    )


class TrainingResponse(_Out):
    """`POST /v1/train/sft` (an Idempotency-Key replay answers the same job with its state now)."""

    job_id: str
    state: TrainingState
    effective_seed: str = Field(description="u64 seed as a decimal string.")
    message: str
    rows_kept: int
    rows_rejected: int
    total_steps: int
    grad_checkpoint_segments: int
    memory_estimate_gb: float
    model: JobModel | None = Field(default=None, description="The base model the job trains on.")


class TrainingData(_Out):
    source: Literal["inline", "dataset_path"]
    dataset_path: str | None
    admitted_corpus_sha256: str
    rows: int = Field(description="Rows kept (trained on).")
    rows_read: int | None
    rows_rejected: int | None


class ValidationSample(_Out):
    """One evaluation of the job's held-out validation rows (docs/validation.md)."""

    global_step: int = Field(
        description="Optimizer steps taken when evaluated; 0 is the baseline (the base model)."
    )
    epoch: int = Field(description="Epochs completed when evaluated.")
    progress: float
    loss: float = Field(
        description="Token-weighted mean next-token cross-entropy over the supervised targets."
    )
    token_accuracy: float = Field(
        description="Share of supervised targets whose arg-max prediction is the target."
    )
    supervised_tokens: int
    rows: int
    elapsed_secs: float


class TrainingStatus(_Out):
    job_id: str
    state: TrainingState
    progress: float
    current_loss: float | None
    adapter_name: str | None
    effective_seed: str
    started_at: str | None = Field(description='Human string such as "12s ago"; null before start.')
    elapsed_secs: float
    submitted_unix_ms: int
    finished_unix_ms: int | None
    job_type: Literal["sft"]
    training_data: TrainingData | None
    error: str | None
    failure_reason: str | None
    queue_position: int | None
    global_step: int
    total_steps: int
    validation_history: list[ValidationSample] = Field(
        description="Every evaluation of the held-out validation rows so far (at most 1024, evenly "
        "thinned, the last always kept); empty without validation."
    )
    model: JobModel | None = Field(default=None, description="The base model the job trains on.")


class LossSample(_Out):
    step: int
    epoch: int
    progress: float
    loss: float
    elapsed_secs: float


class TrainingCheckpointSummary(_Out):
    resume_checkpoint: str
    checkpoint_id: str
    training_kind: str
    data_source_kind: str
    global_step: int
    total_steps: int
    next_epoch_index: int
    next_cursor_in_epoch: int
    complete: bool
    created_at: str
    effective_config: dict[str, Any]
    data_content_sha256: str
    data_item_count: int


class TrainingJobDetail(TrainingStatus):
    epoch: int | None
    adapter_path: str | None
    auto_load: bool
    linked_eval_job_ids: list[str]
    loss_history: list[LossSample]
    train_receipt: dict[str, Any] | None
    replay_request: dict[str, Any] | None
    latest_checkpoint: TrainingCheckpointSummary | None
    checkpoint_error: str | None
    metadata_error: str | None


class JobEventOut(_Out):
    id: int
    job_id: str
    created_at: str
    kind: str
    level: str
    message: str
    data: dict[str, Any] | None


class EventPage(_Out):
    data: list[JobEventOut]
    has_more: bool
    first_id: int | None
    last_id: int | None


class QueuedEntry(_Out):
    job_id: str
    job_type: Literal["sft"]
    adapter_name: str
    position: int


class QueueResponse(_Out):
    running: TrainingStatus | None = Field(description="The oldest running job.")
    running_jobs: list[TrainingStatus] = Field(description="Every running job (one per worker).")
    queued: list[QueuedEntry]
    completed: list[TrainingStatus] = Field(description="Finished jobs, newest first.")


class CancelResponse(_Out):
    status: Literal["cancelled", "cancelling"]
    job_id: str
    message: str | None = None


class DeletedJob(_Out):
    job_id: str
    status: Literal["deleted"]
    removed_archive_file: bool


class AdapterInfo(_Out):
    name: str
    path: str
    job_id: str | None
    created_at: str
    size_bytes: int
    safetensors_sha256: str
    rank: int
    alpha: float
    base_model_sha256: str | None
    adapter_manifest: dict[str, Any] | None
    adapter_manifest_error: str | None
    checkpoints: list[str]


class AdapterList(_Out):
    adapters: list[AdapterInfo]


class DeletedAdapter(_Out):
    name: str
    status: Literal["deleted"]
    removed_checkpoints: list[str]


class RunnerSummary(_Out):
    id: str
    state: str
    backend: str
    device: str
    loss_route: str
    base_weight_dtype: str
    model_path: str
    execution_identity_digest: str
    heartbeat_age_s: float
    free_memory_bytes: int | None
    total_memory_bytes: int | None
    current_job_id: str | None
    model_random_init: dict | None = Field(
        default=None, description="The resident model is a random checkpoint Kiln drew: its preset and seed."
    )


class DatabaseHealth(_Out):
    ok: bool
    dialect: str


class CheckpointBoundaryPolicy(_Out):
    recompute_mode: Literal["segments"] = Field(
        description="Activations are recomputed per planned contiguous layer segment."
    )
    recompute_threshold_tokens: int | None
    anchor_stride: int | None
    cache_target_bytes: int | None


class ServingPolicy(_Out):
    inference_admission: str
    training_gpu_ownership: str
    adapter_weight_transitions: str
    dynamic_kv_resize: str
    allocator_reclaim: str
    live_graph_capture: str
    vulkan_resident_prefill: str
    exclusive_gpu_behavior: str


class ServingProfile(_Out):
    profile: Literal["maintenance"] = Field(
        description="Kiln serves no inference: training owns the device (the original's maintenance policy)."
    )
    source: Literal["built_in"]
    immutable_after_startup: bool
    request_overrides_allowed: bool
    effective_policy_source: Literal["built_in"]
    effective_policy: ServingPolicy


class HealthTraining(_Out):
    checkpoint_boundary_policy: CheckpointBoundaryPolicy
    native_training_supported: bool


class HealthResponse(_Out):
    status: Literal["ok"]
    database: DatabaseHealth
    runner: RunnerSummary | None
    execution_identity: str | None
    base_weight_identity: str | None
    queue_depth: int
    native_training_supported: bool
    serving_profile: ServingProfile
    training: HealthTraining


class RunnerLiveness(_Out):
    state: str
    heartbeat_age_s: float


class HealthLiveness(_Out):
    """`/health` without a valid token on a server with api tokens: liveness only (no runner id or
    host, model path, memory, current job or identities)."""

    status: Literal["ok"]
    database: DatabaseHealth
    runner: RunnerLiveness | None
    queue_depth: int
    native_training_supported: bool


class TrainingConfigOut(BaseModel):
    model_config = ConfigDict(extra="allow")
    optimizer_support: dict[str, Any] | None
    checkpoint_boundary_policy: CheckpointBoundaryPolicy
    native_training_supported: bool
    native_training_unavailable_reason: str | None


class ConfigResponse(_Out):
    server: dict[str, Any]
    database: dict[str, Any]
    queue: dict[str, Any]
    storage: dict[str, Any]
    model: dict[str, Any]
    training: TrainingConfigOut
    memory: dict[str, Any]
    runner: RunnerSummary | None
    serving_profile: ServingProfile


class CheckpointEntry(_Out):
    """One exact checkpoint directory in the registry (`GET /v1/checkpoints`)."""

    adapter_name: str
    resume_checkpoint: str = Field(description="What config.resume_checkpoint names.")
    global_step: int
    summary: TrainingCheckpointSummary | None
    error: str | None = Field(description="Why the manifest could not be read; null when it could.")


class CheckpointList(_Out):
    checkpoints: list[CheckpointEntry]
