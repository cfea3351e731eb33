# ruff: noqa: F811  (fixtures imported from tests.api.conftest are used as parameters below)
"""Fixtures for the worker tests: the api's store/broker/model/app fixtures plus a resident runtime.

Jobs are admitted through the real api (Flask test client) so the worker sees exactly what
production admission pins; the runtime runs them in-process (`run_job`), or real `kiln serve`
and `kiln worker` processes do (test_e2e.py).
"""

from __future__ import annotations

import pytest

from tests.api.conftest import (  # noqa: F401  (fixtures re-exported for this package)
    app,
    broker,
    client,
    db_url,
    engine,
    make_settings,
    runner_kwargs,
    sessions,
    storage,
    tiny_model_dir,
)


@pytest.fixture(scope="session")
def resident(tiny_model_dir):
    from kiln_train.train.resident import load_resident

    return load_resident(tiny_model_dir)


@pytest.fixture
def settings(storage, db_url, engine, broker):
    return make_settings(storage, db_url, broker.queue, training={"lease_seconds": 30, "max_attempts": 3})


@pytest.fixture
def runtime(settings, resident):
    from worker.celery_app import make_celery
    from worker.runtime import WorkerRuntime

    rt = WorkerRuntime(settings, resident, celery=make_celery(settings), worker_id="worker-test")
    rt.start(threads=False)
    yield rt
    rt.stop()


@pytest.fixture
def second_worker(settings, resident):
    """Another worker process on the same store and queue."""
    from worker.celery_app import make_celery
    from worker.runtime import WorkerRuntime

    rt = WorkerRuntime(settings, resident, celery=make_celery(settings), worker_id="worker-2")
    rt.start(threads=False)
    yield rt
    rt.stop()
