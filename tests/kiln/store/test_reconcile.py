"""The reconciler's store queries on SQLite and Postgres: leases and their expiry, requeue for
resume, worker_lost, and unpublished jobs."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kiln.store import (
    InvalidTransition,
    LeaseLost,
    claim_job,
    expired_leases,
    fail_worker_lost,
    finish_job,
    get_job,
    latest_checkpoint,
    list_checkpoints,
    list_events,
    loss_history,
    mark_published,
    queue_positions,
    record_step,
    renew_lease,
    request_cancel,
    requeue_for_resume,
    states,
    unpublished_jobs,
    utcnow,
)
from tests.kiln.store.store_support import add_checkpoint, admit, run_steps, running_job

# --- leases and the reconciler -----------------------------------------------------------------


def test_lease_expiry_listing_and_renewal(factory):
    a = running_job(factory, "worker-a", lease_seconds=60)
    b = running_job(factory, "worker-b", lease_seconds=60)
    now = utcnow()
    with factory.begin() as session:
        admit(session)  # queued jobs never show up as expired
        assert expired_leases(session, now + timedelta(seconds=30)) == []
        assert [j.id for j in expired_leases(session, now + timedelta(seconds=120))] == [a.id, b.id]
        assert renew_lease(session, b.id, "worker-b", lease_seconds=600) is False
        assert [j.id for j in expired_leases(session, now + timedelta(seconds=120))] == [a.id]
        with pytest.raises(LeaseLost):
            renew_lease(session, a.id, "worker-b", lease_seconds=600)
        request_cancel(session, a.id)
        assert renew_lease(session, a.id, "worker-a", lease_seconds=60) is True  # cancel seen


def test_requeue_for_resume_from_the_latest_checkpoint(factory):
    job = running_job(factory, "worker-a", lease_seconds=60)
    with factory.begin() as session:
        later = admit(session)
        run_steps(session, job, "worker-a", [3.0, 2.5, 2.0, 1.8, 1.7])
        add_checkpoint(session, job.id, 2)
        newest = add_checkpoint(session, job.id, 4, epoch_index=1)
    with factory() as session:
        assert get_job(session, job.id).latest_checkpoint == newest.basename
        assert latest_checkpoint(session, job.id).global_step == 4
        assert [c.global_step for c in list_checkpoints(session, job.id)] == [2, 4]
    future = utcnow() + timedelta(seconds=120)
    with factory.begin() as session, pytest.raises(InvalidTransition):
        requeue_for_resume(session, job.id, newest.basename)  # lease still valid: not stolen
    with factory.begin() as session, pytest.raises(ValueError, match="no recorded checkpoint"):
        requeue_for_resume(session, job.id, "unknown.kiln-checkpoint", now=future)
    with factory.begin() as session:
        resumed = requeue_for_resume(session, job.id, newest.basename, now=future)
    assert resumed.state == states.QUEUED and resumed.resume_checkpoint == newest.basename
    assert resumed.worker_id is None and resumed.lease_expires_at is None and resumed.published_at is None
    assert (resumed.global_step, resumed.current_epoch) == (4, 1)
    with factory.begin() as session:
        assert [s.global_step for s in loss_history(session, job.id)] == [1, 2, 3, 4]
        assert queue_positions(session) == {later.id: 1, job.id: 2}  # back of the queue
        assert [j.id for j in unpublished_jobs(session, utcnow() + timedelta(seconds=1))] == [
            later.id,
            job.id,
        ]
        # The old worker wakes up: fenced off.
        with pytest.raises(LeaseLost):
            record_step(
                session,
                job.id,
                "worker-a",
                global_step=6,
                epoch=1,
                loss=1.0,
                learning_rate=1e-3,
                step_ms=1.0,
                tokens=1,
                supervised_tokens=1,
            )
    with factory.begin() as session:
        again = claim_job(session, job.id, "worker-c", 60)
        assert again.attempts == 2 and again.resume_checkpoint == newest.basename
        run_steps(session, again, "worker-c", [1.75, 1.6], start=5)  # step 5 again: it was dropped
    with factory() as session:
        assert [s.loss for s in loss_history(session, job.id)] == [3.0, 2.5, 2.0, 1.8, 1.75, 1.6]
    with factory() as session:
        kinds = [e.kind for e in list_events(session, job.id, limit=100)[0]]
        assert kinds.count(states.EVENT_REQUEUED) == 1 and kinds.count(states.EVENT_STARTED) == 2


def test_fail_worker_lost_and_cancel_requested_during_the_loss(factory):
    lost = running_job(factory, "worker-a", lease_seconds=60)
    cancelled = running_job(factory, "worker-a", lease_seconds=60)
    with factory.begin() as session:
        request_cancel(session, cancelled.id)
        add_checkpoint(session, cancelled.id, 1)
    future = utcnow() + timedelta(seconds=120)
    with factory.begin() as session, pytest.raises(InvalidTransition):
        fail_worker_lost(session, lost.id)  # lease not expired yet
    with factory.begin() as session, pytest.raises(InvalidTransition):
        requeue_for_resume(
            session, cancelled.id, f"{cancelled.id[:8]}-checkpoint-step-00000001.kiln-checkpoint", future
        )
    with factory.begin() as session:
        failed = fail_worker_lost(session, lost.id, now=future)
        assert failed.state == states.FAILED and failed.failure_reason == states.REASON_WORKER_LOST
        assert "worker-a" in failed.error_message
        assert fail_worker_lost(session, cancelled.id, now=future).failure_reason == states.REASON_CANCELLED
    with factory.begin() as session:
        assert expired_leases(session, future) == []
        with pytest.raises(InvalidTransition):
            fail_worker_lost(session, lost.id, now=future)
        with pytest.raises(InvalidTransition):
            finish_job(session, lost.id, states.COMPLETED, worker_id="worker-a")
        events, _ = list_events(session, lost.id)
        assert events[-1].kind == states.EVENT_WORKER_LOST and events[-1].level == states.LEVEL_ERROR


def test_unpublished_jobs_and_mark_published(factory):
    with factory.begin() as session:
        first = admit(session)
        second = admit(session)
    cutoff = utcnow() + timedelta(seconds=1)
    with factory.begin() as session:
        assert unpublished_jobs(session, first.submitted_at) == []  # too young: the api may still publish
        assert [j.id for j in unpublished_jobs(session, cutoff)] == [first.id, second.id]
        assert mark_published(session, first.id) is True
        assert mark_published(session, first.id) is False
    with factory.begin() as session:
        assert [j.id for j in unpublished_jobs(session, cutoff)] == [second.id]
        assert get_job(session, first.id).published_at is not None
        request_cancel(session, second.id)
        assert unpublished_jobs(session, cutoff) == []  # cancelled: nothing to publish
