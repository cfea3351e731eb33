"""SFT admission: `POST /v1/train/sft` from body to queued job (docs/ARCHITECTURE.md#the-path-of-one-job).

The steps, numbered as docs/ARCHITECTURE.md#the-path-of-one-job numbers them (the `# (n)` marks
below): (1) an admission slot and (2) the body read, in api.routes.training; (3) parse and
validate the request; (4) Idempotency-Key replay or 422; (5) queue limits, the live runner and
what it holds; (6) static gates, the warm-start adapter and the output name; (7) the resume
checkpoint and the defaults (learning rate, the seed drawn once, checkpoint interval, output
name); (8) ingestion with the runner's tokenizer; (9) memory admission and the segment plan;
(10) one transaction writing the pinned admission, the job and its first event — limits, key and
name re-checked inside it, with admissions serialised (SQLite's write lock, a Postgres advisory
lock) so queue order is commit order; (11) publish with task_id = job_id, then mark published.

The checks that need no store live in api.admission_checks and, shared with the library's
`finetune`, in kiln_train/plan/ (names.py, gates.py); steps 7-9 and the rows of step 10 in
api.admission_plan; this module runs them in order and holds the transaction. Steps 1-9
write nothing, so a rejected request leaves no row, no message and no file. No database
transaction is held across ingestion or memory planning.

Idempotency-Keys are scoped per bearer token: the job row stores the key as given on a server
without tokens, and otherwise an HMAC of it under the caller's token scope, so one caller's key
can neither replay nor block another caller's job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session

from api.admission_checks import (
    IdempotencyKey,
    check_dataset_path_length,
    check_example_lengths,
    check_idempotency_key,
    request_fingerprint,
)
from api.admission_plan import AdmissionPlan, admission_fields, first_event, job_fields, prepare_plan
from api.errors import (
    IDEMPOTENCY_KEY_REUSED,
    TRAINING_NO_RUNNER,
    TRAINING_QUEUE_FULL,
    TRAINING_TRACKED_FULL,
    ApiError,
)
from api.queries import active_jobs_for_adapter, admission_summaries
from api.runner_gate import runner_target
from api.services import Services
from kiln.broker import publish_job
from kiln.store import (
    IdempotencyKeyTaken,
    Job,
    count_queued,
    count_tracked,
    find_by_idempotency_key,
    get_adapter,
    insert_admitted_job,
    live_runner,
    mark_published,
)
from kiln_train.errors import (
    ADAPTER_ALREADY_EXISTS,
    KilnError,
)
from kiln_train.plan.gates import check_base_adapter, check_static_gates
from kiln_train.plan.names import check_no_later_checkpoints, check_request_names
from kiln_train.sft_config import SftRequest, parse_sft_request

log = logging.getLogger(__name__)

# Any constant works; it names "the admission writer" among Postgres advisory locks.
ADMISSION_LOCK_KEY = 0x6B696C6E  # "kiln"


@dataclass(frozen=True)
class Admitted:
    """The answer to a submission: the job, its admission summary, and whether it was a replay."""

    job: Job
    summary: dict
    message: str
    replayed: bool
    published: bool


def parse_submission(body: object) -> SftRequest:
    """Step 3: the body as a request, its names and its dataset_path length checked (400)."""
    request = parse_sft_request(body)
    check_request_names(request.config)
    check_dataset_path_length(request)
    check_example_lengths(request)
    return request


def admit_sft(svc: Services, body: object, idempotency_key: str | None, scope: str = "") -> Admitted:
    """Admit one SFT request or raise the contract error that rejects it (nothing written).

    `scope` is the caller's (api.auth.caller_scope): Idempotency-Keys of other scopes never meet."""
    request = parse_submission(body)  # (3)
    key = check_idempotency_key(idempotency_key, scope)  # (4)
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
    if key is not None:  # (4)
        with svc.sessions() as session:
            replay = _replay(session, key, fingerprint)
        if replay is not None:
            return replay
    plan = plan_sft(svc, request)  # (5)-(9), no transaction held
    with svc.sessions.begin() as session:  # (10)
        lock_admissions(session)
        if key is not None:
            replay = _replay(session, key, fingerprint)
            if replay is not None:
                return replay
        _check_limits(session, svc)
        _check_adapter_free(session, svc, plan.run.config.output_name)
        _check_no_later_checkpoints(svc, plan)
        try:
            job = insert_admitted_job(
                session,
                job_fields(plan, key, fingerprint),
                admission_fields(plan),
                first_event(plan),
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
        f"{plan.run.segments.num_segments} checkpoint segment(s); queued"
    )
    return Admitted(job=job, summary=summary, message=message, replayed=False, published=published)


def plan_sft(svc: Services, request: SftRequest) -> AdmissionPlan:
    """Steps 5-9 for a parsed request: limits, the live runner, the static gates, the names, the
    resume point, defaults, ingestion and the memory plan. Writes nothing, so a preflight is this
    and no more; raises the error the submission would get."""
    settings = svc.settings
    with svc.sessions() as session:
        _check_limits(session, svc)  # (5)
        runner = live_runner(session, settings.training.runner_stale_seconds)
        if runner is None:
            raise KilnError(
                TRAINING_NO_RUNNER,
                "no live training runner: no worker has sent a heartbeat within "
                f"{settings.training.runner_stale_seconds} s",
            )
        target = runner_target(runner)
        check_static_gates(target, request.config)  # (6)
        check_base_adapter(request.config, settings.adapters_dir, target.model)
        if request.config.output_name is not None:
            _check_adapter_free(session, svc, request.config.output_name)
    plan = prepare_plan(svc, request, target)  # (7)-(9)
    _check_no_later_checkpoints(svc, plan)  # checked again inside the commit (10)
    return plan


def publish(svc: Services, job_id: str) -> bool:
    """Publish the job's queue message and record it; a broker failure leaves the job for the reconciler."""
    try:
        publish_job(svc.celery, job_id, svc.settings.queue.queue_name)
    except Exception:
        log.exception("job %s is committed but its message was not published; the reconciler will", job_id)
        return False
    try:
        with svc.sessions.begin() as session:
            mark_published(session, job_id)
    except Exception:
        # The job is admitted and its message went out; failing the request now would invite a
        # duplicate submission. The reconciler publishes again (a duplicate message is dropped).
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


def _check_no_later_checkpoints(svc: Services, plan: AdmissionPlan) -> None:
    name, resume = plan.run.config.output_name, plan.run.resume
    assert name is not None
    start = resume.manifest.progress.global_step if resume else 0
    check_no_later_checkpoints(svc.settings.adapters_dir, name, start, resumed=resume is not None)


def lock_admissions(session: Session) -> None:
    """Serialise admission writers: SQLite already holds the write lock (BEGIN IMMEDIATE)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADMISSION_LOCK_KEY})
