"""Re-verification at dequeue (docs/ARCHITECTURE.md#pinning).

After any queue wait, and before any memory reservation or model work, the worker compares every
fact admission pinned with what it actually holds: the loss route, the optimizer tuple, the
execution identity, the seed, the resume checkpoint and the data (re-ingested; the receipt must
be identical). Any difference fails the job with `plan_drift`; the worker never runs "close
enough".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from kiln import store
from kiln.settings import Settings
from kiln_train import checkpoint as ckpt
from kiln_train.checkpoint.resume_expectation import first_difference
from kiln_train.data.ingestion import IngestionResult, LengthRule
from kiln_train.data.row_source import EXAMPLES, row_source
from kiln_train.data.validation import ValidationSet, prepare_validation
from kiln_train.errors import KilnError
from kiln_train.ground.digest import json_sha256
from kiln_train.plan.optimizer_support import check_optimizer_tuple
from kiln_train.sft_config import SftConfig, ValidationSpec, parse_sft_config
from kiln_train.train.resident import ResidentModel

PLAN_DRIFT = "plan_drift"
PLAN_DRIFT_CODE = "training_plan_drift"


class PlanDrift(Exception):
    """A pinned admission fact no longer holds; the job fails before any GPU work."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class PinnedJob:
    """Plain copies of the job and admission columns the worker needs (no ORM objects)."""

    job_id: str
    attempt: int  # the claim number (`attempts` after this claim): the run's fence
    adapter_name: str
    effective_seed: str
    resume_checkpoint: str | None
    loss_route: str
    execution_identity_digest: str
    effective_config: dict
    checkpoint_plan: dict
    ingestion_receipt_sha256: str
    kept_corpus_sha256: str
    data_source: str
    examples: list | None
    dataset_path: str | None
    memory_estimate_bytes: int
    recorded_checkpoints: dict  # basename -> manifest sha256 (from the job's checkpoints rows)
    total_steps: int = 0
    validation: dict | None = None  # the request's `validation` as admitted (docs/validation.md)
    requested_config: dict | None = None  # the request's `config` as sent (None: admitted before it was kept)


# PinnedJob fields copied unchanged from the job row and from its admission row.
PINNED_JOB_COLUMNS = ("adapter_name", "effective_seed", "resume_checkpoint")
PINNED_ADMISSION_COLUMNS = (
    "loss_route",
    "execution_identity_digest",
    "ingestion_receipt_sha256",
    "kept_corpus_sha256",
    "data_source",
    "examples",
    "dataset_path",
    "validation",
    "requested_config",
)


def pin_job(s: Session, job) -> PinnedJob:
    """The claimed job's row and its admission, copied into a PinnedJob."""
    adm = store.get_admission(s, job.id)
    recorded = {c.basename: c.manifest_sha256 for c in store.list_checkpoints(s, job.id)}
    return PinnedJob(
        job_id=job.id,
        attempt=job.attempts,
        **{name: getattr(job, name) for name in PINNED_JOB_COLUMNS},
        **{name: getattr(adm, name) for name in PINNED_ADMISSION_COLUMNS},
        effective_config=dict(adm.effective_config),
        checkpoint_plan=dict(adm.checkpoint_plan),
        memory_estimate_bytes=int(adm.memory_estimate_bytes),
        recorded_checkpoints=recorded,
        total_steps=int(job.total_steps or 0),
    )


@dataclass(frozen=True)
class VerifiedWork:
    config: SftConfig
    ingestion: IngestionResult
    resume_path: Path | None
    checkpoint_plan: dict
    validation: ValidationSet | None = None


def verify_plan(pinned: PinnedJob, resident: ResidentModel, settings: Settings) -> VerifiedWork:
    """Every pinned fact, in the contract's order; raises PlanDrift naming the field."""
    backend = resident.backend
    if pinned.loss_route != backend.sft_loss_route:
        raise PlanDrift(
            "loss_route",
            f"admission pinned {pinned.loss_route!r} but the resident backend executes "
            f"{backend.sft_loss_route!r}",
        )
    if pinned.execution_identity_digest != resident.execution_identity_digest:
        raise PlanDrift(
            "execution_identity",
            f"admission pinned {pinned.execution_identity_digest} but this runner is "
            f"{resident.execution_identity_digest} (model, code, runtime or configuration changed)",
        )
    try:
        config = parse_sft_config(pinned.effective_config)
    except KilnError as exc:
        raise PlanDrift("effective_config", exc.message) from None
    try:
        check_optimizer_tuple(backend, resident.config, config.optimizer.kind, config.lora_rank)
    except KilnError as exc:
        raise PlanDrift("optimizer_tuple", exc.message) from None
    if config.seed is None or str(config.seed) != pinned.effective_seed:
        raise PlanDrift(
            "seed", f"effective config seed {config.seed} differs from the job's {pinned.effective_seed}"
        )
    if config.learning_rate is None:
        raise PlanDrift("learning_rate", "the pinned effective config has no resolved learning rate")
    resume, manifest = _verify_resume(pinned, config, settings)
    if manifest is not None:
        _verify_resume_kernel_paths(manifest, resident)
    ingestion, validation = _reingest(pinned, resident, settings, config)
    if manifest is not None:
        _verify_resume_validation(manifest, validation)
    return VerifiedWork(config, ingestion, resume, dict(pinned.checkpoint_plan), validation)


def _verify_resume_kernel_paths(manifest: ckpt.CheckpointManifest, resident: ResidentModel) -> None:
    """A resume continues on the kernel paths its checkpoint trained with (docs/kernels.md#checkpoints):
    another GDN path or kernel set computes other bits, so it is planning drift."""
    identity = manifest.auxiliary_state.get("training_runtime_planning_identity")
    recorded = identity.get(ckpt.PLANNING_KERNEL_PATHS_KEY) if isinstance(identity, dict) else None
    found = first_difference("kernel_paths", recorded, resident.kernel_paths.to_dict())
    if found is not None:
        where, theirs, ours = found
        raise PlanDrift(
            "kernel_paths",
            f"the checkpoint trained with {where} = {theirs!r} but this runner executes {ours!r}; "
            "a resume under another GDN path or kernel set is planning drift",
        )


def _verify_resume_validation(manifest: ckpt.CheckpointManifest, validation: ValidationSet | None) -> None:
    """The checkpoint's held-out validation corpus and schedule must be this job's (a resume
    continues its evaluation history only over the same rows)."""
    recorded = manifest.auxiliary_state.get(ckpt.VALIDATION_AUX_KEY)
    ours = validation.identity() if validation is not None else None
    if recorded != ours:
        raise PlanDrift(
            "resume_checkpoint",
            f"the checkpoint records validation {recorded!r} but the job evaluates {ours!r}; a resume "
            "continues the evaluation history only over the same validation corpus and schedule",
        )


def _verify_resume(
    pinned: PinnedJob, config: SftConfig, settings: Settings
) -> tuple[Path | None, ckpt.CheckpointManifest | None]:
    name = pinned.resume_checkpoint
    if name is None:
        return None, None
    path = settings.adapters_dir / name
    try:
        loaded = ckpt.load_checkpoint(path, verify_hashes=True)
    except KilnError as exc:
        raise PlanDrift("resume_checkpoint", exc.message) from None
    pin = pinned.checkpoint_plan.get("resume_from")
    try:
        if pin is not None and pin.get("checkpoint") == name:
            ckpt.verify_queued_checkpoint(
                loaded,
                checkpoint_id=pin["checkpoint_id"],
                manifest_sha256=pin["manifest_sha256"],
                seed=config.seed,
            )
        else:  # a reconciler resume: the checkpoint must be one this job recorded
            recorded = pinned.recorded_checkpoints.get(name)
            if recorded is None or recorded.removeprefix("sha256:") != loaded.manifest_sha256:
                raise PlanDrift(
                    "resume_checkpoint", f"{name} is not a checkpoint recorded by job {pinned.job_id}"
                )
            if loaded.manifest.seed != config.seed:
                raise PlanDrift("seed", f"checkpoint seed {loaded.manifest.seed} differs from {config.seed}")
    except KilnError as exc:
        raise PlanDrift("resume_checkpoint", exc.message) from None
    return path, loaded.manifest


def _reingest(
    pinned: PinnedJob, resident: ResidentModel, settings: Settings, config: SftConfig
) -> tuple[IngestionResult, ValidationSet | None]:
    policy = config.invalid_row_policy
    common = {"tokenizer": resident.tokenizer, "template": resident.template, "policy": policy}
    common["limit"] = LengthRule.of_config(config)
    try:
        source = row_source(
            examples=pinned.examples if pinned.data_source == EXAMPLES else None,
            dataset_path=pinned.dataset_path if pinned.data_source != EXAMPLES else None,
            datasets_root=settings.datasets_dir,
        )
        ingestion = source.ingest(**common)
    except KilnError as exc:
        raise PlanDrift("data", f"re-ingestion failed: {exc.message}") from None
    try:
        spec = ValidationSpec.model_validate(pinned.validation) if pinned.validation is not None else None
        ingestion, validation = prepare_validation(
            spec, ingestion, **common, seed=config.seed, datasets_root=settings.datasets_dir
        )
    except (KilnError, ValueError) as exc:
        message = exc.message if isinstance(exc, KilnError) else str(exc)
        raise PlanDrift("validation", f"re-deriving the validation rows failed: {message}") from None
    if ingestion.receipt["kept_corpus_sha256"] != pinned.kept_corpus_sha256:
        raise PlanDrift(
            "data.kept_corpus_sha256",
            f"re-ingested corpus {ingestion.receipt['kept_corpus_sha256']} differs from the admitted "
            f"{pinned.kept_corpus_sha256} (the dataset file changed after admission)",
        )
    digest = json_sha256(ingestion.receipt)
    if digest != pinned.ingestion_receipt_sha256:
        raise PlanDrift(
            "data.ingestion_receipt_sha256",
            f"re-ingestion produced receipt {digest}, admission pinned {pinned.ingestion_receipt_sha256}",
        )
    return ingestion, validation
