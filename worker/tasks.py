"""The Celery task: a queue message that hands the job id to the process's resident runtime."""

from __future__ import annotations

from celery import Celery, Task
from celery.exceptions import Reject

from kiln.broker import TRAIN_SFT_TASK
from kiln.store.errors import STORE_UNREACHABLE

# The job store stayed unreachable through the runtime's own retries: deliver the message again
# later. Acknowledging the failure instead would lose it, and a published queued row is not
# something the reconciler republishes.
STORE_DOWN_RETRY_SECONDS = 15

_RUNTIME = None


def install_runtime(runtime) -> None:
    """Bind the resident runtime this worker process serves jobs with (set by `kiln worker`)."""
    global _RUNTIME
    _RUNTIME = runtime


def train_sft(task: Task, job_id: str) -> str:
    """Run one delivery of `job_id` on the installed runtime (bound: `task` is the Celery task)."""
    if _RUNTIME is None:
        raise RuntimeError("no resident runtime in this process; start workers with `kiln worker`")
    try:
        outcome = _RUNTIME.run_job(job_id)
    except STORE_UNREACHABLE as exc:
        raise task.retry(exc=exc, countdown=STORE_DOWN_RETRY_SECONDS) from exc
    if outcome == "deferred":
        # Shutting down: hand the message back unacknowledged for the next worker to take.
        raise Reject(f"worker shutting down; job {job_id} left queued", requeue=True)
    return outcome


def register_tasks(app: Celery) -> None:
    """Register the training task on `app` under its published name."""
    app.task(bind=True, name=TRAIN_SFT_TASK, ignore_result=True, acks_late=True, max_retries=None)(train_sft)
