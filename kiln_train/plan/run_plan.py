"""The plan of one run, decided before any training: the resume point, the defaults, the
ingested rows and the memory plan (docs/ARCHITECTURE.md#the-path-of-one-job, steps 7 to 9).

The service's admission (`api/admission_plan.py: prepare_plan`) and the library's `finetune`
both call `plan_run`; they differ only in where the rows, the tokenizer and the memory budget
come from, which they pass in. Nothing here writes. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln_train.checkpoint.manifest import CHECKPOINT_PLAN_AUX_KEY
from kiln_train.data.ingestion import IngestionResult
from kiln_train.data.validation import ValidationSet
from kiln_train.plan.gates import TrainingTarget, check_static_gates
from kiln_train.plan.memory import Breakdown, Pricing
from kiln_train.plan.names import check_output_name_fits
from kiln_train.plan.resume_point import (
    ResumePoint,
    adopt_checkpoint_fields,
    check_resume_identity,
    load_resume_point,
)
from kiln_train.plan.segments import SegmentPlan, check_row_plan_fits, plan_segments, plan_validation_forward
from kiln_train.sft_config import SftConfig

CHECKPOINT_BOUNDARY = "contiguous"


@dataclass(frozen=True)
class RunPlan:
    config: SftConfig  # effective: resolved, defaults filled, segments stamped
    ingestion: IngestionResult
    segments: SegmentPlan
    auto_segments: bool  # rows get the fewest segments that fit (planned, not given by the request)
    resume: ResumePoint | None
    budget_bytes: int  # the budget an auto plan's rows are planned against (a resume: the checkpoint's)
    validation: ValidationSet | None = None  # held-out rows (docs/validation.md)
    validation_breakdown: Breakdown | None = None  # the working set of their forward

    @property
    def memory_estimate_bytes(self) -> int:
        """What the run needs at its peak: a training step or a validation forward."""
        forward = self.validation_breakdown.total if self.validation_breakdown is not None else 0
        return max(self.segments.breakdown.total, forward)

    @property
    def total_steps(self) -> int:
        return self.config.epochs * len(self.ingestion.rows)

    def checkpoint_plan(self) -> dict:
        """The gradient checkpoint plan the trainer runs with (and the service pins)."""
        return checkpoint_plan_record(self.segments, self.auto_segments, self.budget_bytes, self.resume)


def checkpoint_plan_record(
    segments: SegmentPlan, auto: bool, budget_bytes: int, resume: ResumePoint | None
) -> dict:
    """`{max_segments, auto, budget_bytes, boundary, resume_from}`: the plan's record."""
    return {
        "max_segments": segments.num_segments,
        "auto": auto,
        "budget_bytes": budget_bytes,
        "boundary": CHECKPOINT_BOUNDARY,
        "resume_from": resume.pin() if resume else None,
    }


def plan_run(
    config: SftConfig,
    target: TrainingTarget,
    *,
    adapters_dir: Path,
    ingest: Callable[[SftConfig], IngestionResult],
    available_bytes: Callable[[], int],
    default_output_name: str,
    default_checkpoint_interval: int | None = None,
    server: bool = True,
    validate: Callable[[SftConfig, IngestionResult], tuple[IngestionResult, ValidationSet | None]]
    | None = None,
) -> RunPlan:
    """Resume point, defaults, ingestion and memory plan for a request that passed the static
    gates; raises the 400/413/501 that refuses it.

    `ingest(config)` returns the ingested rows under the config's invalid-row policy;
    `available_bytes()` the bytes a training step may use (called once, after ingestion).
    `server` says whose refusal of `train_mtp` it is (`SftConfig.resolve`).
    `validate(config, ingestion)` returns the training rows and the held-out validation rows
    (`kiln_train.data.validation.prepare_validation`; a holdout leaves the training rows), whose
    forward must fit the same budget (docs/validation.md); None: no validation.
    """
    resume = None
    if config.resume_checkpoint is not None:
        resume = load_resume_point(config, adapters_dir)
        config = adopt_checkpoint_fields(config, resume)
        check_static_gates(target, config)
    defaults: dict = {}
    if config.checkpoint_interval is None and default_checkpoint_interval is not None:
        defaults["checkpoint_interval"] = default_checkpoint_interval
    if config.output_name is None:
        defaults["output_name"] = default_output_name
    config = config.model_copy(update=defaults).resolve(seed=resume.seed if resume else None, server=server)
    recorded = _recorded_plan(resume)
    auto_segments = recorded["auto"] if recorded is not None else config.grad_checkpoint_segments is None
    ingestion = ingest(config)
    validation = None
    if validate is not None:
        ingestion, validation = validate(config, ingestion)
    check_output_name_fits(config.output_name, config.epochs * len(ingestion.rows))
    segments = _plan_memory(config, target, ingestion, available_bytes())
    forward = _plan_validation(config, target, validation, segments.available_bytes)
    budget = segments.available_bytes
    if recorded is not None and recorded["auto"]:
        # The resumed rows must get the segments they had: re-derive them from the checkpoint's
        # budget (not today's) and check that each row's bound still fits today.
        budget = int(recorded["budget_bytes"])
        check_row_plan_fits(
            target.model,
            [(r.seq_len, r.supervised_tokens) for r in ingestion.rows],
            recorded,
            available_bytes=segments.available_bytes,
            **_pricing(config, target),
        )
    config = config.model_copy(update={"grad_checkpoint_segments": segments.num_segments})
    if resume is not None:
        check_resume_identity(
            resume,
            config.to_json(),
            ingestion.receipt["kept_corpus_sha256"],
            len(ingestion.rows),
            config.epochs * len(ingestion.rows),
            validation.identity() if validation is not None else None,
        )
    return RunPlan(config, ingestion, segments, auto_segments, resume, budget, validation, forward)


def _recorded_plan(resume: ResumePoint | None) -> dict | None:
    """The gradient checkpoint plan a resumed checkpoint's run was pinned to (validated by the
    strict loader), or None (no resume, or a checkpoint from before plans were recorded)."""
    if resume is None:
        return None
    return resume.manifest.auxiliary_state.get(CHECKPOINT_PLAN_AUX_KEY)


def _plan_memory(
    config: SftConfig, target: TrainingTarget, ingestion: IngestionResult, available: int
) -> SegmentPlan:
    return plan_segments(
        target.model,
        max_seq_len=ingestion.max_seq_len,
        max_supervised_tokens=ingestion.max_supervised_tokens,
        available_bytes=available,
        requested_segments=config.grad_checkpoint_segments,
        **_pricing(config, target),
    )


def _plan_validation(
    config: SftConfig, target: TrainingTarget, validation: ValidationSet | None, available: int
) -> Breakdown | None:
    """The forward over the longest held-out row must fit the same budget (413 otherwise)."""
    if validation is None:
        return None
    stats = validation.stats
    return plan_validation_forward(
        target.model,
        max_seq_len=stats.max_seq_len,
        max_supervised_tokens=stats.max_supervised_tokens,
        available_bytes=available,
        **_pricing(config, target),
    )


def _pricing(config: SftConfig, target: TrainingTarget) -> Pricing:
    """What prices every memory check of the run besides the rows' sizes (`memory.estimate`'s
    keywords). The free memory is measured with the model already loaded: weights are resident."""
    return {
        "lora_rank": config.lora_rank,
        "optimizer_kind": config.optimizer.kind,
        "loss_route": target.loss_route,
        "backend": target.backend,
        "weights_resident": True,
    }
