"""The worker's Celery app, built from the settings it is given.

`make_celery(settings)` is the one way to build it: the broker client of `kiln.broker` with the
training task registered on it. Nothing here reads settings; `worker.celery_entry` holds the
module-level app that `celery -A` (Flower, inspection) needs.
"""

from __future__ import annotations

from celery import Celery

from kiln.broker import make_broker_client
from kiln.settings import Settings
from worker.tasks import register_tasks


def make_celery(settings: Settings) -> Celery:
    app = make_broker_client(settings)
    register_tasks(app)
    return app
