"""The job store's progress, reconciler and runner queries on SQLite and Postgres: step
recording, event pagination, leases and their expiry, resume and worker_lost, publication,
checkpoints, adapters and runner liveness."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import exc

from kiln.store import (
    InvalidTransition,
    LeaseLost,
    append_event,
    claim_job,
    delete_adapter,
    expired_leases,
    fail_worker_lost,
    finish_job,
    get_adapter,
    get_job,
    get_runner,
    heartbeat_runner,
    latest_checkpoint,
    list_adapters,
    list_checkpoints,
    list_events,
    live_runner,
    loss_history,
    mark_published,
    queue_positions,
    record_checkpoint,
    record_step,
    register_adapter,
    register_runner,
    renew_lease,
    request_cancel,
    requeue_for_resume,
    states,
    stop_runner,
    unpublished_jobs,
    utcnow,
)
from kiln.store.errors import ADAPTER_NOT_FOUND
from kiln_train.errors import ADAPTER_ALREADY_EXISTS, KilnError
from tests.kiln.store.store_support import admit, run_steps


def _running_job(factory, worker_id: str = "worker-a", lease_seconds: float = 60, **overrides):
    with factory.begin() as session:
        job = admit(session, **overrides)
        return claim_job(session, job.id, worker_id, lease_seconds)


def _checkpoint(session, job_id: str, step: int, epoch_index: int = 0):
    basename = f"{job_id[:8]}-checkpoint-step-{step:08d}.kiln-checkpoint"
    return record_checkpoint(
        session,
        job_id,
        checkpoint_id=f"sft-step-{step:08d}",
        basename=basename,
        path=f"/storage/adapters/{basename}",
        global_step=step,
        epoch_index=epoch_index,
        cursor=step % 5,
        manifest_sha256="sha256:" + "aa" * 32,
        size_bytes=4096 + step,
        write_ms=12.5,
    )


# --- steps and events --------------------------------------------------------------------------


def test_record_step_writes_the_curve_and_the_progress(factory):
    job = _running_job(factory, total_steps=4)
    with factory.begin() as session:
        run_steps(session, job, "worker-a", [2.0, 1.5, 1.25], epoch=1, step_ms=80.0, tokens=64)
    with factory() as session:
        curve = loss_history(session, job.id)
        assert [(s.global_step, s.loss, s.epoch, s.tokens, s.step_ms) for s in curve] == [
            (1, 2.0, 1, 64, 80.0),
            (2, 1.5, 1, 64, 80.0),
            (3, 1.25, 1, 64, 80.0),
        ]
        stored = get_job(session, job.id)
        assert (stored.global_step, stored.current_epoch, stored.current_loss) == (3, 1, 1.25)
        assert stored.progress == 0.75
        assert stored.heartbeat_at >= job.heartbeat_at


def test_record_step_refuses_duplicates_and_strangers(factory):
    job = _running_job(factory)
    with factory.begin() as session:
        run_steps(session, job, "worker-a", [1.0])
    with pytest.raises(exc.IntegrityError), factory.begin() as session:
        run_steps(session, job, "worker-a", [1.0])
    with factory.begin() as session, pytest.raises(LeaseLost):
        run_steps(session, job, "worker-b", [1.0])
    with factory.begin() as session:
        queued = admit(session)
    with factory.begin() as session, pytest.raises(LeaseLost):
        run_steps(session, queued, "worker-a", [1.0])
    with factory() as session:
        assert len(loss_history(session, job.id)) == 1 and loss_history(session, queued.id) == []


def test_event_pagination_by_cursor(factory):
    with factory.begin() as session:
        job = admit(session)
        other = admit(session)
        for n in range(7):
            append_event(session, job.id, states.EVENT_STEP, f"step {n}", data={"n": n})
        append_event(session, other.id, states.EVENT_STEP, "elsewhere")
    seen: list[str] = []
    pages = 0
    cursor = None
    with factory() as session:
        while True:
            page, has_more = list_events(session, job.id, after_id=cursor, limit=3)
            pages += 1
            seen += [e.message for e in page]
            assert all(e.created_at.tzinfo is not None for e in page)
            if not has_more:
                break
            cursor = page[-1].id
        assert pages == 3
        assert seen == ["admitted and queued"] + [f"step {n}" for n in range(7)]
        page, has_more = list_events(session, job.id, after_id=cursor, limit=3)
        assert [e.data for e in page] == [{"n": 5}, {"n": 6}] and has_more is False
        last = page[-1].id
        assert list_events(session, job.id, after_id=last) == ([], False)
        with pytest.raises(ValueError, match="limit"):
            list_events(session, job.id, limit=0)
        with pytest.raises(ValueError, match="level"):
            append_event(session, job.id, "x", level="loud")


# --- leases and the reconciler -----------------------------------------------------------------


def test_lease_expiry_listing_and_renewal(factory):
    a = _running_job(factory, "worker-a", lease_seconds=60)
    b = _running_job(factory, "worker-b", lease_seconds=60)
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
    job = _running_job(factory, "worker-a", lease_seconds=60)
    with factory.begin() as session:
        later = admit(session)
        run_steps(session, job, "worker-a", [3.0, 2.5, 2.0, 1.8, 1.7])
        _checkpoint(session, job.id, 2)
        newest = _checkpoint(session, job.id, 4, epoch_index=1)
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
    lost = _running_job(factory, "worker-a", lease_seconds=60)
    cancelled = _running_job(factory, "worker-a", lease_seconds=60)
    with factory.begin() as session:
        request_cancel(session, cancelled.id)
        _checkpoint(session, cancelled.id, 1)
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


# --- artifacts ---------------------------------------------------------------------------------


def test_adapters_register_list_delete_and_reuse_names(factory):
    job = _running_job(factory)
    fields = dict(path="/s/adapters/bot", size_bytes=2048, safetensors_sha256="sha256:" + "11" * 32, rank=8)
    with factory.begin() as session:
        register_adapter(session, name="bot", job_id=job.id, alpha=16.0, **fields)
        register_adapter(session, name="bot-2", job_id=None, alpha=8.0, **fields)
        with pytest.raises(KilnError) as caught:
            register_adapter(session, name="bot", job_id=None, alpha=1.0, **fields)
        assert caught.value.code == ADAPTER_ALREADY_EXISTS
    with factory.begin() as session:
        assert {a.name for a in list_adapters(session)} == {"bot", "bot-2"}
        assert get_adapter(session, "bot").job_id == job.id
        delete_adapter(session, "bot")
        assert get_adapter(session, "bot") is None
        assert [a.name for a in list_adapters(session)] == ["bot-2"]
        with pytest.raises(KilnError) as caught:
            delete_adapter(session, "bot")
        assert caught.value.code == ADAPTER_NOT_FOUND
        reborn = register_adapter(session, name="bot", job_id=None, alpha=4.0, **fields)
        assert reborn.deleted_at is None and reborn.alpha == 4.0


# --- runners -----------------------------------------------------------------------------------


def _register(session, runner_id: str, **overrides):
    fields = dict(
        hostname="gpu-host",
        pid=4242,
        backend="cpu",
        device="cpu",
        base_weight_dtype="f32",
        lora_dtype="f32",
        loss_route="kt_tape_flce",
        optimizer_support={"id": "kiln.training-optimizer-support", "version": 1, "tuples": []},
        execution_identity_digest="sha256:" + "77" * 32,
        model_path="/models/tiny",
        model_config={"hidden_size": 64},
        free_memory_bytes=1 << 30,
        total_memory_bytes=1 << 31,
    )
    fields.update(overrides)
    return register_runner(session, runner_id, **fields)


def test_runner_liveness(factory):
    with factory.begin() as session:
        assert live_runner(session, stale_after_seconds=60) is None
        _register(session, "runner-a")
        _register(session, "runner-boot", state=states.RUNNER_STARTING)
    with factory.begin() as session:
        live = live_runner(session, stale_after_seconds=60)
        assert live.id == "runner-a" and live.optimizer_support["id"] == "kiln.training-optimizer-support"
        assert live_runner(session, stale_after_seconds=60, now=utcnow() + timedelta(seconds=120)) is None
        _register(session, "runner-b", device="cuda:0")
    with factory.begin() as session:
        assert live_runner(session, stale_after_seconds=60).id == "runner-b"  # most recent heartbeat
        assert heartbeat_runner(
            session, "runner-a", free_memory_bytes=5, state=states.RUNNER_BUSY, current_job_id="j"
        )
    with factory.begin() as session:
        live = live_runner(session, stale_after_seconds=60)
        assert (live.id, live.state, live.free_memory_bytes, live.current_job_id) == (
            "runner-a",
            "busy",
            5,
            "j",
        )
        assert heartbeat_runner(session, "runner-a", current_job_id=None)
        assert get_runner(session, "runner-a").current_job_id is None
        assert get_runner(session, "runner-a").free_memory_bytes == 5  # unchanged when not given
        assert stop_runner(session, "runner-a") and stop_runner(session, "runner-b")
        assert stop_runner(session, "nobody") is False
    with factory.begin() as session:
        assert live_runner(session, stale_after_seconds=60) is None
        assert heartbeat_runner(session, "runner-a") is False  # a stopped runner stays stopped
        assert heartbeat_runner(session, "nobody") is False
        with pytest.raises(ValueError, match="runner state"):
            heartbeat_runner(session, "runner-boot", state="dancing")
        again = _register(session, "runner-a", pid=5151)  # a restarted worker re-registers
        assert (again.pid, again.state) == (5151, states.RUNNER_READY)
    with factory() as session:
        assert live_runner(session, stale_after_seconds=60).id == "runner-a"
