"""Probe: the event cursor never skips an event whose transaction commits after a later one's,
and a job deleted twice at once answers "not found" to the loser (SQLite and Postgres)."""

from __future__ import annotations

import threading

import pytest

from kiln.store import (
    append_event,
    claim_job,
    delete_job,
    finish_job,
    list_events,
    make_engine,
    session_factory,
    states,
)
from kiln.store.errors import TRAINING_JOB_NOT_FOUND
from kiln_train.errors import KilnError
from tests.kiln.store.store_support import BACKENDS, admit, migrated_database


@pytest.fixture(params=BACKENDS)
def factory(request, tmp_path):
    with migrated_database(request.param, tmp_path) as url:
        engine = make_engine(url)
        yield session_factory(engine)
        engine.dispose()


def _read_all(factory, job_id: str, after: int | None) -> tuple[list[int], int | None]:
    with factory() as s:
        events, _ = list_events(s, job_id, after, 1000)
    ids = [e.id for e in events]
    return ids, (ids[-1] if ids else after)


def test_cursor_never_skips_an_event_committed_after_a_later_one(factory):
    with factory.begin() as s:
        job_id = admit(s).id
    seen, cursor = _read_all(factory, job_id, None)
    assert len(seen) == 1  # the `queued` event

    first_started = threading.Event()
    release_first = threading.Event()
    errors: list[BaseException] = []

    def slow_writer() -> None:
        try:
            with factory.begin() as s:
                append_event(s, job_id, "log", "slow writer")
                first_started.set()
                release_first.wait(10)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            first_started.set()

    def fast_writer() -> None:
        try:
            with factory.begin() as s:
                append_event(s, job_id, "log", "fast writer")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    slow = threading.Thread(target=slow_writer)
    slow.start()
    assert first_started.wait(10)
    fast = threading.Thread(target=fast_writer)
    fast.start()
    fast.join(1.0)  # on a correct store the fast writer waits for the slow one
    page, cursor = _read_all(factory, job_id, cursor)
    seen += page
    release_first.set()
    slow.join(10)
    fast.join(10)
    assert not errors, errors
    page, cursor = _read_all(factory, job_id, cursor)
    seen += page
    with factory() as s:
        every, _ = list_events(s, job_id, None, 1000)
    assert len(every) == 3
    assert seen == [e.id for e in every], "the cursor skipped or repeated an event"


def test_two_deletes_of_one_finished_job_one_wins_the_other_is_not_found(factory):
    with factory.begin() as s:
        job_id = admit(s).id
        assert claim_job(s, job_id, "w-1", 60) is not None
        finish_job(s, job_id, states.COMPLETED, worker_id="w-1")
    outcomes: list[str] = []

    def second_delete() -> None:
        try:
            with factory.begin() as s:
                delete_job(s, job_id)
            outcomes.append("deleted")
        except KilnError as exc:
            outcomes.append(exc.code)
        except Exception as exc:  # noqa: BLE001 - the probe records what escaped
            outcomes.append(type(exc).__name__)

    with factory.begin() as first:
        delete_job(first, job_id)
        loser = threading.Thread(target=second_delete)
        loser.start()
        loser.join(1.0)  # it read the job as not deleted (Postgres) or waits for the lock (SQLite)
    loser.join(30)
    assert outcomes == [TRAINING_JOB_NOT_FOUND]
    with factory() as s:
        events, _ = list_events(s, job_id, None, 1000)
    assert [e.kind for e in events].count(states.EVENT_DELETED) == 1
