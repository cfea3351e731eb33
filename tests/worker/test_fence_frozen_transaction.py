"""A worker frozen inside a transaction (between recording a step and committing it) holds its
job's row lock. The job must still be taken over once the lease runs out: Postgres ends the
frozen session after the lease (kiln/store/engine.py), the reconciler of another worker requeues
the job, that worker completes it, and the frozen worker, let go, records nothing.

Postgres only: row locks and the server-side idle timeout are Postgres features (on SQLite the
embedded deployment runs one worker).
"""

from __future__ import annotations

import threading
import time

import pytest

from kiln import store
from kiln.store import states
from kiln_train.artifacts import adapter as adapter_module
from tests.api.conftest import make_settings, sft_body, unique_name
from tests.kiln.store.store_support import migrated_database
from tests.worker.runtime_support import checkpoint_names, event_kinds, job_row, steps, submit
from tests.worker.test_fence import reference_adapter, run_in_thread

pytestmark = pytest.mark.postgres

LEASE_SECONDS = 5


@pytest.fixture(scope="module")
def db_url(tmp_path_factory):
    with migrated_database("postgres", tmp_path_factory.mktemp("db")) as url:
        yield url


@pytest.fixture
def settings(storage, db_url, engine, broker):
    training = {"lease_seconds": LEASE_SECONDS, "heartbeat_seconds": 1, "runner_stale_seconds": 10}
    return make_settings(storage, db_url, broker.queue, training=training)


def reconcile_until_requeued(worker, job_id: str, sessions, timeout: float) -> threading.Thread:
    """Run `worker`'s reconciler passes in a thread until the job leaves `running` (a pass
    blocked on a row lock blocks the thread, which the caller sees as a timeout)."""

    def target() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and job_row(sessions, job_id).state == states.RUNNING:
            worker.reconciler.run_once()
            time.sleep(0.2)

    thread = threading.Thread(target=target, name="reconciler", daemon=True)
    thread.start()
    return thread


def test_an_owner_frozen_inside_its_step_transaction_is_taken_over_after_the_lease(
    client, runtime, second_worker, sessions, settings, monkeypatch
):
    name = unique_name("frozen-tx")
    body = sft_body(3, epochs=2, checkpoint_interval=2, seed=25, output_name=name)
    expected = reference_adapter(client, second_worker, settings, body)
    job_id = submit(client, body)
    runtime.db_retry_delays = (0.1, 0.2)
    reached, release = threading.Event(), threading.Event()
    original = store.record_step

    def record_step(session, jid, worker_id, **values):
        cancel = original(session, jid, worker_id, **values)  # the job row is now locked
        if values["global_step"] == 3 and threading.current_thread().name == "stale-worker":
            reached.set()
            assert release.wait(120), "the frozen worker was never let go"
        return cancel

    monkeypatch.setattr(store, "record_step", record_step)
    thread, out = run_in_thread(runtime, job_id, "stale-worker")
    try:
        assert reached.wait(120)
        frozen_at = time.monotonic()
        reconciler = reconcile_until_requeued(second_worker, job_id, sessions, timeout=60)
        reconciler.join(90)
        assert not reconciler.is_alive(), "the reconciler is still waiting on the frozen worker's lock"
        taken_over = time.monotonic() - frozen_at
        job = job_row(sessions, job_id)
        resumes = f"{name}-checkpoint-step-00000002.kiln-checkpoint"
        assert job.state == states.QUEUED and job.resume_checkpoint == resumes
        assert taken_over < 4 * LEASE_SECONDS
        assert second_worker.run_job(job_id) == "completed"
    finally:
        release.set()
    thread.join(120)
    assert out["outcome"] == "lost"

    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.attempts == 2 and job.failure_reason is None
    assert job.worker_id == second_worker.worker_id
    assert steps(sessions, job_id) == [1, 2, 3, 4, 5, 6]  # the frozen step 3 was rolled back
    kinds = event_kinds(sessions, job_id)
    assert kinds.count("started") == 2 and kinds.count("completed") == 1 and kinds[-1] == "completed"
    assert "failed" not in kinds
    assert checkpoint_names(settings, name) == [
        f"{name}-checkpoint-step-0000000{step}.kiln-checkpoint" for step in (2, 4)
    ]
    assert (settings.adapters_dir / name / adapter_module.ADAPTER_MODEL).read_bytes() == expected
    assert [p.name for p in settings.adapters_dir.iterdir() if p.name.startswith(".")] == []
