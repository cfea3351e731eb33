"""Admission steps 7-9 for a submission (docs/ARCHITECTURE.md#the-path-of-one-job): the resume
point and the defaults, ingestion with the runner's tokenizer, the memory plan; and the rows that plan becomes in step 10 (the job, its
pinned admission, its first event). Nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from api.admission_checks import IdempotencyKey
from api.runner_gate import RunnerTarget, check_training_template
from api.services import Services
from kiln.store import new_job_id, states
from kiln_train.data.ingestion import IngestionResult, LengthRule
from kiln_train.data.row_source import row_source
from kiln_train.data.validation import ValidationSet, prepare_validation
from kiln_train.errors import backend_unsupported
from kiln_train.ground.digest import json_sha256
from kiln_train.plan.budget import memory_budget
from kiln_train.plan.run_plan import RunPlan, plan_run
from kiln_train.sft_config import SftConfig, SftRequest


@dataclass(frozen=True)
class AdmissionPlan:
    """A submission's `RunPlan` (what a library run plans too) and what only the service has: the
    job id, the request as submitted and the runner it was planned for."""

    job_id: str
    request: SftRequest
    target: RunnerTarget
    run: RunPlan


def prepare_plan(svc: Services, request: SftRequest, target: RunnerTarget) -> AdmissionPlan:
    """Steps 7-9 (`kiln_train/plan/run_plan.py: plan_run`) with the runner's tokenizer and the
    budget its registered free memory leaves; the default output name follows the job id."""
    settings = svc.settings
    job_id = new_job_id()
    run = plan_run(
        request.config,
        target,
        adapters_dir=settings.adapters_dir,
        ingest=lambda config: _ingest(svc, request, config, target),  # (8)
        available_bytes=lambda: _available_bytes(svc, target),  # (9)
        validate=lambda config, ingestion: _validation(svc, request, config, target, ingestion),
        default_output_name=f"sft-{job_id[:8]}",
        default_checkpoint_interval=settings.training.checkpoint_interval,
    )
    return AdmissionPlan(job_id, request, target, run)


def _ingest(svc: Services, request: SftRequest, config: SftConfig, target: RunnerTarget) -> IngestionResult:
    check_training_template(target)
    tokenizer = svc.tokenizers.get(target.model_path, target.identity.get("tokenizer_vocab_sha256"))
    source = row_source(
        examples=request.examples, dataset_path=request.dataset_path, datasets_root=svc.settings.datasets_dir
    )
    return source.ingest(
        tokenizer=tokenizer, policy=config.invalid_row_policy, limit=LengthRule.of_config(config)
    )


def _validation(
    svc: Services, request: SftRequest, config: SftConfig, target: RunnerTarget, ingestion: IngestionResult
) -> tuple[IngestionResult, ValidationSet | None]:
    """The held-out rows: their own ingestion (same tokenizer, template and policy) or the seeded
    holdout of the submitted rows, which then leave the training rows."""
    if request.validation is None:
        return ingestion, None
    tokenizer = svc.tokenizers.get(target.model_path, target.identity.get("tokenizer_vocab_sha256"))
    return prepare_validation(
        request.validation,
        ingestion,
        tokenizer=tokenizer,
        policy=config.invalid_row_policy,
        seed=config.seed,
        datasets_root=svc.settings.datasets_dir,
        limit=LengthRule.of_config(config),
    )


def _available_bytes(svc: Services, target: RunnerTarget) -> int:
    memory = svc.settings.memory
    budget = memory_budget(
        target.backend,
        (target.free_memory_bytes, target.total_memory_bytes),
        reserve_gb=memory.reserve_gb,
        training_memory_gb=memory.training_memory_gb,
    )
    if budget is None:
        raise backend_unsupported(f"runner {target.runner_id} reports no free device memory to admit against")
    return budget


# ----- the rows (step 10) -------------------------------------------------------------------


def job_fields(plan: AdmissionPlan, key: IdempotencyKey | None, fingerprint: str) -> dict:
    run = plan.run
    config, rows = run.config, len(run.ingestion.rows)
    return {
        "id": plan.job_id,
        "adapter_name": config.output_name,
        "effective_seed": str(config.seed),
        "optimizer_kind": config.optimizer.kind,
        "learning_rate": config.learning_rate,
        "lora_rank": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "epochs": config.epochs,
        "rows_kept": rows,
        "total_steps": run.total_steps,
        "loss_route": plan.target.loss_route,
        "backend": plan.target.backend.name,
        "device": plan.target.backend.device,
        "idempotency_key": key.stored if key is not None else None,
        "request_fingerprint": fingerprint,
        "resume_checkpoint": run.resume.path.name if run.resume else None,
    }


def admission_fields(plan: AdmissionPlan) -> dict:
    run = plan.run
    config, ingestion, segments = run.config, run.ingestion, run.segments
    inline = plan.request.examples is not None
    breakdown = segments.breakdown.to_dict()
    breakdown["available_bytes"] = segments.available_bytes
    if run.validation_breakdown is not None:
        breakdown["validation_forward"] = run.validation_breakdown.to_dict()
    return {
        "loss_route": plan.target.loss_route,
        "optimizer": {"learning_rate": config.learning_rate, **config.optimizer.model_dump(mode="json")},
        "checkpoint_plan": run.checkpoint_plan(),
        "memory_estimate_bytes": run.memory_estimate_bytes,
        "memory_breakdown": breakdown,
        "execution_identity_digest": plan.target.execution_identity_digest,
        "runner_id": plan.target.runner_id,
        "ingestion_receipt": ingestion.receipt,
        "ingestion_receipt_sha256": json_sha256(ingestion.receipt),
        "kept_corpus_sha256": ingestion.receipt["kept_corpus_sha256"],
        "effective_config": config.to_json(),
        "data_source": states.SOURCE_EXAMPLES if inline else states.SOURCE_DATASET_PATH,
        "examples": list(plan.request.examples) if inline else None,
        "dataset_path": None if inline else plan.request.dataset_path,
        "max_seq_len": ingestion.max_seq_len,
        "max_supervised_tokens": ingestion.max_supervised_tokens,
        "validation": validation_pin(plan.request),
        "requested_config": requested_config(plan.request.config),
    }


def requested_config(config: SftConfig) -> dict:
    """The request's `config` as sent: only the fields the client set (nested ones too)."""
    return config.model_dump(mode="json", exclude_unset=True)


def validation_pin(request: SftRequest) -> dict | None:
    """The request's `validation` as the admission row keeps it (what the worker re-derives)."""
    if request.validation is None:
        return None
    return request.validation.model_dump(mode="json", exclude_none=True)


def first_event(plan: AdmissionPlan) -> dict:
    run = plan.run
    return {
        "kind": states.EVENT_QUEUED,
        "message": "admitted and queued",
        "data": {
            "runner_id": plan.target.runner_id,
            "rows_kept": len(run.ingestion.rows),
            "rows_rejected": run.ingestion.receipt["rows_rejected"],
            "total_steps": run.total_steps,
            "grad_checkpoint_segments": run.segments.num_segments,
            "memory_estimate_bytes": run.memory_estimate_bytes,
            "resume_checkpoint": run.resume.path.name if run.resume else None,
            **({"validation_rows": len(run.validation.rows)} if run.validation is not None else {}),
        },
    }
