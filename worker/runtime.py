"""The resident worker runtime: claim, re-verify, reserve, train, record.

docs/ARCHITECTURE.md#the-path-of-one-job, steps 12 to 18.

One process holds the base model resident between jobs. A queue message only carries the job id:
the job row decides. A redelivered message whose row is not `queued` is dropped; a claim is one
conditional UPDATE with a lease that a heartbeat thread renews; progress, the loss curve,
checkpoints and the final state are written as they happen.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from sqlalchemy.orm import Session

from kiln import store
from kiln.settings import Settings
from kiln.store import states
from kiln.store.errors import STORE_UNREACHABLE
from kiln_train import checkpoint as ckpt
from kiln_train.artifacts.fencing import RunIdentity, grab_leftover
from kiln_train.errors import KilnError, OwnershipLost
from kiln_train.plan.budget import device_memory, memory_budget
from kiln_train.train.request import TrainRequest
from kiln_train.train.resident import ResidentModel
from kiln_train.train.result import TrainResult
from kiln_train.train.trainer import train_sft
from worker.fence import JobFence
from worker.reconciler import Reconciler, unrecorded_checkpoints_beyond
from worker.run_records import CurrentRun, RunRecording, held_run
from worker.runner import heartbeat_file, runner_registration
from worker.verify import PLAN_DRIFT, PLAN_DRIFT_CODE, PinnedJob, PlanDrift, pin_job, verify_plan

log = logging.getLogger(__name__)

RESERVATION_FAILED_CODE = "training_will_not_fit"
# Anything that went wrong in the worker itself rather than in the trainer's loop (publication I/O,
# an unexpected exception): the job fails with this code instead of staying `running`.
WORKER_ERROR_CODE = "training_worker_error"
WORKER_ERROR_REASON = "training_error"
# A brief database outage is ridden out: each store write is retried after these pauses (seconds).
DB_RETRY_DELAYS = (0.2, 0.5, 1.0, 2.0, 4.0)

T = TypeVar("T")


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerRuntime:
    """Everything one worker process owns: settings, store, resident model, threads."""

    def __init__(
        self, settings: Settings, resident: ResidentModel, *, celery=None, worker_id: str | None = None
    ):
        self.settings = settings
        self.resident = resident
        self.worker_id = worker_id or new_worker_id()
        # A transaction this process leaves open while frozen must not hold the job row past the
        # lease, or the reconciler taking the job over would wait on its lock (kiln/store/engine.py).
        self.engine = store.make_engine(
            settings.database_url,
            echo=settings.database.echo,
            idle_in_transaction_timeout_seconds=settings.training.lease_seconds,
        )
        self.factory = store.session_factory(self.engine)
        self.celery = celery
        self.run: CurrentRun | None = None
        # Held by a heartbeat from reading `run` until its lease renewal commits, and by whoever
        # clears `run` to give the lease up: a heartbeat that read the run before the release
        # must not renew the lease after the release expired it.
        self.lease_lock = threading.Lock()
        # When this worker last finished handling a message (None while it handles one): an idle
        # worker's reconciler publishes again the messages the broker lost.
        self.idle_since: datetime | None = None
        self.db_retry_delays: tuple[float, ...] = DB_RETRY_DELAYS
        self.shutdown = threading.Event()
        self._stop_threads = threading.Event()
        self._threads: list[threading.Thread] = []
        self.reconciler = Reconciler(self)
        self.recording = RunRecording(
            transact=self.transact,
            worker_id=self.worker_id,
            lease_seconds=settings.training.lease_seconds,
            base_weights_sha256=resident.base_weights_sha256,
            current_run=lambda: self.run,
        )

    # ----- life cycle ----------------------------------------------------------------------
    def start(self, *, threads: bool = True) -> None:
        """Register the runner row, reconcile once, start the heartbeat and reconciler threads."""
        self.settings.ensure_dirs()
        with self.factory.begin() as s:
            store.register_runner(s, self.worker_id, **runner_registration(self.resident))
        self.touch_heartbeat_file()
        self.idle_since = store.utcnow()
        self.reconciler.run_once()
        if threads:
            for target, name in (
                (self._heartbeat_loop, "kiln-heartbeat"),
                (self._reconcile_loop, "kiln-reconciler"),
            ):
                t = threading.Thread(target=target, name=name, daemon=True)
                t.start()
                self._threads.append(t)
        log.info(
            "worker %s ready: backend %s, identity %s",
            self.worker_id,
            self.resident.backend.device,
            self.resident.execution_identity_digest,
        )

    def stop(self) -> None:
        self._stop_threads.set()
        for t in self._threads:
            t.join(timeout=5)
        with self.factory.begin() as s:
            store.stop_runner(s, self.worker_id)
        self.engine.dispose()

    def request_shutdown(self) -> None:
        """Warm shutdown: the running job checkpoints at its next step boundary and is requeued."""
        self.shutdown.set()

    def touch_heartbeat_file(self) -> None:
        path = heartbeat_file(self.settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{self.worker_id} {time.time():.3f}\n", encoding="ascii")

    def _heartbeat_loop(self) -> None:
        period = self.settings.training.heartbeat_seconds
        while not self._stop_threads.wait(period):
            try:
                self.heartbeat()
            except Exception:  # a DB hiccup must not kill the heartbeat thread
                log.exception("heartbeat failed")

    @property
    def current_job(self) -> str | None:
        run = self.run
        return run.job_id if run is not None else None

    def heartbeat(self) -> None:
        free, _ = device_memory(self.resident.backend.device)
        with self.lease_lock:
            self._heartbeat_locked(free)
        self.touch_heartbeat_file()

    def _heartbeat_locked(self, free: int | None) -> None:
        run = self.run  # read once: the job may end (and the next begin) while we write
        with self.factory.begin() as s:
            store.heartbeat_runner(
                s,
                self.worker_id,
                free_memory_bytes=free,
                state=states.RUNNER_BUSY if run else states.RUNNER_READY,
                current_job_id=run.job_id if run else None,
            )
            if run is not None:
                lease = self.settings.training.lease_seconds
                try:
                    if store.renew_lease(s, run.job_id, self.worker_id, lease, attempt=run.attempt):
                        run.cancel.set()
                except store.LeaseLost:
                    log.debug("job %s: claim %d superseded; the run stops at its next step", *run.key)
                    run.lease_lost.set()

    def transact(self, write: Callable[[Session, bool], T]) -> T:
        """Run `write(session, retried)` in one transaction, retrying through a brief database
        outage (DB_RETRY_DELAYS). `retried` says an earlier attempt failed, perhaps after its
        commit went through: writes that are not idempotent check for their own effect first."""
        delays = iter(self.db_retry_delays)
        retried = False
        while True:
            try:
                with self.factory.begin() as s:
                    return write(s, retried)
            except STORE_UNREACHABLE as exc:
                delay = next(delays, None)
                if delay is None:
                    raise
                log.warning("job store unavailable (%s); retrying in %.1f s", type(exc).__name__, delay)
                time.sleep(delay)
                retried = True

    def _reconcile_loop(self) -> None:
        while not self._stop_threads.wait(self.settings.training.reconcile_interval_seconds):
            try:
                self.reconciler.run_once()
            except Exception:
                log.exception("reconciler pass failed")

    # ----- one job -------------------------------------------------------------------------
    def run_job(self, job_id: str) -> str:
        """Handle one queue message; returns what happened to `job_id` (`dropped`, `completed`, `failed`,
        `requeued`, or `deferred`: not claimed because this worker is shutting down).

        Messages can leave the api out of admission order (concurrent admissions publish after
        their commits), so a message first runs every older queued job: execution follows
        `queue_seq`, strictly FIFO. The older jobs' own messages later find them done and drop.
        """
        self.idle_since = None
        try:
            while not self.shutdown.is_set():
                older = self._oldest_queued_before(job_id)
                if older is None:
                    break
                self._run_one(older)
            if self.shutdown.is_set():
                # A worker on its way out claims nothing: the message goes back to the broker for
                # another worker (or this one after its restart) instead of one step and a release.
                return "deferred"
            outcome = self._run_one(job_id)
            self._drain_queue()
            return outcome
        finally:
            self.idle_since = store.utcnow()

    def _queued_ids(self) -> list[str]:
        return self.transact(lambda s, _: [j.id for j in store.list_queued(s) if not j.cancel_requested])

    def _oldest_queued_before(self, job_id: str) -> str | None:
        ids = self._queued_ids()
        if job_id not in ids:
            return None
        position = ids.index(job_id)
        return ids[0] if position > 0 else None

    def _drain_queue(self) -> None:
        """Run the jobs still queued in the store, oldest first, before waiting for the next
        message: the row is the truth, so a job whose message the broker lost (flushed, restarted
        without persistence) starts as soon as this worker is free. Their own messages, when they
        still exist, later find them done and are dropped. A job another worker claims first is
        simply not claimable here."""
        tried: set[str] = set()
        while not self.shutdown.is_set():
            ids = [i for i in self._queued_ids() if i not in tried]
            if not ids:
                return
            tried.add(ids[0])
            self._run_one(ids[0])

    def _run_one(self, job_id: str) -> str:
        """Claim, then verify, reserve, train, record. Whatever goes wrong ends the job `failed` with
        a code; nothing leaves it `running` behind a worker that moved on."""
        pinned = self._claim(job_id)
        if pinned is None:
            return "dropped"
        run = CurrentRun(job_id, int(pinned.effective_config.get("epochs") or 1), pinned.attempt)
        run.fence = JobFence(self, job_id, pinned.attempt, _run_identity(pinned))
        self.run = run
        try:
            return self._verify_and_train(pinned)
        except OwnershipLost:
            # The one line a stale run logs: it recorded nothing, the current owner records all.
            log.warning(
                "job %s: claim %d was superseded by a later claim; this run stopped and recorded nothing",
                pinned.job_id,
                pinned.attempt,
            )
            return "lost"
        except STORE_UNREACHABLE:
            # The store stayed unreachable through the retries: the outcome cannot be recorded
            # now. Our lease runs out and the reconciler settles the job from what is on disk
            # (the published adapter, the newest checkpoint) or fails it `worker_lost`.
            log.exception(
                "job %s: the job store is unreachable; leaving the job to the reconciler", pinned.job_id
            )
            raise
        except Exception as exc:
            log.exception("job %s: the worker failed", pinned.job_id)
            self.recording.finish_failed(
                pinned.job_id,
                WORKER_ERROR_REASON,
                f"worker error: {type(exc).__name__}: {exc}",
                code=WORKER_ERROR_CODE,
            )
            return "failed"
        finally:
            self.run = None
            try:
                self.transact(
                    lambda s, _: store.heartbeat_runner(
                        s, self.worker_id, state=states.RUNNER_READY, current_job_id=None
                    )
                )
            except Exception:
                log.exception("could not mark runner ready")

    def _claim(self, job_id: str) -> PinnedJob | None:
        lease = self.settings.training.lease_seconds

        def claim(s: Session, retried: bool) -> tuple[PinnedJob, int] | None:
            job = store.claim_job(s, job_id, self.worker_id, lease)
            if job is None:
                current = store.get_job(s, job_id, include_deleted=True)
                if not (retried and current is not None and self._claimed_by_lost_commit(s, current)):
                    log.info(
                        "job %s not claimable (state %s); message dropped",
                        job_id,
                        current.state if current else None,
                    )
                    return None
                job = current
            store.heartbeat_runner(s, self.worker_id, state=states.RUNNER_BUSY, current_job_id=job_id)
            ended = job.attempts - 1  # the deliveries before this claim
            history = store.attempt_history(s, job_id)
            stalled = store.stalled_deliveries(ended, store.count_graceful_releases(s, job_id), history)
            return pin_job(s, job), stalled

        claimed = self.transact(claim)
        if claimed is None:
            return None
        pinned, stalled = claimed  # ended deliveries that made no progress (docs/recovery.md)
        if stalled >= self.settings.training.max_attempts:
            self.recording.finish_failed(
                pinned.job_id,
                states.REASON_WORKER_LOST,
                f"gave up after {stalled} deliveries that ended without progress (max_attempts "
                f"{self.settings.training.max_attempts})",
            )
            return None
        return pinned

    def _claimed_by_lost_commit(self, s: Session, job) -> bool:
        """An earlier claim attempt of ours committed but its answer was lost: the job runs under
        this worker, which runs nothing else, and its newest event is that claim."""
        if job.state != states.RUNNING or job.worker_id != self.worker_id or self.run is not None:
            return False
        last = store.last_event(s, job.id)
        return (
            last is not None
            and last.kind == states.EVENT_STARTED
            and (last.data or {}).get("worker_id") == self.worker_id
        )

    def _verify_and_train(self, pinned: PinnedJob) -> str:
        try:
            work = verify_plan(pinned, self.resident, self.settings)
        except PlanDrift as exc:
            log.error("job %s: plan drift: %s", pinned.job_id, exc)
            self.recording.finish_failed(pinned.job_id, PLAN_DRIFT, str(exc), code=PLAN_DRIFT_CODE)
            return "failed"
        self.recording.event(pinned.job_id, states.EVENT_PLAN_VERIFIED, "pinned plan re-verified at dequeue")
        self._withdraw_unrecorded_leftovers(pinned, work)
        shortfall = self._reserve(pinned)
        if shortfall is not None:
            self.recording.finish_failed(pinned.job_id, "oom", shortfall, code=RESERVATION_FAILED_CODE)
            return "failed"
        try:
            result = self._train(pinned, work)
        except KilnError as exc:  # refused before training (e.g. a name taken since admission)
            self.recording.finish_failed(pinned.job_id, "training_error", exc.message, code=exc.code)
            return "failed"
        return self._record_result(pinned, result)

    def _record_result(self, pinned: PinnedJob, result: TrainResult) -> str:
        run = self._run_of(pinned.job_id)
        if run.store_error is not None:
            raise run.store_error  # left to the reconciler, like any outcome the store cannot take
        stopped_by_shutdown = self.shutdown.is_set() and not run.cancel.is_set()
        if result.status != "success" and result.failure_reason == "cancelled" and stopped_by_shutdown:
            return self._release_for_resume(pinned.job_id)
        return self.recording.record_result(pinned, result)

    def _release_for_resume(self, job_id: str) -> str:
        """Worker shutdown mid-job: the checkpoint is written; expire our lease so the reconciler
        (here after a restart, or on another worker) resumes the job from it."""
        attempt = self.run.attempt if self.run is not None else None
        with self.lease_lock:  # no heartbeat renews the lease we are about to expire
            self.run = None
        if not self.recording.release(job_id, attempt):
            return "lost"
        self.reconciler.run_once()
        return "requeued"

    def _train(self, pinned: PinnedJob, work) -> TrainResult:
        return train_sft(
            TrainRequest(
                resident=self.resident,
                config=work.config,
                ingestion=work.ingestion,
                loss_route=pinned.loss_route,
                output_root=self.settings.adapters_dir,
                adapter_name=pinned.adapter_name,
                progress=lambda report: self.recording.on_step(pinned.job_id, report),
                should_stop=lambda: self._should_stop(pinned.job_id),
                checkpoint_plan=work.checkpoint_plan,
                resume_checkpoint=work.resume_path,
                on_checkpoint=lambda record: self.recording.on_checkpoint(pinned.job_id, record),
                run_id=pinned.job_id[:8] + "-" + uuid.uuid4().hex[:6],
                fence=self._run_of(pinned.job_id).fence,
                validation=work.validation,
                on_evaluation=lambda evaluation: self.recording.on_evaluation(pinned.job_id, evaluation),
                requested_config=pinned.requested_config,
                attempts={
                    "attempt": pinned.attempt,
                    "earlier": self.transact(lambda s, _: store.attempt_history(s, pinned.job_id)),
                },
            )
        )

    def _withdraw_unrecorded_leftovers(self, pinned: PinnedJob, work) -> None:
        """Checkpoints of this job's run beyond where this attempt starts that no row records
        (a lost or stale attempt published them and never recorded them) are withdrawn before
        training: this attempt writes and records those steps again. The reconciler does the
        same when it requeues, but may not have lived to. A submission that resumes another
        job's checkpoint never touches that job's files (they are recorded to it)."""
        fence = self._run_of(pinned.job_id).fence
        start = work.resume_path.name if work.resume_path is not None else None
        stale = unrecorded_checkpoints_beyond(
            self.settings.adapters_dir, start, set(pinned.recorded_checkpoints), fence.identity
        )
        for path in stale:
            manifest = _manifest_or_none(path)
            if manifest is None or not fence.leftover_checkpoint(path.name, manifest):
                continue
            log.warning(
                "job %s: withdrawing %s (published by an earlier attempt, never recorded)",
                pinned.job_id,
                path.name,
            )
            hidden = grab_leftover(path, fence)
            if hidden is not None:
                shutil.rmtree(hidden, ignore_errors=True)

    def _reserve(self, pinned: PinnedJob) -> str | None:
        """Admission priced the step; check the device still has that much before touching it."""
        backend, memory = self.resident.backend, self.settings.memory
        available = memory_budget(
            backend,
            device_memory(backend.device),
            reserve_gb=memory.reserve_gb,
            training_memory_gb=memory.training_memory_gb,
        )
        if available is None or pinned.memory_estimate_bytes <= available:
            return None
        gib = 2**30
        return (
            f"memory reservation failed at dequeue: the admitted working set needs "
            f"{pinned.memory_estimate_bytes / gib:.2f} GB but only {available / gib:.2f} GB is available now"
        )

    def _should_stop(self, job_id: str) -> bool:
        run = self.run
        return self.shutdown.is_set() or (run is not None and run.job_id == job_id and run.cancel.is_set())

    def _run_of(self, job_id: str) -> CurrentRun:
        return held_run(self.run, job_id)


def _run_identity(pinned: PinnedJob) -> RunIdentity:
    return RunIdentity(
        adapter_name=pinned.adapter_name,
        seed=pinned.effective_seed,
        corpus_sha256=pinned.kept_corpus_sha256,
        total_steps=pinned.total_steps,
    )


def _manifest_or_none(path: Path):
    try:
        return ckpt.read_checkpoint_manifest(path)[0]
    except ckpt.CheckpointError:
        return None
