"""What a run writes to the job store while it holds its claim: each step, each validation
evaluation, each published checkpoint, its events, and its outcome (completed with its adapter,
failed with a reason, or released at a checkpoint when the worker shuts down).

`WorkerRuntime` holds one `RunRecording`, built with what the writes need: the runtime's
`transact` (retried through a brief outage), the worker id, the lease length, the resident base
weights' digest and a view of the run the worker holds (`CurrentRun`). Every write checks the
run's claim, so a superseded run records nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from threading import Event
from typing import TypeVar

from sqlalchemy.orm import Session

from kiln import store
from kiln.store import states
from kiln.store.errors import STORE_UNREACHABLE
from kiln_train.artifacts.adapter import ADAPTER_MODEL
from kiln_train.artifacts.fencing import take_back
from kiln_train.errors import OwnershipLost
from kiln_train.ground.digest import file_digest
from kiln_train.train.evaluation import Evaluation
from kiln_train.train.result import StepReport, TrainResult
from worker.fence import JobFence
from worker.verify import PinnedJob

log = logging.getLogger(__name__)
T = TypeVar("T")

# The StepReport fields a `training_steps` row keeps, under the same names.
STEP_COLUMNS = ("global_step", "epoch", "loss", "learning_rate", "step_ms", "tokens", "supervised_tokens")


@dataclass
class CurrentRun:
    """The job this worker is running (under which claim: the fence) and the flags other threads
    raise for exactly that run (a late heartbeat for the previous job must not cancel the next)."""

    job_id: str
    epochs: int
    attempt: int  # the claim number this run holds (`attempts` after its claim)
    fence: JobFence | None = None
    cancel: Event = field(default_factory=Event)
    lease_lost: Event = field(default_factory=Event)
    store_error: Exception | None = None  # the store stayed down while recording progress

    @property
    def key(self) -> tuple[str, int]:
        return self.job_id, self.attempt


def held_run(run: CurrentRun | None, job_id: str) -> CurrentRun:
    """`run` when it is `job_id`'s; otherwise this worker no longer holds that job."""
    if run is None or run.job_id != job_id:
        raise OwnershipLost(f"job {job_id} is not the run this worker holds")
    return run


class RunRecording:
    """The store writes of the run a worker holds."""

    def __init__(
        self,
        *,
        transact: Callable[[Callable[[Session, bool], T]], T],
        worker_id: str,
        lease_seconds: int,
        base_weights_sha256: str,
        current_run: Callable[[], CurrentRun | None],
    ) -> None:
        self.transact = transact
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.base_weights_sha256 = base_weights_sha256
        self.current_run = current_run

    def _run_of(self, job_id: str) -> CurrentRun:
        return held_run(self.current_run(), job_id)

    def on_step(self, job_id: str, report: StepReport) -> None:
        """Record one step (loss curve, progress, lease, runner heartbeat) under this run's claim;
        the trainer publishes the step's checkpoint after this. A superseded claim raises
        `LeaseLost`: the trainer stops here, at the step boundary, having recorded nothing."""
        run = self._run_of(job_id)
        if run.lease_lost.is_set():
            raise store.LeaseLost(job_id, self.worker_id)
        lease = self.lease_seconds
        rows = max(1, report.total_steps // max(1, run.epochs))

        def write(s: Session, retried: bool) -> bool:
            if retried and store.step_recorded(s, job_id, report.global_step):
                return store.renew_lease(s, job_id, self.worker_id, lease, attempt=run.attempt)
            cancel = store.record_step(
                s,
                job_id,
                self.worker_id,
                **{name: getattr(report, name) for name in STEP_COLUMNS},
                lease_seconds=lease,
                attempt=run.attempt,
            )
            store.heartbeat_runner(s, self.worker_id, state=states.RUNNER_BUSY, current_job_id=job_id)
            if report.global_step % rows == 0:
                store.append_event(
                    s,
                    job_id,
                    states.EVENT_EPOCH_COMPLETE,
                    f"epoch {report.global_step // rows} of {run.epochs} complete",
                    data={"epoch": report.global_step // rows, "global_step": report.global_step},
                )
            return cancel

        if self._transact_for_run(run, write):
            run.cancel.set()

    def on_evaluation(self, job_id: str, evaluation: Evaluation) -> None:
        """Record one validation evaluation (a `validation_evaluations` row and its event) under
        this run's claim, before the step's checkpoint is published; a superseded claim raises
        `LeaseLost` and records nothing."""
        run = self._run_of(job_id)
        if run.lease_lost.is_set():
            raise store.LeaseLost(job_id, self.worker_id)
        lease = self.lease_seconds
        record = {
            **evaluation.to_json(),
            "supervised_tokens": evaluation.supervised_tokens,
            "rows": evaluation.rows,
        }

        def write(s: Session, retried: bool) -> None:
            if retried and store.evaluation_recorded(s, job_id, evaluation.global_step):
                return
            store.record_evaluation(s, job_id, self.worker_id, record, attempt=run.attempt)
            store.renew_lease(s, job_id, self.worker_id, lease, attempt=run.attempt)
            what = (
                "baseline (base model)" if evaluation.global_step == 0 else f"step {evaluation.global_step}"
            )
            store.append_event(
                s,
                job_id,
                states.EVENT_VALIDATION_EVALUATED,
                f"validation at {what}: loss {evaluation.loss:.4f}, token accuracy "
                f"{evaluation.token_accuracy:.4f}",
                data=record,
            )

        self._transact_for_run(run, write)

    def _transact_for_run(self, run: CurrentRun, write: Callable[[Session, bool], T]) -> T:
        """`transact(write)` for a callback of the running job: a superseded claim marks the run
        lost; an unreachable store is kept on the run, since it is not the job's fault: the job is
        resumed, not failed (the reconciler settles it)."""
        try:
            return self.transact(write)
        except store.LeaseLost:
            run.lease_lost.set()
            raise
        except STORE_UNREACHABLE as exc:
            run.store_error = exc
            raise

    def on_checkpoint(self, job_id: str, record: dict) -> None:
        """A checkpoint was published (its step is already recorded): record it under this run's
        claim. A superseded claim raises `LeaseLost`; the checkpoint passed its fence checks, so it
        stays for the current owner, who adopts or withdraws it."""
        run = self._run_of(job_id)
        if run.lease_lost.is_set():
            raise store.LeaseLost(job_id, self.worker_id)
        lease = self.lease_seconds

        def write(s: Session, retried: bool) -> None:
            store.renew_lease(s, job_id, self.worker_id, lease, attempt=run.attempt)
            record_checkpoint(s, job_id, record)

        try:
            self.transact(write)
        except store.LeaseLost:
            run.lease_lost.set()
            raise

    def event(self, job_id: str, kind: str, message: str, **kw) -> None:
        """An event of the running job, written only while this run's claim holds it."""
        run = self._run_of(job_id)

        def write(s: Session, _: bool) -> None:
            store.require_owner(s, job_id, self.worker_id, run.attempt)
            store.append_event(s, job_id, kind, message, **kw)

        self.transact(write)

    def finish_failed(
        self, job_id: str, reason: str, message: str, *, code: str | None = None, **extra
    ) -> None:
        run = self.current_run()
        attempt = run.attempt if run is not None and run.job_id == job_id else None
        try:
            self.transact(
                lambda s, _: store.finish_job(
                    s,
                    job_id,
                    states.FAILED,
                    worker_id=self.worker_id,
                    attempt=attempt,
                    failure_reason=reason,
                    error_code=code,
                    error_message=message,
                    **extra,
                )
            )
        except (store.LeaseLost, store.InvalidTransition) as exc:
            log.warning("job %s could not be failed by this worker: %s", job_id, exc)

    def record_result(self, pinned: PinnedJob, result: TrainResult) -> str:
        """Record a finished run: `completed` with its adapter, or `failed` with its reason."""
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
            return self._complete(pinned, result, common)
        self.finish_failed(pinned.job_id, result.failure_reason, result.failure_message or "", **common)
        return "failed"

    def _complete(self, pinned: PinnedJob, result: TrainResult, common: dict) -> str:
        job_id, run = pinned.job_id, self._run_of(pinned.job_id)
        model_file = result.adapter_path / ADAPTER_MODEL
        size = sum(p.stat().st_size for p in result.adapter_path.iterdir())
        digest = file_digest(model_file)

        def complete(s: Session, retried: bool) -> None:
            if retried:
                job = store.get_job(s, job_id, include_deleted=True)
                if job is not None and job.state == states.COMPLETED and job.worker_id == self.worker_id:
                    return  # the earlier attempt committed
            store.require_owner(s, job_id, self.worker_id, run.attempt)
            store.register_adapter(
                s,
                name=result.adapter_name,
                job_id=job_id,
                path=str(result.adapter_path),
                size_bytes=size,
                safetensors_sha256=digest,
                rank=result.receipt["hyperparameters"]["rank"],
                alpha=result.receipt["hyperparameters"]["alpha"],
                base_model_sha256=self.base_weights_sha256,
            )
            store.finish_job(
                s,
                job_id,
                states.COMPLETED,
                worker_id=self.worker_id,
                attempt=run.attempt,
                adapter_path=str(result.adapter_path),
                **common,
            )

        try:
            self.transact(complete)
        except (store.LeaseLost, store.InvalidTransition):
            self._settle_unrecorded_adapter(pinned, result.adapter_path)
            raise OwnershipLost(f"job {job_id}: claim {run.attempt} no longer holds the job") from None
        return "completed"

    def _settle_unrecorded_adapter(self, pinned: PinnedJob, path: Path) -> None:
        """Our claim was superseded after the adapter passed its fence checks. When the
        reconciler completed the job from exactly this adapter it stays; otherwise the directory
        this run renamed (and only that one, by inode) is taken back for the current owner."""
        adapter = self.transact(lambda s, _: store.get_adapter(s, pinned.adapter_name))
        if adapter is not None and adapter.job_id == pinned.job_id:
            return
        identity = self._run_of(pinned.job_id).fence.renamed_dirs.get(path)
        if identity is not None:
            take_back(path, identity)

    def release(self, job_id: str, attempt: int | None) -> bool:
        """Expire this claim's lease at a checkpoint (worker shutdown), so the job is resumed;
        False when the claim no longer held the job."""

        def release(s: Session, _: bool) -> bool:
            try:
                store.renew_lease(s, job_id, self.worker_id, 0, attempt=attempt)
            except store.LeaseLost:
                return False
            # Marked `released`: a graceful release is not a lost delivery, so it does not count
            # against max_attempts (a rolling deploy must not fail a job that never crashed).
            store.append_event(
                s,
                job_id,
                states.EVENT_REQUEUED,
                "worker shutting down; released at a checkpoint",
                data={"released": True, "worker_id": self.worker_id},
            )
            return True

        return self.transact(release)


def record_checkpoint(s: Session, job_id: str, record: dict) -> None:
    """The `checkpoints` row of a published checkpoint (idempotent: a retried write whose commit
    went through finds it)."""
    if store.get_checkpoint(s, job_id, record["basename"]) is not None:
        return
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
