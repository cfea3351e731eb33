"""SFT admission: `POST /v1/train/sft` from body to queued job (kiln-contract §1.5, DESIGN.md §1).

Order: (1) validate the request; (2) Idempotency-Key replay or 422; (3) queue limits; (4) the
live runner; (5) static gates and the output name; (6) resume checkpoint; (7) defaults (learning
rate, the seed drawn once, checkpoint interval, output name); (8) ingestion with the runner's
tokenizer; (9) memory admission and the segment plan; (10) one transaction writing the pinned
admission, the job and its first event — limits, key and name re-checked inside it, with
admissions serialised (SQLite's write lock, a Postgres advisory lock) so queue order is commit
order; (11) publish with task_id = job_id, then mark published.

Steps 1-9 write nothing, so a rejected request leaves no row, no message and no file. No
database transaction is held across ingestion or memory planning.

Idempotency-Keys are scoped per bearer token: the job row stores the key as given on a server
without tokens, and otherwise an HMAC of it under the caller's token scope, so one caller's key
can neither replay nor block another caller's job.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session

from api.errors import (
    IDEMPOTENCY_KEY_REUSED,
    TRAINING_NO_RUNNER,
    TRAINING_QUEUE_FULL,
    TRAINING_TRACKED_FULL,
    ApiError,
)
from api.queries import active_jobs_for_adapter, admission_summaries
from api.resume_gate import ResumePoint, adopt_checkpoint_fields, check_resume_identity, load_resume_point
from api.runner_gate import RunnerTarget, check_static_gates, check_training_template, runner_target
from api.services import Services
from kiln.store import (
    Admission,
    IdempotencyKeyTaken,
    Job,
    count_queued,
    count_tracked,
    find_by_idempotency_key,
    get_adapter,
    insert_admitted_job,
    live_runner,
    mark_published,
    new_job_id,
    states,
)
from kiln_train.artifacts.adapter import ADAPTER_NAME_RE, check_base_adapter_files
from kiln_train.artifacts.digest import json_sha256
from kiln_train.checkpoint.manifest import CHECKPOINT_PLAN_AUX_KEY, CHECKPOINT_SUFFIX, checkpoint_dir_name
from kiln_train.checkpoint.publish import staging_dir_name
from kiln_train.data.ingestion import IngestionResult, ingest_examples, ingest_jsonl, resolve_dataset_path
from kiln_train.errors import (
    ADAPTER_ALREADY_EXISTS,
    KilnError,
    TrainingFailure,
    backend_unsupported,
    invalid_request,
)
from kiln_train.model.config import Qwen35Config
from kiln_train.plan.budget import available_budget
from kiln_train.plan.segments import SegmentPlan, check_row_plan_fits, plan_segments
from kiln_train.sft_config import SftConfig, SftRequest, parse_sft_request

log = logging.getLogger(__name__)

# Any constant works; it names "the admission writer" among Postgres advisory locks.
ADMISSION_LOCK_KEY = 0x6B696C6E  # "kiln"
IDEMPOTENCY_KEY_MAX = 255
CHECKPOINT_BOUNDARY = "contiguous"
CHECKPOINT_NAME_MARK = "-checkpoint-step-"
NAME_MAX_BYTES = 255  # one path segment (Linux NAME_MAX)
DATASET_PATH_MAX = Admission.__table__.c.dataset_path.type.length


@dataclass(frozen=True)
class Admitted:
    """The answer to a submission: the job, its admission summary, and whether it was a replay."""

    job: Job
    summary: dict
    message: str
    replayed: bool
    published: bool


@dataclass(frozen=True)
class _Plan:
    job_id: str
    config: SftConfig  # effective: resolved, defaults filled, segments stamped
    request: SftRequest
    target: RunnerTarget
    ingestion: IngestionResult
    segments: SegmentPlan
    auto_segments: bool  # rows get the fewest segments that fit (planned, not given by the request)
    resume: ResumePoint | None
    budget_bytes: int  # the budget an auto plan's rows are planned against (a resume: the checkpoint's)


def request_fingerprint(body: object) -> str:
    """SHA-256 of the body's canonical JSON: the same request, however it was formatted."""
    return json_sha256(body)


@dataclass(frozen=True)
class IdempotencyKey:
    given: str  # the header, as the caller sent it (named in messages)
    stored: str  # the job row's value: the key itself, or scoped to the caller's token


def scoped_key(key: str, scope: str) -> str:
    """The stored form of `key` for a caller scope ("" on a token-less server: the key itself)."""
    if not scope:
        return key
    return "bearer:" + hmac.new(scope.encode("ascii"), key.encode("ascii"), hashlib.sha256).hexdigest()


def check_idempotency_key(key: str | None, scope: str = "") -> IdempotencyKey | None:
    if key is None:
        return None
    if not key or len(key) > IDEMPOTENCY_KEY_MAX or not key.isascii() or not key.isprintable():
        raise invalid_request(
            f"the Idempotency-Key header must be 1..={IDEMPOTENCY_KEY_MAX} printable ASCII characters"
        )
    return IdempotencyKey(key, scoped_key(key, scope))


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter directory the trainer will write, or None."""
    if not ADAPTER_NAME_RE.fullmatch(name):
        return (
            "must be one path segment of [A-Za-z0-9._-] starting with a letter or digit (at most 255 bytes)"
        )
    if name.endswith(CHECKPOINT_SUFFIX) or CHECKPOINT_NAME_MARK in name:
        return f"must not look like an exact checkpoint (contain {CHECKPOINT_NAME_MARK!r} or end {CHECKPOINT_SUFFIX!r})"
    return None


def check_request_names(config: SftConfig) -> None:
    """Names the worker would refuse only after the queue wait are refused now (step 1)."""
    for field in ("output_name", "base_adapter"):
        name = getattr(config, field)
        if name is None:
            continue
        problem = adapter_name_problem(name)
        if problem is not None:
            raise invalid_request(f"config.{field} {name!r} {problem}")


def check_dataset_path_length(request: SftRequest) -> None:
    """The admission row keeps `dataset_path` verbatim in a bounded column (Postgres would refuse
    a longer one inside the admission transaction; SQLite would silently keep it)."""
    path = request.dataset_path
    if path is not None and len(path) > DATASET_PATH_MAX:
        raise invalid_request(
            f"dataset_path is {len(path)} characters; at most {DATASET_PATH_MAX} are accepted"
        )


def check_output_name_fits(name: str, total_steps: int) -> None:
    """Every name derived from the adapter's must fit one path segment: the longest is the hidden
    staging directory of its last checkpoint (kiln-contract §5.5)."""
    longest = staging_dir_name(checkpoint_dir_name(name, max(total_steps, 1)))
    if len(longest.encode("utf-8")) > NAME_MAX_BYTES:
        overhead = len(longest) - len(name)
        raise invalid_request(
            f"config.output_name is {len(name)} bytes; with {total_steps} step(s) its checkpoint staging "
            f"directories need {overhead} more bytes and a path segment holds {NAME_MAX_BYTES}: use at "
            f"most {NAME_MAX_BYTES - overhead} bytes"
        )


def check_base_adapter(config: SftConfig, adapters_dir: Path, model: Qwen35Config) -> None:
    """A warm start needs a base adapter in the registry that fits the resident model, the run's
    rank and alpha (adapter_config.json and the safetensors header; no tensor is read). The
    trainer re-checks everything, values and provenance included, at dequeue. A resume ignores
    `base_adapter` (kiln-contract §5), so it is not checked then."""
    name = config.base_adapter
    if name is None or config.resume_checkpoint is not None:
        return
    path = adapters_dir / name
    if not path.is_dir():
        raise invalid_request(f"config.base_adapter {name!r} is not an adapter in the registry")
    try:
        check_base_adapter_files(path, model, config.lora_rank, config.lora_alpha)
    except TrainingFailure as exc:
        raise invalid_request(f"config.base_adapter {name!r}: {exc.message}") from None


def parse_submission(body: object) -> SftRequest:
    """Step 1: the body as a request, its names and its dataset_path length checked (400)."""
    request = parse_sft_request(body)
    check_request_names(request.config)
    check_dataset_path_length(request)
    return request


def admit_sft(svc: Services, body: object, idempotency_key: str | None, scope: str = "") -> Admitted:
    """Admit one SFT request or raise the contract error that rejects it (nothing written).

    `scope` is the caller's (api.auth.caller_scope): Idempotency-Keys of other scopes never meet."""
    request = parse_submission(body)  # (1)
    key = check_idempotency_key(idempotency_key, scope)
    fingerprint = request_fingerprint(body)
    try:
        return _admit(svc, request, key, fingerprint)
    except KilnError:
        # A concurrent request with the same key may have committed after our replay check
        # and is now what made this one fail (its adapter name, a queue slot): answer as a replay.
        if key is None:
            raise
        with svc.sessions() as session:
            replay = _replay(session, key, fingerprint)
        if replay is None:
            raise
        return replay


def _admit(svc: Services, request: SftRequest, key: IdempotencyKey | None, fingerprint: str) -> Admitted:
    if key is not None:  # (2)
        with svc.sessions() as session:
            replay = _replay(session, key, fingerprint)
        if replay is not None:
            return replay
    plan = plan_sft(svc, request)  # (3)-(9), no transaction held
    with svc.sessions.begin() as session:  # (10)
        lock_admissions(session)
        if key is not None:
            replay = _replay(session, key, fingerprint)
            if replay is not None:
                return replay
        _check_limits(session, svc)
        _check_adapter_free(session, svc, plan.config.output_name)
        _check_no_later_checkpoints(svc, plan)
        try:
            job = insert_admitted_job(
                session,
                _job_fields(plan, key, fingerprint),
                _admission_fields(plan),
                _first_event(plan),
            )
        except IdempotencyKeyTaken:
            # Unreachable while admissions are serialised; answer as a replay would all the same.
            replay = _replay(session, key, fingerprint) if key is not None else None
            if replay is None:
                raise
            return replay
        summary = admission_summaries(session, [job.id])[job.id]
    published = publish(svc, job.id)  # (11)
    message = (
        f"SFT job admitted: {job.rows_kept} row(s) x {job.epochs} epoch(s) = {job.total_steps} step(s), "
        f"{plan.segments.num_segments} checkpoint segment(s); queued"
    )
    return Admitted(job=job, summary=summary, message=message, replayed=False, published=published)


def plan_sft(svc: Services, request: SftRequest) -> _Plan:
    """Steps 3-9 for a parsed request: limits, the live runner, the static gates, the names, the
    resume point, defaults, ingestion and the memory plan. Writes nothing, so a preflight is this
    and no more; raises the error the submission would get."""
    settings = svc.settings
    with svc.sessions() as session:
        _check_limits(session, svc)  # (3)
        runner = live_runner(session, settings.training.runner_stale_seconds)  # (4)
        if runner is None:
            raise KilnError(
                TRAINING_NO_RUNNER,
                "no live training runner: no worker has sent a heartbeat within "
                f"{settings.training.runner_stale_seconds} s",
            )
        target = runner_target(runner)  # (5)
        check_static_gates(target, request.config)
        check_base_adapter(request.config, settings.adapters_dir, target.model)
        if request.config.output_name is not None:
            _check_adapter_free(session, svc, request.config.output_name)
    plan = _prepare(svc, request, target)  # (6)-(9)
    _check_no_later_checkpoints(svc, plan)  # checked again inside the commit (10)
    return plan


def publish(svc: Services, job_id: str) -> bool:
    """Ring the doorbell and record it; a broker failure leaves the job for the reconciler."""
    from worker.celery_app import publish_job

    try:
        publish_job(svc.celery, job_id, svc.settings.queue.queue_name)
    except Exception:
        log.exception("job %s is committed but its message was not published; the reconciler will", job_id)
        return False
    try:
        with svc.sessions.begin() as session:
            mark_published(session, job_id)
    except Exception:
        # The job is admitted and its doorbell rang; failing the request now would invite a
        # duplicate submission. The reconciler rings again (a duplicate doorbell is dropped).
        log.exception("job %s was published but could not be marked published", job_id)
    return True


# ----- reads and checks ---------------------------------------------------------------------


def _replay(session: Session, key: IdempotencyKey, fingerprint: str) -> Admitted | None:
    job = find_by_idempotency_key(session, key.stored)
    if job is None:
        return None
    if job.request_fingerprint != fingerprint:
        raise ApiError(
            IDEMPOTENCY_KEY_REUSED,
            f"Idempotency-Key {key.given!r} already names job {job.id} with a different request body",
        )
    summary = admission_summaries(session, [job.id])[job.id]
    message = (
        f"Idempotency-Key {key.given!r} replay: job {job.id} was admitted by an earlier identical request"
    )
    return Admitted(
        job=job, summary=summary, message=message, replayed=True, published=job.published_at is not None
    )


def _check_limits(session: Session, svc: Services) -> None:
    training = svc.settings.training
    queued = count_queued(session)
    if queued >= training.max_queued_jobs:
        raise KilnError(
            TRAINING_QUEUE_FULL,
            f"{queued} jobs are queued (training.max_queued_jobs = {training.max_queued_jobs})",
        )
    tracked = count_tracked(session)
    if tracked >= training.max_tracked_jobs:
        raise KilnError(
            TRAINING_TRACKED_FULL,
            f"{tracked} jobs are tracked (training.max_tracked_jobs = {training.max_tracked_jobs})",
        )


def adapter_conflict(session: Session, adapters_dir: Path, name: str) -> str | None:
    """Why `name` cannot be a new adapter (published, on disk, or another job's target), or None."""
    if get_adapter(session, name) is not None:
        return f"adapter {name!r} already exists"
    if (adapters_dir / name).exists():
        return f"adapter directory {name!r} already exists in the registry"
    active = active_jobs_for_adapter(session, name)
    if active:
        return f"job {active[0]} already targets adapter {name!r}"
    return None


def _check_adapter_free(session: Session, svc: Services, name: str | None) -> None:
    assert name is not None
    reason = adapter_conflict(session, svc.settings.adapters_dir, name)
    if reason is not None:
        raise KilnError(ADAPTER_ALREADY_EXISTS, reason)


def checkpoint_steps(adapters_dir: Path, name: str) -> dict[int, str]:
    """The adapter's exact checkpoint directories in the registry, by global step."""
    pattern = re.compile(rf"{re.escape(name)}-checkpoint-step-([0-9]{{8,}}){re.escape(CHECKPOINT_SUFFIX)}")
    found: dict[int, str] = {}
    if adapters_dir.is_dir():
        for entry in adapters_dir.iterdir():
            match = pattern.fullmatch(entry.name)
            if match is not None:
                found[int(match.group(1))] = entry.name
    return found


def _check_no_later_checkpoints(svc: Services, plan: _Plan) -> None:
    """A run publishes `<name>-checkpoint-step-N` for steps past its start and never overwrites
    one: a directory an earlier run left at such a step would fail this job half way through."""
    start = plan.resume.manifest.progress.global_step if plan.resume else 0
    name = plan.config.output_name
    assert name is not None
    later = sorted(step for step in checkpoint_steps(svc.settings.adapters_dir, name) if step > start)
    if later:
        existing = checkpoint_steps(svc.settings.adapters_dir, name)[later[0]]
        where = f"after the resume point (step {start})" if plan.resume else "from an earlier run"
        raise KilnError(
            ADAPTER_ALREADY_EXISTS,
            f"exact checkpoint {existing!r} of adapter {name!r} exists {where}; this run would have to "
            "publish that name again. Resume from the newest checkpoint with config.resume_checkpoint "
            "or choose another output_name",
        )


def lock_admissions(session: Session) -> None:
    """Serialise admission writers: SQLite already holds the write lock (BEGIN IMMEDIATE)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADMISSION_LOCK_KEY})


# ----- the plan (steps 6-9) -----------------------------------------------------------------


def _prepare(svc: Services, request: SftRequest, target: RunnerTarget) -> _Plan:
    settings = svc.settings
    job_id = new_job_id()
    config = request.config
    resume = None
    if config.resume_checkpoint is not None:  # (6)
        resume = load_resume_point(config, settings.adapters_dir)
        config = adopt_checkpoint_fields(config, resume)
        check_static_gates(target, config)
    defaults: dict = {}  # (7)
    if config.checkpoint_interval is None and settings.training.checkpoint_interval is not None:
        defaults["checkpoint_interval"] = settings.training.checkpoint_interval
    if config.output_name is None:
        defaults["output_name"] = f"sft-{job_id[:8]}"
    config = config.model_copy(update=defaults).resolve(seed=resume.seed if resume else None)
    recorded = _recorded_plan(resume)
    auto_segments = recorded["auto"] if recorded is not None else config.grad_checkpoint_segments is None
    ingestion = _ingest(svc, request, config, target)  # (8)
    check_output_name_fits(config.output_name, config.epochs * len(ingestion.rows))
    segments = _plan_memory(svc, config, target, ingestion)  # (9)
    budget = segments.available_bytes
    if recorded is not None and recorded["auto"]:
        # The resumed rows must get the segments they had: re-derive them from the checkpoint's
        # budget (not today's) and check that each row's bound still fits today.
        budget = int(recorded["budget_bytes"])
        check_row_plan_fits(
            target.model,
            [(r.seq_len, r.supervised_tokens) for r in ingestion.rows],
            recorded,
            lora_rank=config.lora_rank,
            optimizer_kind=config.optimizer.kind,
            loss_route=target.loss_route,
            backend=target.backend,
            weights_resident=True,
            available_bytes=segments.available_bytes,
        )
    config = config.model_copy(update={"grad_checkpoint_segments": segments.num_segments})
    if resume is not None:
        check_resume_identity(
            resume,
            config.to_json(),
            ingestion.receipt["kept_corpus_sha256"],
            len(ingestion.rows),
            config.epochs * len(ingestion.rows),
        )
    return _Plan(job_id, config, request, target, ingestion, segments, auto_segments, resume, budget)


def _recorded_plan(resume: ResumePoint | None) -> dict | None:
    """The gradient checkpoint plan a resumed checkpoint's run was pinned to (validated by the
    strict loader), or None (no resume, or a checkpoint from before plans were recorded)."""
    if resume is None:
        return None
    return resume.manifest.auxiliary_state.get(CHECKPOINT_PLAN_AUX_KEY)


def _ingest(svc: Services, request: SftRequest, config: SftConfig, target: RunnerTarget) -> IngestionResult:
    check_training_template(target)
    tokenizer = svc.tokenizers.get(target.model_path, target.identity.get("tokenizer_vocab_sha256"))
    if request.examples is not None:
        return ingest_examples(
            list(request.examples), tokenizer=tokenizer, policy=config.invalid_row_policy, source="inline"
        )
    assert request.dataset_path is not None
    path = resolve_dataset_path(request.dataset_path, svc.settings.datasets_dir)
    return ingest_jsonl(
        path,
        tokenizer=tokenizer,
        policy=config.invalid_row_policy,
        source="dataset_path",
        source_locator=request.dataset_path,
    )


def _plan_memory(
    svc: Services, config: SftConfig, target: RunnerTarget, ingestion: IngestionResult
) -> SegmentPlan:
    if target.free_memory_bytes is None:
        raise backend_unsupported(f"runner {target.runner_id} reports no free device memory to admit against")
    memory = svc.settings.memory
    available = available_budget(
        target.backend,
        total_bytes=target.total_memory_bytes or target.free_memory_bytes,
        free_bytes=target.free_memory_bytes,
        reserve_gb=memory.reserve_gb,
        training_memory_gb=memory.training_memory_gb,
    )
    return plan_segments(
        target.model,
        max_seq_len=ingestion.max_seq_len,
        max_supervised_tokens=ingestion.max_supervised_tokens,
        lora_rank=config.lora_rank,
        optimizer_kind=config.optimizer.kind,
        loss_route=target.loss_route,
        backend=target.backend,
        weights_resident=True,  # the runner measured free memory with the model already loaded
        available_bytes=available,
        requested_segments=config.grad_checkpoint_segments,
    )


# ----- the rows (step 10) -------------------------------------------------------------------


def _job_fields(plan: _Plan, key: IdempotencyKey | None, fingerprint: str) -> dict:
    config, rows = plan.config, len(plan.ingestion.rows)
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
        "total_steps": config.epochs * rows,
        "loss_route": plan.target.loss_route,
        "backend": plan.target.backend.name,
        "device": plan.target.backend.device,
        "idempotency_key": key.stored if key is not None else None,
        "request_fingerprint": fingerprint,
        "resume_checkpoint": plan.resume.path.name if plan.resume else None,
    }


def _admission_fields(plan: _Plan) -> dict:
    config, ingestion, segments = plan.config, plan.ingestion, plan.segments
    inline = plan.request.examples is not None
    breakdown = segments.breakdown.to_dict()
    breakdown["available_bytes"] = segments.available_bytes
    return {
        "loss_route": plan.target.loss_route,
        "optimizer": {"learning_rate": config.learning_rate, **config.optimizer.model_dump(mode="json")},
        "checkpoint_plan": {
            "max_segments": segments.num_segments,
            "auto": plan.auto_segments,
            "budget_bytes": plan.budget_bytes,
            "boundary": CHECKPOINT_BOUNDARY,
            "resume_from": plan.resume.pin() if plan.resume else None,
        },
        "memory_estimate_bytes": segments.breakdown.total,
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
    }


def _first_event(plan: _Plan) -> dict:
    return {
        "kind": states.EVENT_QUEUED,
        "message": "admitted and queued",
        "data": {
            "runner_id": plan.target.runner_id,
            "rows_kept": len(plan.ingestion.rows),
            "rows_rejected": plan.ingestion.receipt["rows_rejected"],
            "total_steps": plan.config.epochs * len(plan.ingestion.rows),
            "grad_checkpoint_segments": plan.segments.num_segments,
            "memory_estimate_bytes": plan.segments.breakdown.total,
            "resume_checkpoint": plan.resume.path.name if plan.resume else None,
        },
    }
