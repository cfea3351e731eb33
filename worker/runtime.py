"""The resident worker runtime: claim, re-verify, reserve, train, record (DESIGN §1).

One process holds the base model resident between jobs. A message is only a doorbell: the job
row decides. A redelivered message whose row is not `queued` is dropped; a claim is one
conditional UPDATE with a lease that a heartbeat thread renews; progress, the loss curve,
checkpoints and the final state are written as they happen.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from kiln import store
from kiln.settings import Settings
from kiln.store import states
from kiln_train.errors import KilnError
from kiln_train.memory import available_budget
from kiln_train.provenance import file_digest
from kiln_train.resident import ResidentModel
from kiln_train.trainer import train_sft
from kiln_train.trainer_support import StepReport, TrainResult
from worker.reconciler import Reconciler
from worker.runner import device_memory, heartbeat_file, runner_registration
from worker.verify import PLAN_DRIFT, PLAN_DRIFT_CODE, PinnedJob, PlanDrift, verify_plan

log = logging.getLogger(__name__)

RESERVATION_FAILED_CODE = "training_will_not_fit"


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
        self.engine = store.make_engine(settings.database_url, echo=settings.database.echo)
        self.factory = store.session_factory(self.engine)
        self.celery = celery
        self.current_job: str | None = None
        self.current_epochs: int | None = None
        self.cancel_flag = threading.Event()
        self.shutdown = threading.Event()
        self._stop_threads = threading.Event()
        self._threads: list[threading.Thread] = []
        self.reconciler = Reconciler(self)

    # ----- life cycle ----------------------------------------------------------------------
    def start(self, *, threads: bool = True) -> None:
        """Register the runner row, reconcile once, start the heartbeat and reconciler threads."""
        self.settings.ensure_dirs()
        with self.factory.begin() as s:
            store.register_runner(s, self.worker_id, **runner_registration(self.resident))
        self.touch_heartbeat_file()
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

    def heartbeat(self) -> None:
        free, _ = device_memory(self.resident.backend.device)
        job = self.current_job
        with self.factory.begin() as s:
            store.heartbeat_runner(
                s,
                self.worker_id,
                free_memory_bytes=free,
                state=states.RUNNER_BUSY if job else states.RUNNER_READY,
                current_job_id=job,
            )
            if job is not None:
                try:
                    if store.renew_lease(s, job, self.worker_id, self.settings.training.lease_seconds):
                        self.cancel_flag.set()
                except store.LeaseLost:
                    log.warning("lease on job %s lost", job)
        self.touch_heartbeat_file()

    def _reconcile_loop(self) -> None:
        while not self._stop_threads.wait(self.settings.training.reconcile_interval_seconds):
            try:
                self.reconciler.run_once()
            except Exception:
                log.exception("reconciler pass failed")

    # ----- one job -------------------------------------------------------------------------
    def run_job(self, job_id: str) -> str:
        """Handle one doorbell; returns what happened to `job_id` (`dropped`, `completed`, `failed`,
        `requeued`).

        Messages can leave the api out of admission order (concurrent admissions publish after
        their commits), so a doorbell first runs every older queued job: execution follows
        `queue_seq`, strictly FIFO. The older jobs' own doorbells later find them done and drop.
        """
        while not self.shutdown.is_set():
            older = self._oldest_queued_before(job_id)
            if older is None:
                break
            self._run_one(older)
        return self._run_one(job_id)

    def _oldest_queued_before(self, job_id: str) -> str | None:
        with self.factory() as s:
            queued = store.list_queued(s)
        ids = [j.id for j in queued if not j.cancel_requested]
        if job_id not in ids:
            return None
        position = ids.index(job_id)
        return ids[0] if position > 0 else None

    def _run_one(self, job_id: str) -> str:
        pinned = self._claim(job_id)
        if pinned is None:
            return "dropped"
        self.current_job = job_id
        self.current_epochs = pinned.effective_config.get("epochs", 1)
        self.cancel_flag.clear()
        try:
            return self._execute(pinned)
        finally:
            self.current_job = None
            try:
                with self.factory.begin() as s:
                    store.heartbeat_runner(s, self.worker_id, state=states.RUNNER_READY, current_job_id=None)
            except Exception:
                log.exception("could not mark runner ready")

    def _claim(self, job_id: str) -> PinnedJob | None:
        lease = self.settings.training.lease_seconds
        with self.factory.begin() as s:
            job = store.claim_job(s, job_id, self.worker_id, lease)
            if job is None:
                current = store.get_job(s, job_id, include_deleted=True)
                log.info(
                    "job %s not claimable (state %s); message dropped",
                    job_id,
                    current.state if current else None,
                )
                return None
            store.heartbeat_runner(s, self.worker_id, state=states.RUNNER_BUSY, current_job_id=job_id)
            adm = store.get_admission(s, job_id)
            recorded = {c.basename: c.manifest_sha256 for c in store.list_checkpoints(s, job_id)}
            pinned = PinnedJob(
                job_id=job.id,
                adapter_name=job.adapter_name,
                effective_seed=job.effective_seed,
                resume_checkpoint=job.resume_checkpoint,
                loss_route=adm.loss_route,
                execution_identity_digest=adm.execution_identity_digest,
                effective_config=dict(adm.effective_config),
                checkpoint_plan=dict(adm.checkpoint_plan),
                ingestion_receipt_sha256=adm.ingestion_receipt_sha256,
                kept_corpus_sha256=adm.kept_corpus_sha256,
                data_source=adm.data_source,
                examples=adm.examples,
                dataset_path=adm.dataset_path,
                memory_estimate_bytes=int(adm.memory_estimate_bytes),
                recorded_checkpoints=recorded,
            )
            attempts = job.attempts
        if attempts > self.settings.training.max_attempts:
            self._finish_failed(
                pinned.job_id,
                states.REASON_WORKER_LOST,
                f"gave up after {attempts - 1} deliveries that did not finish (max_attempts "
                f"{self.settings.training.max_attempts})",
            )
            return None
        return pinned

    def _execute(self, pinned: PinnedJob) -> str:
        try:
            work = verify_plan(pinned, self.resident, self.settings)
        except PlanDrift as exc:
            log.error("job %s: plan drift: %s", pinned.job_id, exc)
            self._finish_failed(pinned.job_id, PLAN_DRIFT, str(exc), code=PLAN_DRIFT_CODE)
            return "failed"
        self._event(pinned.job_id, states.EVENT_PLAN_VERIFIED, "pinned plan re-verified at dequeue")
        shortfall = self._reserve(pinned)
        if shortfall is not None:
            self._finish_failed(pinned.job_id, "oom", shortfall, code=RESERVATION_FAILED_CODE)
            return "failed"
        try:
            result = self._train(pinned, work)
        except KilnError as exc:  # refused before training (e.g. a name taken since admission)
            self._finish_failed(pinned.job_id, "training_error", exc.message, code=exc.code)
            return "failed"
        return self._record_result(pinned, result)

    def _train(self, pinned: PinnedJob, work) -> TrainResult:
        return train_sft(
            self.resident,
            work.config,
            work.ingestion,
            loss_route=pinned.loss_route,
            output_root=self.settings.adapters_dir,
            adapter_name=pinned.adapter_name,
            progress=lambda report: self._on_step(pinned.job_id, report),
            should_stop=lambda: self.cancel_flag.is_set() or self.shutdown.is_set(),
            checkpoint_plan=work.checkpoint_plan,
            resume_checkpoint=work.resume_path,
            on_checkpoint=lambda record: self._on_checkpoint(pinned.job_id, record),
            run_id=pinned.job_id[:8] + "-" + uuid.uuid4().hex[:6],
        )

    def _reserve(self, pinned: PinnedJob) -> str | None:
        """Admission priced the step; check the device still has that much before touching it."""
        backend = self.resident.backend
        free, total = device_memory(backend.device)
        if free is None:
            return None
        available = available_budget(
            backend,
            total_bytes=total or free,
            free_bytes=free,
            reserve_gb=self.settings.memory.reserve_gb,
            training_memory_gb=self.settings.memory.training_memory_gb,
        )
        if pinned.memory_estimate_bytes <= available:
            return None
        gib = 2**30
        return (
            f"memory reservation failed at dequeue: the admitted working set needs "
            f"{pinned.memory_estimate_bytes / gib:.2f} GB but only {available / gib:.2f} GB is available now"
        )

    def _on_step(self, job_id: str, report: StepReport) -> None:
        with self.factory.begin() as s:
            cancel = store.record_step(
                s,
                job_id,
                self.worker_id,
                global_step=report.global_step,
                epoch=report.epoch,
                loss=report.loss,
                learning_rate=report.learning_rate,
                step_ms=report.step_ms,
                tokens=report.tokens,
                supervised_tokens=report.supervised_tokens,
                lease_seconds=self.settings.training.lease_seconds,
            )
            epochs = int(self.current_epochs or 1)
            rows = max(1, report.total_steps // epochs)
            if report.global_step % rows == 0:
                store.append_event(
                    s,
                    job_id,
                    states.EVENT_EPOCH_COMPLETE,
                    f"epoch {report.global_step // rows} of {epochs} complete",
                    data={"epoch": report.global_step // rows, "global_step": report.global_step},
                )
        if cancel:
            self.cancel_flag.set()

    def _on_checkpoint(self, job_id: str, record: dict) -> None:
        with self.factory.begin() as s:
            store.record_checkpoint(
                s,
                job_id,
                checkpoint_id=record["checkpoint_id"],
                basename=record["basename"],
                path=record["path"],
                global_step=record["global_step"],
                epoch_index=record["epoch_index"],
                cursor=record["cursor"],
                manifest_sha256="sha256:" + record["manifest_sha256"].removeprefix("sha256:"),
                size_bytes=record["size_bytes"],
                write_ms=record["write_ms"],
            )

    def _event(self, job_id: str, kind: str, message: str, **kw) -> None:
        with self.factory.begin() as s:
            store.append_event(s, job_id, kind, message, **kw)

    def _finish_failed(
        self, job_id: str, reason: str, message: str, *, code: str | None = None, **extra
    ) -> None:
        try:
            with self.factory.begin() as s:
                store.finish_job(
                    s,
                    job_id,
                    states.FAILED,
                    worker_id=self.worker_id,
                    failure_reason=reason,
                    error_code=code,
                    error_message=message,
                    **extra,
                )
        except (store.LeaseLost, store.InvalidTransition) as exc:
            log.warning("job %s could not be failed by this worker: %s", job_id, exc)

    def _record_result(self, pinned: PinnedJob, result: TrainResult) -> str:
        job_id = pinned.job_id
        latest = result.checkpoints[-1]["basename"] if result.checkpoints else None
        common = {
            "global_step": result.global_step,
            "final_loss": result.final_loss,
            "receipt": result.receipt,
            "peak_memory_bytes": result.peak_memory_bytes,
            "wall_clock_ms": result.wall_clock_ms,
            "latest_checkpoint": latest,
        }
        if result.status == "success":
            model_file = result.adapter_path / "adapter_model.safetensors"
            try:
                with self.factory.begin() as s:
                    store.register_adapter(
                        s,
                        name=result.adapter_name,
                        job_id=job_id,
                        path=str(result.adapter_path),
                        size_bytes=sum(p.stat().st_size for p in result.adapter_path.iterdir()),
                        safetensors_sha256=file_digest(model_file),
                        rank=result.receipt["hyperparameters"]["rank"],
                        alpha=result.receipt["hyperparameters"]["alpha"],
                        base_model_sha256=self.resident.base_weights_sha256,
                    )
                    store.finish_job(
                        s,
                        job_id,
                        states.COMPLETED,
                        worker_id=self.worker_id,
                        adapter_path=str(result.adapter_path),
                        **common,
                    )
            except (store.LeaseLost, store.InvalidTransition) as exc:
                log.error("job %s finished but its row moved on: %s", job_id, exc)
                return "lost"
            return "completed"
        if result.failure_reason == "cancelled" and self.shutdown.is_set() and not self.cancel_flag.is_set():
            return self._release_for_resume(job_id)
        self._finish_failed(job_id, result.failure_reason, result.failure_message or "", **common)
        return "failed"

    def _release_for_resume(self, job_id: str) -> str:
        """Worker shutdown mid-job: the checkpoint is written; expire our lease so the reconciler
        (here after a restart, or on another worker) resumes the job from it."""
        with self.factory.begin() as s:
            try:
                store.renew_lease(s, job_id, self.worker_id, 0)
            except store.LeaseLost:
                return "lost"
            store.append_event(
                s, job_id, states.EVENT_REQUEUED, "worker shutting down; released at a checkpoint"
            )
        self.reconciler.run_once()
        return "requeued"
