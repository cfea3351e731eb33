"""Admission on SQLite and Postgres: the job, its admission and first event, queue order,
idempotency keys (also under concurrency) and aware UTC timestamps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import exc

from kiln.store import (
    IdempotencyKeyTaken,
    count_queued,
    count_tracked,
    find_by_idempotency_key,
    get_admission,
    get_job,
    insert_admitted_job,
    list_queued,
    queue_positions,
    states,
)
from tests.kiln.store.store_support import admission_fields, admit, event_kinds, job_fields, race

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
    assert event_kinds(factory, job.id) == [states.EVENT_QUEUED]


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


def test_concurrent_admissions_with_one_key_admit_one_job(factory):
    admitted: list[str] = []

    def submit(_index: int) -> None:
        with factory.begin() as session:
            admitted.append(admit(session, idempotency_key="same-key").id)

    errors = race(6, submit)
    assert len(admitted) == 1
    assert len(errors) == 5 and all(isinstance(e, IdempotencyKeyTaken) for e in errors), errors
    with factory() as session:
        assert count_tracked(session) == 1
        assert find_by_idempotency_key(session, "same-key").id == admitted[0]


def test_concurrent_admissions_get_distinct_queue_positions(factory):
    def submit(_index: int) -> None:
        with factory.begin() as session:
            admit(session)

    assert race(10, submit) == []
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
