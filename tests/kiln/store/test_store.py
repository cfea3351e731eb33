"""The job store's transitions on SQLite and Postgres: admission, idempotency, claim (exactly
once under concurrency), cancel (each state and the races), finish guards, FIFO positions."""

from __future__ import annotations

import random
import threading
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import event, exc, select

from api.errors import http_status
from kiln.store import (
    CANCELLED,
    CANCELLING,
    IdempotencyKeyTaken,
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
    get_admission,
    get_job,
    insert_admitted_job,
    list_events,
    list_queued,
    queue_position,
    queue_positions,
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
    admission_fields,
    admit,
    claim_and_finish,
    job_fields,
)


def _events(factory, job_id: str) -> list[str]:
    with factory() as session:
        events, _ = list_events(session, job_id, limit=1000)
        return [e.kind for e in events]


# --- admission ---------------------------------------------------------------------------------


def test_admission_writes_job_admission_and_first_event(factory):
    before = datetime.now(UTC)
    with factory.begin() as session:
        job = admit(session, adapter_name="support-bot")
    with factory() as session:
        stored = get_job(session, job.id)
        assert stored is not None
        assert stored.state == states.QUEUED
        assert stored.adapter_name == "support-bot"
        assert stored.effective_seed == "18446744073709551615"  # u64 max survives as text
        assert stored.attempts == 0 and stored.global_step == 0 and stored.cancel_requested is False
        assert stored.published_at is None and stored.worker_id is None
        assert stored.submitted_at.tzinfo == UTC and stored.submitted_at >= before
        assert len(stored.id) == 36  # UUID4 text
        admission = get_admission(session, job.id)
        assert admission is not None
        assert admission.optimizer["kind"] == "muon"
        assert admission.examples[0]["messages"][1]["content"] == "yo"
        assert admission.dataset_path is None
    assert _events(factory, job.id) == [states.EVENT_QUEUED]


def test_queue_seq_follows_admission_order(factory):
    with factory.begin() as session:
        jobs = [admit(session) for _ in range(3)]
    with factory.begin() as session:
        jobs.append(admit(session))
    seqs = [job.queue_seq for job in jobs]
    assert seqs == sorted(seqs) and len(set(seqs)) == 4


def test_admission_refuses_store_owned_columns_and_two_data_transports(factory):
    with factory.begin() as session, pytest.raises(ValueError, match="store-owned"):
        insert_admitted_job(session, job_fields(state="running"), admission_fields())
    with pytest.raises(exc.IntegrityError), factory.begin() as session:
        insert_admitted_job(session, job_fields(), admission_fields(dataset_path="/data/x.jsonl"))
    with factory() as session:
        assert count_tracked(session) == 0  # the failed admission left nothing behind


def test_dataset_path_admission(factory):
    with factory.begin() as session:
        job = insert_admitted_job(
            session,
            job_fields(),
            admission_fields(data_source="dataset_path", examples=None, dataset_path="a.jsonl"),
        )
    with factory() as session:
        admission = get_admission(session, job.id)
        assert admission.dataset_path == "a.jsonl" and admission.examples is None


def test_idempotency_key_is_unique_and_the_transaction_survives(factory):
    with factory.begin() as session:
        first = admit(session, idempotency_key="key-1")
    with factory.begin() as session:
        with pytest.raises(IdempotencyKeyTaken) as caught:
            admit(session, idempotency_key="key-1")
        assert caught.value.key == "key-1"
        # Same transaction still usable: look the key up and admit something else.
        assert find_by_idempotency_key(session, "key-1").id == first.id
        other = admit(session, idempotency_key="key-2")
    with factory() as session:
        assert {j.idempotency_key for j in list_queued(session)} == {"key-1", "key-2"}
        assert find_by_idempotency_key(session, "key-2").id == other.id
        assert find_by_idempotency_key(session, "missing") is None
        assert count_tracked(session) == 2


def _race(threads: int, target) -> list[BaseException]:
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait()
            target(index)
        except BaseException as error:  # surfaced by the caller
            errors.append(error)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    return errors


def test_concurrent_admissions_with_one_key_admit_one_job(factory):
    admitted: list[str] = []

    def submit(_index: int) -> None:
        with factory.begin() as session:
            admitted.append(admit(session, idempotency_key="same-key").id)

    errors = _race(6, submit)
    assert len(admitted) == 1
    assert len(errors) == 5 and all(isinstance(e, IdempotencyKeyTaken) for e in errors), errors
    with factory() as session:
        assert count_tracked(session) == 1
        assert find_by_idempotency_key(session, "same-key").id == admitted[0]


def test_concurrent_admissions_get_distinct_queue_positions(factory):
    def submit(_index: int) -> None:
        with factory.begin() as session:
            admit(session)

    assert _race(10, submit) == []
    with factory() as session:
        queued = list_queued(session)
        assert len(queued) == 10 and len({j.queue_seq for j in queued}) == 10
        assert sorted(queue_positions(session).values()) == list(range(1, 11))


def test_jobs_without_idempotency_key_do_not_collide(factory):
    with factory.begin() as session:
        admit(session)
        admit(session)
    with factory() as session:
        assert count_queued(session) == 2


def test_timestamps_are_aware_utc_and_naive_ones_are_refused(factory):
    with factory.begin() as session:
        eastern = timezone(timedelta(hours=-5))
        job = admit(session, submitted_at=datetime(2026, 1, 2, 7, 0, tzinfo=eastern))
    with factory() as session:
        assert get_job(session, job.id).submitted_at == datetime(2026, 1, 2, 12, 0, tzinfo=UTC)
    with pytest.raises(exc.StatementError, match="naive datetime"), factory.begin() as session:
        admit(session, submitted_at=datetime(2026, 1, 2, 12, 0))


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
    assert _events(factory, job.id) == [states.EVENT_QUEUED, states.EVENT_STARTED]


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
    assert _events(factory, job.id).count(states.EVENT_STARTED) == 1


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
    assert _events(factory, job.id)[-1] == states.EVENT_COMPLETED


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
    assert _events(factory, job.id) == [states.EVENT_QUEUED, states.EVENT_CANCELLED]


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
    kinds = _events(factory, job.id)
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


def test_cancel_racing_a_claim_answers_already_started(engine, factory):
    with factory.begin() as session:
        job = admit(session)

    def claim_behind_our_back(execute, mark):
        execute(
            f"UPDATE training_jobs SET state = 'running', worker_id = 'w-race' WHERE id = {mark}", (job.id,)
        )

    fired, remove = _interleave_before_update(engine, factory, "failure_reason", claim_behind_our_back)
    try:
        with factory.begin() as session, pytest.raises(KilnError) as caught:
            request_cancel(session, job.id)
    finally:
        remove()
    assert fired == [True]
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

    fired, remove = _interleave_before_update(engine, factory, "cancel_requested_at", finish_behind_our_back)
    try:
        with factory.begin() as session, pytest.raises(KilnError) as caught:
            request_cancel(session, job.id)
    finally:
        remove()
    assert fired == [True]
    assert caught.value.code == TRAINING_JOB_NOT_CANCELLABLE
    with factory() as session:
        assert get_job(session, job.id).cancel_requested is False


# --- queue, delete -----------------------------------------------------------------------------


def test_fifo_positions_follow_admission_order(factory):
    with factory.begin() as session:
        a, b, c, d = (admit(session) for _ in range(4))
    with factory.begin() as session:
        claim_job(session, b.id, "w", 60)
        request_cancel(session, c.id)
    with factory() as session:
        assert queue_positions(session) == {a.id: 1, d.id: 2}
        assert [j.id for j in list_queued(session)] == [a.id, d.id]
        assert queue_position(session, a.id) == 1
        assert queue_position(session, d.id) == 2
        assert queue_position(session, b.id) is None
        assert count_queued(session) == 2 and count_tracked(session) == 4
    with factory.begin() as session:
        e = admit(session)
        claim_job(session, a.id, "w2", 60)
    with factory() as session:
        assert queue_positions(session) == {d.id: 1, e.id: 2}


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
