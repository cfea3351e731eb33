"""Serializers: store rows in, contract JSON out (docs/ARCHITECTURE.md#job-states).

Seeds are decimal strings, times are Unix milliseconds or RFC 3339, `started_at` is the
original's human string ("12s ago").
"""

from __future__ import annotations

import errno
import os
import stat
from datetime import datetime
from pathlib import Path
from typing import Any

from api import schemas
from kiln.store import Adapter, Admission, Job, JobEvent, Runner, TrainingStep, ValidationEvaluation, states
from kiln_train.artifacts.adapter import ADAPTER_MANIFEST, TRAIN_RECEIPT
from kiln_train.checkpoint import CheckpointError, read_checkpoint_manifest
from kiln_train.ground import json_bounded
from kiln_train.plan import formulas as memory_formulas

LOSS_HISTORY_MAX = 1024
GIB = 1 << 30

# Response fields that copy a store column of the same name unchanged (the schema's field order
# decides the JSON's, not these tuples).
EVENT_COLUMNS = ("id", "job_id", "kind", "level", "message", "data")
RUNNER_COLUMNS = (
    "id",
    "state",
    "backend",
    "device",
    "loss_route",
    "base_weight_dtype",
    "model_path",
    "execution_identity_digest",
    "free_memory_bytes",
    "total_memory_bytes",
    "current_job_id",
)
ADAPTER_COLUMNS = (
    "name",
    "path",
    "job_id",
    "size_bytes",
    "safetensors_sha256",
    "rank",
    "alpha",
    "base_model_sha256",
)


def columns(row: object, names: tuple[str, ...]) -> dict[str, Any]:
    """The attributes `names` of `row`, by name."""
    return {name: getattr(row, name) for name in names}


def serving_profile() -> schemas.ServingProfile:
    """`serving_profile` of `/v1/config` and `/health` (docs/ARCHITECTURE.md#routes).

    Kiln serves no inference, so its one, built-in profile is the `maintenance` policy of the
    Rust implementation's serving profiles: inference disabled and training owning the device
    exclusively; nothing of it can be configured or overridden per request.
    """
    return schemas.ServingProfile(
        profile="maintenance",
        source="built_in",
        immutable_after_startup=True,
        request_overrides_allowed=False,
        effective_policy_source="built_in",
        effective_policy=schemas.ServingPolicy(
            inference_admission="disabled",
            training_gpu_ownership="exclusive",
            adapter_weight_transitions="disabled",
            dynamic_kv_resize="disabled",
            allocator_reclaim="disabled",
            live_graph_capture="disabled",
            vulkan_resident_prefill="disabled",
            exclusive_gpu_behavior="training_only",
        ),
    )


def checkpoint_boundary_policy() -> schemas.CheckpointBoundaryPolicy:
    return schemas.CheckpointBoundaryPolicy(**memory_formulas.checkpoint_boundary_policy())


def human_ago(then: datetime, now: datetime) -> str:
    seconds = max(0, int((now - then).total_seconds()))
    if seconds < 60:
        return f"{seconds}s ago"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {seconds}s ago"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes}m ago"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h ago"


def unix_ms(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp() * 1000)


def rfc3339(value: datetime) -> str:
    return value.isoformat().replace("+00:00", "Z")


def elapsed_secs(job: Job, now: datetime) -> float:
    if job.started_at is None:
        return 0.0
    return max(0.0, ((job.finished_at or now) - job.started_at).total_seconds())


def training_data(summary: dict | None) -> schemas.TrainingData | None:
    if summary is None:
        return None
    inline = summary["data_source"] == states.SOURCE_EXAMPLES
    return schemas.TrainingData(
        source="inline" if inline else "dataset_path",
        dataset_path=None if inline else summary["dataset_path"],
        admitted_corpus_sha256=summary["kept_corpus_sha256"],
        rows=summary.get("rows_kept", 0),
        rows_read=summary.get("rows_read"),
        rows_rejected=summary.get("rows_rejected"),
    )


def _thin(rows: list, limit: int) -> list:
    """At most `limit` of `rows`, evenly spaced, the last always kept."""
    if len(rows) <= limit:
        return rows
    stride = len(rows) / limit
    return [*(rows[int(i * stride)] for i in range(limit - 1)), rows[-1]]


# The ValidationSample fields a `validation_evaluations` row holds under the same names.
EVALUATION_FIELDS = ("global_step", "epoch", "loss", "token_accuracy", "supervised_tokens", "rows")


def validation_samples(job: Job, evaluations: list[ValidationEvaluation]) -> list[schemas.ValidationSample]:
    """The validation curve (thinned like the loss curve)."""
    return [
        schemas.ValidationSample(
            **{name: getattr(e, name) for name in EVALUATION_FIELDS},
            **_curve_position(job, e.global_step, e.evaluated_at),
        )
        for e in _thin(evaluations, LOSS_HISTORY_MAX)
    ]


def _curve_position(job: Job, global_step: int, at: datetime) -> dict[str, float]:
    """A curve sample's `progress` (its step of the job's steps) and `elapsed_secs` (from the
    job's start to `at`, the store's time of the sample)."""
    elapsed = 0.0 if job.started_at is None else max(0.0, (at - job.started_at).total_seconds())
    return {"progress": min(1.0, global_step / max(job.total_steps, 1)), "elapsed_secs": elapsed}


def _status_fields(
    job: Job,
    summary: dict | None,
    position: int | None,
    now: datetime,
    evaluations: list[ValidationEvaluation] | None = None,
) -> dict[str, Any]:
    if summary is not None:
        summary = {**summary, "rows_kept": job.rows_kept}
    error = job.error_message or (job.failure_reason if job.state == states.FAILED else None)
    return {
        "job_id": job.id,
        "state": job.state,
        "progress": job.progress,
        "current_loss": job.current_loss,
        "adapter_name": job.adapter_name,
        "effective_seed": job.effective_seed,
        "started_at": None if job.started_at is None else human_ago(job.started_at, now),
        "elapsed_secs": elapsed_secs(job, now),
        "submitted_unix_ms": unix_ms(job.submitted_at),
        "finished_unix_ms": unix_ms(job.finished_at),
        "job_type": job.job_type,
        "training_data": training_data(summary),
        "error": error,
        "failure_reason": job.failure_reason,
        "queue_position": position,
        "global_step": job.global_step,
        "total_steps": job.total_steps,
        "validation_history": validation_samples(job, evaluations or []),
        "model": None if summary is None else summary.get("model"),
    }


def training_status(
    job: Job,
    summary: dict | None,
    position: int | None,
    now: datetime,
    evaluations: list[ValidationEvaluation] | None = None,
) -> schemas.TrainingStatus:
    """`now` is the store's clock (`store_now`), the one that stamped the job's times;
    `evaluations` the job's validation curve (`kiln.store.validation_history`)."""
    return schemas.TrainingStatus(**_status_fields(job, summary, position, now, evaluations))


def training_response(job: Job, summary: dict, message: str) -> schemas.TrainingResponse:
    """The submit answer for a job (a fresh admission or an Idempotency-Key replay)."""
    return schemas.TrainingResponse(
        job_id=job.id,
        state=job.state,
        effective_seed=job.effective_seed,
        message=message,
        rows_kept=job.rows_kept,
        rows_rejected=summary.get("rows_rejected") or 0,
        total_steps=job.total_steps,
        grad_checkpoint_segments=summary["max_segments"],
        memory_estimate_gb=round(summary["memory_estimate_bytes"] / GIB, 4),
        model=summary.get("model"),
    )


def loss_samples(job: Job, steps: list[TrainingStep]) -> list[schemas.LossSample]:
    """The loss curve, thinned evenly to at most LOSS_HISTORY_MAX samples (the last always kept)."""
    return [
        schemas.LossSample(
            step=s.global_step,
            epoch=s.epoch,
            loss=s.loss,
            **_curve_position(job, s.global_step, s.created_at),
        )
        for s in _thin(steps, LOSS_HISTORY_MAX)
    ]


def checkpoint_summary(path: Path) -> tuple[schemas.TrainingCheckpointSummary | None, str | None]:
    """Manifest-only view of a checkpoint: status never re-hashes artifacts (docs/checkpoints.md#loading)."""
    try:
        manifest, _digest = read_checkpoint_manifest(path)
    except CheckpointError as exc:
        return None, exc.message
    except OSError as exc:
        return None, f"checkpoint {path.name!r}: {exc.strerror or exc}"
    progress = manifest.progress
    return (
        schemas.TrainingCheckpointSummary(
            resume_checkpoint=path.name,
            checkpoint_id=manifest.checkpoint_id,
            training_kind=manifest.training_kind,
            data_source_kind=manifest.data.source_kind,
            global_step=progress.global_step,
            total_steps=progress.total_steps,
            next_epoch_index=progress.epoch_index,
            next_cursor_in_epoch=progress.cursor_in_epoch,
            complete=progress.global_step >= progress.total_steps,
            created_at=manifest.created_at,
            effective_config=manifest.effective_config,
            data_content_sha256="sha256:" + manifest.data.content_sha256.removeprefix("sha256:"),
            data_item_count=manifest.data.item_count,
        ),
        None,
    )


def read_registry_file(path: Path) -> bytes | None:
    """The bytes of a regular file in the registry, or None when there is none; OSError when it
    is a symlink or not a regular file. Like the tar download, a registry read never follows a
    link out of the registry; O_NONBLOCK keeps a FIFO from blocking the request."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(exc.errno, "a symlink; registry files are read only as regular files") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def read_json_file(path: Path) -> tuple[dict | None, str | None]:
    """A JSON object from a registry file, or the reason it could not be read (absent is not an
    error)."""
    try:
        data = read_registry_file(path)
        if data is None:
            return None, None
        value = json_bounded.loads(data)
    except OSError as exc:
        return None, f"{path.name}: {exc.strerror or exc}"
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"{path.name}: {exc}"
    if not isinstance(value, dict):
        return None, f"{path.name}: not a JSON object"
    return value, None


def replay_request(admission: Admission) -> dict[str, Any]:
    """The request that re-runs this job exactly (effective config, same data transport)."""
    body: dict[str, Any] = {"config": admission.effective_config}
    if admission.data_source == states.SOURCE_EXAMPLES:
        body["examples"] = admission.examples
    else:
        body["dataset_path"] = admission.dataset_path
    if admission.validation is not None:
        body["validation"] = admission.validation
    return body


def job_detail(
    job: Job,
    admission: Admission | None,
    summary: dict | None,
    position: int | None,
    steps: list[TrainingStep],
    latest: Path | None,
    adapters_dir: Path,
    now: datetime,
    evaluations: list[ValidationEvaluation] | None = None,
) -> schemas.TrainingJobDetail:
    receipt, metadata_error = job.receipt, None
    if receipt is None and job.state == states.COMPLETED:
        receipt, metadata_error = read_json_file(adapters_dir / job.adapter_name / TRAIN_RECEIPT)
    checkpoint, checkpoint_error = (None, None) if latest is None else checkpoint_summary(latest)
    config = admission.effective_config if admission is not None else {}
    return schemas.TrainingJobDetail(
        **_status_fields(job, summary, position, now, evaluations),
        epoch=job.current_epoch,
        adapter_path=job.adapter_path,
        auto_load=bool(config.get("auto_load", True)),
        linked_eval_job_ids=[],
        loss_history=loss_samples(job, steps),
        train_receipt=receipt,
        replay_request=None if admission is None else replay_request(admission),
        latest_checkpoint=checkpoint,
        checkpoint_error=checkpoint_error,
        metadata_error=metadata_error,
    )


def event_out(event: JobEvent) -> schemas.JobEventOut:
    return schemas.JobEventOut(**columns(event, EVENT_COLUMNS), created_at=rfc3339(event.created_at))


def runner_summary(runner: Runner | None, now: datetime) -> schemas.RunnerSummary | None:
    if runner is None:
        return None
    return schemas.RunnerSummary(
        **columns(runner, RUNNER_COLUMNS),
        heartbeat_age_s=max(0.0, (now - runner.heartbeat_at).total_seconds()),
        model_random_init=(runner.model_config or {}).get("random_init"),
    )


def adapter_info(adapter: Adapter, checkpoints: list[str]) -> schemas.AdapterInfo:
    manifest, error = read_json_file(Path(adapter.path) / ADAPTER_MANIFEST)
    if manifest is None and error is None:
        error = f"{ADAPTER_MANIFEST} is missing"
    return schemas.AdapterInfo(
        **columns(adapter, ADAPTER_COLUMNS),
        created_at=rfc3339(adapter.created_at),
        adapter_manifest=manifest,
        adapter_manifest_error=error,
        checkpoints=checkpoints,
    )
