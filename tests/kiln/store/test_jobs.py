"""Job transitions on SQLite and Postgres: claim (exactly once under concurrency), step recording,
finish guards, cancel (each state and the races) and deletion."""

from __future__ import annotations

import random
import threading
from datetime import UTC, timedelta

import pytest
from sqlalchemy import event, exc, select

from api.errors import http_status
from kiln.store import (
    CANCELLED,
    CANCELLING,
    InvalidTransition,
    Job,
    JobEvent,
    LeaseLost,
    claim_job,
    count_queued,
    count_tracked,
    delete_job,
    find_by_idempotency_key,
    finish_job,
    get_job,
    list_events,
    loss_history,
    record_step,
    request_cancel,
    states,
)
from kiln.store.errors import (
    TRAINING_JOB_ALREADY_STARTED,
    TRAINING_JOB_NOT_CANCELLABLE,
    TRAINING_JOB_NOT_FOUND,
)
from kiln_train.errors import KilnError
from tests.kiln.store.store_support import (
    admit,
    claim_and_finish,
    event_kinds,
    run_steps,
    running_job,
)

# --- claim -------------------------------------------------------------------------------------


def test_claim_moves_queued_to_running_once(factory):
    with factory.begin() as session:
        job = admit(session)
    with factory.begin() as session:
        claimed = claim_job(session, job.id, "worker-a", lease_seconds=60)
    assert claimed.state == states.RUNNING and claimed.worker_id == "worker-a" and claimed.attempts == 1
    assert claimed.started_at is not None and claimed.started_at.tzinfo == UTC
    assert timedelta(seconds=59) < claimed.lease_expires_at - claimed.started_at <= timedelta(seconds=61)
    with factory.begin() as session:
        assert claim_job(session, job.id, "worker-b", lease_seconds=60) is None  # redelivered duplicate
        assert claim_job(session, "no-such-job", "worker-b", lease_seconds=60) is None
    with factory() as session:
        assert get_job(session, job.id).worker_id == "worker-a"
    assert event_kinds(factory, job.id) == [states.EVENT_QUEUED, states.EVENT_STARTED]


def test_claim_is_exactly_once_under_concurrency(factory):
    with factory.begin() as session:
        job = admit(session)
    racers = 8
    barrier = threading.Barrier(racers)
    winners: list[str] = []
    errors: list[BaseException] = []

    def race(worker_id: str) -> None:
        try:
            barrier.wait()
            with factory.begin() as session:
                if claim_job(session, job.id, worker_id, lease_seconds=60) is not None:
                    winners.append(worker_id)
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=race, args=(f"w{i}",)) for i in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert len(winners) == 1
    with factory() as session:
        stored = get_job(session, job.id)
        assert stored.worker_id == winners[0] and stored.attempts == 1
    assert event_kinds(factory, job.id).count(states.EVENT_STARTED) == 1


def test_many_workers_claim_every_job_exactly_once(factory):
    with factory.begin() as session:
        ids = [admit(session).id for _ in range(12)]
    claims: dict[str, list[str]] = {job_id: [] for job_id in ids}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(worker_id: str, seed: int) -> None:
        order = ids[:]
        random.Random(seed).shuffle(order)
        try:
            for job_id in order:
                with factory.begin() as session:
                    if claim_job(session, job_id, worker_id, lease_seconds=60) is not None:
                        with lock:
                            claims[job_id].append(worker_id)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(f"w{i}", i)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert all(len(winners) == 1 for winners in claims.values()), claims
    with factory() as session:
        assert count_queued(session) == 0
        assert {j.attempts for j in session.scalars(select(Job))} == {1}


def test_claim_refuses_cancelled_and_finished_jobs(factory):
    with factory.begin() as session:
        cancelled = admit(session)
        done = admit(session)
    with factory.begin() as session:
        assert request_cancel(session, cancelled.id) == CANCELLED
        claim_and_finish(session, done.id, states.COMPLETED, final_loss=0.5)
    with factory.begin() as session:
        assert claim_job(session, cancelled.id, "w", 60) is None
        assert claim_job(session, done.id, "w", 60) is None
    with factory() as session:
        assert get_job(session, cancelled.id).state == states.FAILED
        assert get_job(session, done.id).attempts == 1


# --- finish ------------------------------------------------------------------------------------


def test_finish_guards(factory):
    with factory.begin() as session:
        job = admit(session)
    with factory.begin() as session, pytest.raises(InvalidTransition) as caught:
        finish_job(session, job.id, states.COMPLETED)  # queued, not running
    assert caught.value.state == states.QUEUED
    with factory.begin() as session:
        claim_job(session, job.id, "worker-a", 60)
    with factory.begin() as session, pytest.raises(LeaseLost):
        finish_job(session, job.id, states.COMPLETED, worker_id="worker-b")
    with pytest.raises(ValueError, match="failure_reason"):
        finish_job(None, job.id, states.FAILED)
    with pytest.raises(ValueError, match="no failure_reason"):
        finish_job(None, job.id, states.COMPLETED, failure_reason="oom")
    with pytest.raises(ValueError, match="completed or failed"):
        finish_job(None, job.id, states.QUEUED)
    with factory.begin() as session:
        done = finish_job(
            session,
            job.id,
            states.COMPLETED,
            worker_id="worker-a",
            final_loss=0.25,
            global_step=10,
            adapter_path="/s/adapters/x",
            receipt={"status": "success"},
            peak_memory_bytes=1 << 33,
            wall_clock_ms=4321,
        )
    assert done.state == states.COMPLETED and done.final_loss == 0.25 and done.finished_at is not None
    assert done.lease_expires_at is None and done.progress == 1.0
    assert done.peak_memory_bytes == 1 << 33 and done.receipt == {"status": "success"}
    with factory.begin() as session, pytest.raises(InvalidTransition) as caught:
        finish_job(session, job.id, states.FAILED, failure_reason="oom")
    assert caught.value.state == states.COMPLETED
    with factory.begin() as session, pytest.raises(InvalidTransition) as caught:
        finish_job(session, "no-such-job", states.COMPLETED)
    assert caught.value.state is None
    assert event_kinds(factory, job.id)[-1] == states.EVENT_COMPLETED


def test_finish_failed_records_reason_and_error(factory):
    with factory.begin() as session:
        job = admit(session)
        claim_and_finish(
            session, job.id, states.FAILED, failure_reason="oom", error_code="E1", error_message="CUDA OOM"
        )
    with factory() as session:
        stored = get_job(session, job.id)
        assert (stored.state, stored.failure_reason, stored.error_code) == ("failed", "oom", "E1")
        events, _ = list_events(session, job.id)
        assert events[-1].kind == states.EVENT_FAILED and events[-1].level == states.LEVEL_ERROR
        assert events[-1].data == {"failure_reason": "oom", "error_code": "E1"}


# --- cancel ------------------------------------------------------------------------------------


def test_cancel_queued_job_fails_it_immediately(factory):
    with factory.begin() as session:
        job = admit(session)
    with factory.begin() as session:
        assert request_cancel(session, job.id) == CANCELLED
    with factory() as session:
        stored = get_job(session, job.id)
        assert stored.state == states.FAILED and stored.failure_reason == states.REASON_CANCELLED
        assert stored.finished_at is not None and stored.cancel_requested
        assert count_queued(session) == 0
    assert event_kinds(factory, job.id) == [states.EVENT_QUEUED, states.EVENT_CANCELLED]


def test_cancel_running_job_sets_the_flag(factory):
    with factory.begin() as session:
        job = admit(session)
        claim_job(session, job.id, "worker-a", 60)
    with factory.begin() as session:
        assert request_cancel(session, job.id) == CANCELLING
    with factory.begin() as session:
        stored = get_job(session, job.id)
        first_request = stored.cancel_requested_at
        assert stored.state == states.RUNNING and stored.cancel_requested and first_request is not None
        # The trainer sees the flag at its next step.
        stop = record_step(
            session,
            job.id,
            "worker-a",
            global_step=1,
            epoch=0,
            loss=1.0,
            learning_rate=1e-3,
            step_ms=5.0,
            tokens=9,
            supervised_tokens=3,
        )
        assert stop is True
    with factory.begin() as session:
        assert request_cancel(session, job.id) == CANCELLING  # asking twice is harmless
        assert get_job(session, job.id).cancel_requested_at == first_request
    with factory.begin() as session:
        finish_job(
            session, job.id, states.FAILED, worker_id="worker-a", failure_reason=states.REASON_CANCELLED
        )
    kinds = event_kinds(factory, job.id)
    assert kinds.count(states.EVENT_CANCEL_REQUESTED) == 2 and kinds[-1] == states.EVENT_CANCELLED


@pytest.mark.parametrize("final_state", [states.COMPLETED, states.FAILED])
def test_cancel_terminal_job_is_not_cancellable(factory, final_state):
    with factory.begin() as session:
        job = admit(session)
        reason = None if final_state == states.COMPLETED else "nan_loss"
        claim_and_finish(session, job.id, final_state, failure_reason=reason)
    with factory.begin() as session, pytest.raises(KilnError) as caught:
        request_cancel(session, job.id)
    assert caught.value.code == TRAINING_JOB_NOT_CANCELLABLE and http_status(caught.value) == 409
    with factory() as session:
        assert get_job(session, job.id).failure_reason == reason


def test_cancel_unknown_or_deleted_job_is_not_found(factory):
    with factory.begin() as session, pytest.raises(KilnError) as caught:
        request_cancel(session, "no-such-job")
    assert caught.value.code == TRAINING_JOB_NOT_FOUND and http_status(caught.value) == 404
    with factory.begin() as session:
        job = admit(session)
        request_cancel(session, job.id)
        delete_job(session, job.id)
    with factory.begin() as session, pytest.raises(KilnError) as caught:
        request_cancel(session, job.id)
    assert caught.value.code == TRAINING_JOB_NOT_FOUND


def _interleave_before_update(engine, factory, marker: str, interloper):
    """Run `interloper` just before the cancel's conditional UPDATE (the one whose SQL contains
    `marker`): in another committed transaction on Postgres (a real race), and on SQLite, whose
    transaction holds the write lock from BEGIN, through the cancelling connection itself."""
    fired: list[bool] = []

    def before(conn, cursor, statement, parameters, context, executemany):
        if fired or not statement.startswith("UPDATE training_jobs") or marker not in statement:
            return
        fired.append(True)
        if conn.dialect.name == "sqlite":
            interloper(lambda sql, params: cursor.connection.execute(sql, params), "?")
        else:
            with factory.begin() as other:
                interloper(lambda sql, params: other.connection().exec_driver_sql(sql, params), "%s")

    event.listen(engine, "before_cursor_execute", before)
    return fired, lambda: event.remove(engine, "before_cursor_execute", before)


def _raced_cancel(engine, factory, job_id: str, marker: str, interloper) -> pytest.ExceptionInfo[KilnError]:
    """`request_cancel` of `job_id` with `interloper` run just before its UPDATE: it must refuse."""
    fired, remove = _interleave_before_update(engine, factory, marker, interloper)
    try:
        with factory.begin() as session, pytest.raises(KilnError) as caught:
            request_cancel(session, job_id)
    finally:
        remove()
    assert fired == [True]
    return caught


def test_cancel_racing_a_claim_answers_already_started(engine, factory):
    with factory.begin() as session:
        job = admit(session)

    def claim_behind_our_back(execute, mark):
        execute(
            f"UPDATE training_jobs SET state = 'running', worker_id = 'w-race' WHERE id = {mark}", (job.id,)
        )

    caught = _raced_cancel(engine, factory, job.id, "failure_reason", claim_behind_our_back)
    assert caught.value.code == TRAINING_JOB_ALREADY_STARTED and http_status(caught.value) == 409
    with factory() as session:
        stored = get_job(session, job.id)
        assert stored.state == states.RUNNING and stored.worker_id == "w-race"
        assert not stored.cancel_requested and stored.failure_reason is None
    # Asking again now stops it cooperatively, as the hint says.
    with factory.begin() as session:
        assert request_cancel(session, job.id) == CANCELLING


def test_cancel_racing_the_finish_answers_not_cancellable(engine, factory):
    with factory.begin() as session:
        job = admit(session)
        claim_job(session, job.id, "worker-a", 60)

    def finish_behind_our_back(execute, mark):
        execute(f"UPDATE training_jobs SET state = 'completed' WHERE id = {mark}", (job.id,))

    caught = _raced_cancel(engine, factory, job.id, "cancel_requested_at", finish_behind_our_back)
    assert caught.value.code == TRAINING_JOB_NOT_CANCELLABLE
    with factory() as session:
        assert get_job(session, job.id).cancel_requested is False


# --- steps --------------------------------------------------------------------------


def test_record_step_writes_the_curve_and_the_progress(factory):
    job = running_job(factory, total_steps=4)
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
    job = running_job(factory)
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


# --- delete ------------------------------------------------------------------------------------


def test_delete_only_terminal_jobs_and_keep_history(factory):
    with factory.begin() as session:
        job = admit(session, idempotency_key="k-del")
    with factory.begin() as session, pytest.raises(InvalidTransition):
        delete_job(session, job.id)
    with factory.begin() as session:
        claim_and_finish(session, job.id, states.COMPLETED)
        deleted = delete_job(session, job.id)
        assert deleted.deleted_at is not None
    with factory.begin() as session:
        assert get_job(session, job.id) is None
        assert get_job(session, job.id, include_deleted=True).state == states.COMPLETED
        assert count_tracked(session) == 0
        assert find_by_idempotency_key(session, "k-del").id == job.id  # the key stays spent
        with pytest.raises(KilnError) as caught:
            delete_job(session, job.id)
        assert caught.value.code == TRAINING_JOB_NOT_FOUND
        rows = session.scalars(select(JobEvent.kind).where(JobEvent.job_id == job.id)).all()
        assert rows[-1] == states.EVENT_DELETED


def test_two_deletes_of_one_finished_job_one_wins_the_other_is_not_found(fresh_factory):
    with fresh_factory.begin() as s:
        job_id = admit(s).id
        assert claim_job(s, job_id, "w-1", 60) is not None
        finish_job(s, job_id, states.COMPLETED, worker_id="w-1")
    outcomes: list[str] = []

    def second_delete() -> None:
        try:
            with fresh_factory.begin() as s:
                delete_job(s, job_id)
            outcomes.append("deleted")
        except KilnError as exc:
            outcomes.append(exc.code)
        except Exception as exc:  # noqa: BLE001 - the test records what escaped
            outcomes.append(type(exc).__name__)

    with fresh_factory.begin() as first:
        delete_job(first, job_id)
        loser = threading.Thread(target=second_delete)
        loser.start()
        loser.join(1.0)  # it read the job as not deleted (Postgres) or waits for the lock (SQLite)
    loser.join(30)
    assert outcomes == [TRAINING_JOB_NOT_FOUND]
    with fresh_factory() as s:
        events, _ = list_events(s, job_id, None, 1000)
    assert [e.kind for e in events].count(states.EVENT_DELETED) == 1
