"""`POST /v1/train/sft/preflight`: the whole admission of a submission without its commit.

The body is a submission's; `api.admission.plan_sft` runs the same steps (parse, limits, the
live runner, gates, names, resume point, defaults, ingestion, memory plan) and raises exactly
the 400/413/409/503 the submission would get. Nothing is written: no job, no row, no queue
message. The answer is the plan: rows kept and rejected, steps, segments, the memory estimate
against the budget, and the largest LoRA rank that fits the same data.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from api.admission import parse_submission, plan_sft
from api.services import Services
from kiln_train.data.ingestion import TokenStats
from kiln_train.plan.optimizer_support import rank_range
from kiln_train.plan.segments import admissible_rank_ceiling, max_rank_that_fits


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PreflightRejectedRow(_Out):
    row_index: int
    row_sha256: str
    reason: str
    line: int | None = Field(
        default=None, description="The row's line in a dataset file (blank lines counted)."
    )


class PreflightMemory(_Out):
    estimate_bytes: int = Field(description="The step's working set with its safety margin.")
    available_bytes: int = Field(description="The budget admission plans against.")
    breakdown: dict[str, Any] = Field(description="Bytes per component (the 413's breakdown).")


class PreflightValidation(_Out):
    """The held-out validation rows a submission would evaluate (docs/validation.md)."""

    source: str = Field(description="inline, dataset_path or holdout.")
    holdout_percent: int | None
    interval_steps: int | None = Field(description="Extra evaluations every N steps; null: none.")
    rows_read: int = Field(description="Validation rows read (a holdout: the rows held out).")
    rows_kept: int
    rows_rejected: int
    rejected_rows: list[PreflightRejectedRow]
    max_seq_len: int
    max_supervised_tokens: int
    total_tokens: int
    total_supervised_tokens: int
    corpus_sha256: str
    evaluations: int = Field(description="Evaluations the run makes: the baseline, epoch ends, intervals.")
    memory: PreflightMemory = Field(description="The validation forward (no gradient) over the longest row.")


class PreflightResponse(_Out):
    message: str
    runner_id: str
    rows_read: int
    rows_kept: int
    rows_rejected: int
    rejected_rows: list[PreflightRejectedRow]
    epochs: int
    total_steps: int
    grad_checkpoint_segments: int
    auto_segments: bool = Field(description="Segments planned by admission (not given by the request).")
    max_seq_len: int
    max_supervised_tokens: int
    total_tokens: int
    total_supervised_tokens: int
    memory: PreflightMemory
    max_lora_rank_that_fits: int = Field(description="0 when no rank fits this data.")
    lora_rank_range: dict[str, int] = Field(description="Ranks the optimizer allows on this runner.")
    learning_rate: float = Field(description="The resolved learning rate.")
    effective_config: dict[str, Any] = Field(
        description="The config the job would run with; `drawn` names the values a submission draws anew."
    )
    drawn: list[str] = Field(description="Defaults the submission draws itself (seed, output_name).")
    resume_checkpoint: str | None
    kept_corpus_sha256: str
    validation: PreflightValidation | None = Field(
        default=None, description="Held-out validation rows; null when the request has none."
    )


def preflight_sft(svc: Services, body: object) -> PreflightResponse:
    admitted = plan_sft(svc, parse_submission(body))
    request, target, plan = admitted.request, admitted.target, admitted.run
    config, ingestion, segments = plan.config, plan.ingestion, plan.segments
    rank_search = {
        "max_seq_len": ingestion.max_seq_len,
        "max_supervised_tokens": ingestion.max_supervised_tokens,
        "optimizer_kind": config.optimizer.kind,
        "loss_route": target.loss_route,
        "backend": target.backend,
        "weights_resident": True,
        "available_bytes": segments.available_bytes,
        "requested_segments": None if plan.auto_segments else segments.num_segments,
    }
    ceiling = admissible_rank_ceiling(
        target.model,
        max_rank_that_fits(target.model, **rank_search),
        optimizer_kind=config.optimizer.kind,
        backend=target.backend,
    )
    ranks = rank_range(target.backend, target.model, config.optimizer.kind)
    drawn = []
    if request.config.seed is None and plan.resume is None:
        drawn.append("seed")
    if request.config.output_name is None and plan.resume is None:
        drawn.append("output_name")
    effective = config.to_json()
    for name in drawn:
        effective[name] = None
    receipt = ingestion.receipt
    rows = len(ingestion.rows)
    total_steps = config.epochs * rows
    return PreflightResponse(
        message=(
            f"would admit {rows} row(s) x {config.epochs} epoch(s) = {total_steps} step(s), "
            f"{segments.num_segments} checkpoint segment(s); nothing was queued"
        ),
        runner_id=target.runner_id,
        **_row_counts(receipt),
        epochs=config.epochs,
        total_steps=total_steps,
        grad_checkpoint_segments=segments.num_segments,
        auto_segments=plan.auto_segments,
        **TokenStats.of(ingestion.rows).to_dict(),
        memory=PreflightMemory(
            estimate_bytes=plan.memory_estimate_bytes,
            available_bytes=segments.available_bytes,
            breakdown=segments.breakdown.to_dict(),
        ),
        max_lora_rank_that_fits=ceiling,
        lora_rank_range={"minimum": int(ranks["minimum"]), "maximum": int(ranks["maximum"])},
        learning_rate=config.learning_rate,
        effective_config=effective,
        drawn=drawn,
        resume_checkpoint=plan.resume.path.name if plan.resume else None,
        kept_corpus_sha256=receipt["kept_corpus_sha256"],
        validation=_validation(plan, total_steps, rows),
    )


def _row_counts(receipt: dict[str, Any]) -> dict[str, Any]:
    """The preflight fields of what ingestion did with the rows (an ingestion receipt, or the
    validation part of one)."""
    return {
        "rows_read": receipt["rows_read"],
        "rows_kept": receipt["rows_kept"],
        "rows_rejected": receipt["rows_rejected"],
        "rejected_rows": [PreflightRejectedRow(**r) for r in receipt["rejected_rows"]],
    }


def evaluation_count(total_steps: int, rows: int, interval: int | None, start: int = 0) -> int:
    """How many evaluations a run makes from step `start` (exclusive; the baseline when it starts at
    0): every epoch's end (a multiple of `rows`) and every multiple of `interval`, each step once
    (kiln_train.train.run.SftRun._evaluation_due)."""
    epochs_left = total_steps // rows - start // rows
    count = (1 if start == 0 else 0) + epochs_left
    if interval:
        both = interval * rows // math.gcd(interval, rows)
        count += total_steps // interval - start // interval
        count -= total_steps // both - start // both
    return count


def _validation(plan, total_steps: int, rows: int) -> PreflightValidation | None:
    validation, forward = plan.validation, plan.validation_breakdown
    if validation is None or forward is None:
        return None
    part = validation.part
    start = plan.resume.manifest.progress.global_step if plan.resume else 0
    return PreflightValidation(
        source=part["source"],
        holdout_percent=part.get("holdout_percent"),
        interval_steps=validation.interval_steps,
        **_row_counts(part),
        **validation.stats.to_dict(),
        corpus_sha256=validation.corpus_sha256,
        evaluations=evaluation_count(total_steps, rows, validation.interval_steps, start),
        memory=PreflightMemory(
            estimate_bytes=forward.total,
            available_bytes=plan.segments.available_bytes,
            breakdown=forward.to_dict(),
        ),
    )
