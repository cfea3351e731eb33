"""The Celery task: a doorbell that hands the job id to the process's resident runtime."""

from __future__ import annotations

from worker.celery_app import TRAIN_SFT_TASK, celery_app

_RUNTIME = None


def install_runtime(runtime) -> None:
    """Bind the resident runtime this worker process serves jobs with (set by `kiln worker`)."""
    global _RUNTIME
    _RUNTIME = runtime


@celery_app.task(name=TRAIN_SFT_TASK, ignore_result=True, acks_late=True)
def train_sft_task(job_id: str) -> str:
    if _RUNTIME is None:
        raise RuntimeError("no resident runtime in this process; start workers with `kiln worker`")
    return _RUNTIME.run_job(job_id)
