"""The broker client: Celery's settings for Kiln, the task name, and publishing a job.

Torch-free and worker-free, so the api publishes through it without importing `worker`. The
worker builds its own app from the same settings (`worker.celery_app.make_celery`) and registers
the task on it. Settings for hour-long GPU jobs: late ack, prefetch 1, concurrency 1, the Redis
visibility timeout raised on every setting that carries it, task events on for Flower, one
dedicated queue. The database row is the truth; the message only carries the job id (and
`task_id` equals it).
"""

from __future__ import annotations

from celery import Celery

from kiln.settings import Settings
from kiln.settings.broker_url import kombu_url

TRAIN_SFT_TASK = "kiln.train_sft"


def celery_config(settings: Settings) -> dict:
    vt = settings.queue.visibility_timeout_s
    url = kombu_url(settings.broker_url)
    # The visibility timeout is a Redis (and SQS) notion; kombu's SQLAlchemy transport passes
    # transport options straight to create_engine, so it gets none.
    transport = {"visibility_timeout": vt} if url.startswith(("redis", "rediss", "sqs")) else {}
    return {
        "broker_url": url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": transport,
        "result_backend": None,
        "result_backend_transport_options": transport,
        "visibility_timeout": vt,
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_track_started": True,
        "task_send_sent_event": True,
        "worker_send_task_events": True,
        "worker_prefetch_multiplier": 1,
        "worker_concurrency": 1,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_soft_shutdown_timeout": 60.0,
        "worker_hijack_root_logger": False,
        "task_default_queue": settings.queue.queue_name,
        "task_routes": {TRAIN_SFT_TASK: {"queue": settings.queue.queue_name}},
        "task_serializer": "json",
        "accept_content": ["json"],
    }


def make_broker_client(settings: Settings) -> Celery:
    """A Celery app configured for `settings` that publishes and revokes; it runs no tasks."""
    app = Celery("kiln")
    app.conf.update(celery_config(settings))
    return app


def publish_job(app: Celery, job_id: str, queue: str) -> None:
    """Publish the queue message of a committed job (task_id = job_id, so duplicates are visible)."""
    app.send_task(TRAIN_SFT_TASK, args=[job_id], task_id=job_id, queue=queue)
