"""Crash and restart probes of the worker's recovery paths (DESIGN §1: nothing admitted is ever
lost, a job never runs twice, its row ends truthful).

- A doorbell lost with the broker (Redis restarted without persistence, or flushed; or the
  unacked doorbell of a newer job held by a worker that died while running an older job first)
  left a published `queued` row waiting forever: the reconciler only republished rows whose
  message never went out.
- Warm shutdowns (a rolling deploy) each counted as a failed delivery: the third graceful
  release of one job failed it `worker_lost` although nothing had crashed.
- A reconciler killed between requeueing a job and withdrawing the checkpoint its dead worker
  had published but never recorded: the resumed run then reached that name and failed.

Real store (SQLite and Postgres) and real Redis; `Killed` stands in for SIGKILL at an exact point.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from kiln import store
from kiln.store import states
from kiln.store.models import Job
from kiln_train import checkpoint as ckpt
from tests.api.conftest import sft_body, unique_name
from tests.worker.test_failures_runtime import Killed, checkpoint_names, expire_lease
from tests.worker.test_runtime import event_kinds, job_row, steps, submit


def _age_doorbell(sessions, runtime, job_id: str, seconds: float = 300) -> None:
    """The job was published `seconds` ago and the worker has been idle since then."""
    past = store.utcnow() - timedelta(seconds=seconds)
    with sessions.begin() as s:
        s.execute(update(Job).where(Job.id == job_id).values(submitted_at=past, published_at=past))
    runtime.idle_since = past - timedelta(seconds=1)


def test_a_doorbell_lost_with_the_broker_is_rung_again(client, runtime, sessions, broker):
    job_id = submit(client, sft_body(2, output_name=unique_name("flushed")))
    assert broker.task_ids() == [job_id]
    broker.client.delete(broker.queue)  # Redis restarted without persistence: the message is gone
    assert broker.task_ids() == []
    _age_doorbell(sessions, runtime, job_id)
    assert runtime.reconciler.run_once()["republished"] == 1
    assert broker.task_ids() == [job_id]
    assert "republished" in event_kinds(sessions, job_id)
    # Stamped: the next pass does not ring it again.
    assert runtime.reconciler.run_once()["republished"] == 0
    assert broker.task_ids() == [job_id]
    assert runtime.run_job(job_id) == "completed"
    assert job_row(sessions, job_id).attempts == 1


def test_a_busy_or_freshly_idle_worker_does_not_ring_waiting_jobs_again(client, runtime, sessions, broker):
    """A queued job behind a running one is waiting, not lost: no duplicate doorbells."""
    job_id = submit(client, sft_body(2, output_name=unique_name("waiting")))
    _age_doorbell(sessions, runtime, job_id)
    runtime.idle_since = None  # busy with another job
    assert runtime.reconciler.run_once()["republished"] == 0
    runtime.idle_since = store.utcnow()  # that job just ended: the doorbell is on its way
    assert runtime.reconciler.run_once()["republished"] == 0
    runtime.idle_since = store.utcnow() - timedelta(minutes=10)
    runtime.shutdown.set()  # a worker on its way out consumes nothing: it rings nothing either
    assert runtime.reconciler.run_once()["republished"] == 0
    runtime.shutdown.clear()
    assert broker.task_ids() == [job_id]


def test_run_job_marks_the_worker_busy_then_idle(client, runtime, sessions):
    job_id = submit(client, sft_body(1, output_name=unique_name("idle")))
    seen = {}
    original = runtime._on_step

    def on_step(jid, report):
        seen["idle_since"] = runtime.idle_since
        original(jid, report)

    runtime._on_step = on_step
    before = store.utcnow()
    assert runtime.run_job(job_id) == "completed"
    assert seen["idle_since"] is None
    assert runtime.idle_since is not None and runtime.idle_since >= before


def test_graceful_releases_do_not_use_up_the_delivery_budget(client, runtime, sessions, settings):
    """max_attempts is 3: three warm shutdowns in a row (a rolling deploy) used to fail the job
    `worker_lost` at the third, with a good checkpoint on disk."""
    assert settings.training.max_attempts == 3
    name = unique_name("deploys")
    job_id = submit(client, sft_body(4, epochs=1, seed=3, checkpoint_interval=100, output_name=name))
    original = runtime._on_step

    def on_step(jid, report):
        original(jid, report)
        runtime.request_shutdown()

    runtime._on_step = on_step
    for release in range(1, 4):
        assert runtime.run_job(job_id) == "requeued"
        job = job_row(sessions, job_id)
        assert job.state == states.QUEUED, (release, job.state, job.failure_reason)
        assert job.resume_checkpoint.endswith(f"step-{release:08d}.kiln-checkpoint")
        runtime.shutdown.clear()
    runtime._on_step = original
    assert runtime.run_job(job_id) == "completed"
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.failure_reason is None
    assert steps(sessions, job_id) == [1, 2, 3, 4]
    assert event_kinds(sessions, job_id).count("started") == 4


def test_crash_deliveries_still_exhaust_the_budget_after_graceful_releases(
    client, runtime, sessions, settings
):
    """Only graceful releases are forgiven: a job whose worker keeps dying still fails."""
    name = unique_name("poison")
    job_id = submit(client, sft_body(4, epochs=1, seed=3, checkpoint_interval=1, output_name=name))
    original = runtime._on_step

    def release(jid, report):
        original(jid, report)
        runtime.request_shutdown()

    runtime._on_step = release
    assert runtime.run_job(job_id) == "requeued"
    runtime.shutdown.clear()

    def die(jid, report):
        original(jid, report)
        raise Killed

    runtime._on_step = die
    outcomes = []
    for _ in range(settings.training.max_attempts):
        with pytest.raises(Killed):
            runtime.run_job(job_id)
        runtime.run = None
        expire_lease(sessions, job_id)
        outcomes.append(runtime.reconciler.run_once())
    job = job_row(sessions, job_id)
    assert [o["resumed"] for o in outcomes] == [1, 1, 0] and outcomes[-1]["failed"] == 1
    assert job.state == states.FAILED and job.failure_reason == "worker_lost"


def test_a_reconciler_killed_before_withdrawing_does_not_doom_the_resume(client, runtime, sessions, settings):
    """The job was requeued from step 2, but the step-4 checkpoint its dead worker published
    (never recorded, and damaged meanwhile, so not adoptable) was still on disk: the resumed run
    failed with `already exists` at step 4."""
    name = unique_name("rckill")
    job_id = submit(client, sft_body(3, epochs=2, checkpoint_interval=2, seed=5, output_name=name))
    original = runtime._on_checkpoint

    def on_checkpoint(jid, record):
        if record["global_step"] == 4:
            loop = Path(record["path"]) / ckpt.LOOP_STATE_FILE
            data = loop.read_bytes()
            loop.unlink()
            loop.write_bytes(data.replace(b"{", b"{ ", 1))  # no longer the bytes its manifest names
            raise Killed  # the worker dies after the rename, before the row
        original(jid, record)

    runtime._on_checkpoint = on_checkpoint
    with pytest.raises(Killed):
        runtime.run_job(job_id)
    runtime._on_checkpoint = original
    runtime.run = None
    expire_lease(sessions, job_id)

    def killed_withdraw(*args, **kwargs):
        raise Killed  # the reconciler's worker dies right after the requeue committed

    runtime.reconciler._withdraw_unrecorded = killed_withdraw
    with pytest.raises(Killed):
        runtime.reconciler.run_once()
    del runtime.reconciler._withdraw_unrecorded
    step4 = f"{name}-checkpoint-step-00000004.kiln-checkpoint"
    job = job_row(sessions, job_id)
    assert job.state == states.QUEUED and job.resume_checkpoint.endswith("step-00000002.kiln-checkpoint")
    assert step4 in checkpoint_names(settings, name)

    assert runtime.run_job(job_id) == "completed"
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.global_step == 6, (job.failure_reason, job.error_message)
    assert steps(sessions, job_id) == [1, 2, 3, 4, 5, 6]
    with sessions() as s:
        recorded = store.list_checkpoints(s, job_id)
    assert [c.global_step for c in recorded] == [2, 4]

    rewritten = ckpt.load_checkpoint(settings.adapters_dir / step4, verify_hashes=True)
    assert recorded[1].manifest_sha256.removeprefix("sha256:") == rewritten.manifest_sha256


def test_a_user_resume_does_not_withdraw_a_later_checkpoint_it_did_not_write(
    client, runtime, sessions, settings
):
    """The dequeue clean-up is for the job's own unrecorded checkpoints only: a user resume of an
    older checkpoint still fails on reaching a later existing name (kiln-contract §5.7)."""
    name = unique_name("older")
    # An explicit segment count: an auto-planned first run is not resumable through the api at
    # all (admission pins `auto: false` for a resume; reported separately).
    config = {"epochs": 2, "checkpoint_interval": 2, "seed": 5, "grad_checkpoint_segments": 1}
    first = submit(client, sft_body(3, output_name=name, **config))
    original = runtime._on_step

    def on_step(jid, report):
        original(jid, report)
        if report.global_step == 3:  # seen after step 4's write, which is a checkpoint step
            assert client.delete(f"/v1/train/queue/{jid}").status_code == 200

    runtime._on_step = on_step
    assert runtime.run_job(first) == "failed"
    runtime._on_step = original
    step2 = f"{name}-checkpoint-step-00000002.kiln-checkpoint"
    step4 = f"{name}-checkpoint-step-00000004.kiln-checkpoint"
    assert checkpoint_names(settings, name) == [step2, step4]
    # Admission refuses a resume behind a later checkpoint; the later one reappears after it.
    aside = settings.storage_root / "aside"
    (settings.adapters_dir / step4).rename(aside)
    body = sft_body(3, output_name=name, resume_checkpoint=step2, **config)
    response = client.post("/v1/train/sft", json=body)
    assert response.status_code == 200, response.get_json()
    second = response.get_json()["job_id"]
    aside.rename(settings.adapters_dir / step4)
    assert runtime.run_job(second) == "failed"
    job = job_row(sessions, second)
    assert "already exists" in job.error_message
    assert checkpoint_names(settings, name) == [step2, step4]
