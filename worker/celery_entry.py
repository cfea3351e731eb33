"""The module-level Celery app for `celery -A worker.celery_entry ...` (Flower, inspection).

Importing this module reads the process's settings (kiln.toml / KILN_*); nothing else imports it.
"""

from __future__ import annotations

from kiln.settings import load_settings
from worker.celery_app import make_celery

app = make_celery(load_settings().settings)
