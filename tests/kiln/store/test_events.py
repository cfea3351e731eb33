"""Job events on SQLite and Postgres: cursor pages, and a cursor that never skips an event whose
transaction commits after a later one's."""

from __future__ import annotations

import threading

import pytest

from kiln.store import append_event, list_events, states
from tests.kiln.store.store_support import admit


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


def _read_all(factory, job_id: str, after: int | None) -> tuple[list[int], int | None]:
    with factory() as s:
        events, _ = list_events(s, job_id, after, 1000)
    ids = [e.id for e in events]
    return ids, (ids[-1] if ids else after)


def test_cursor_never_skips_an_event_committed_after_a_later_one(fresh_factory):
    with fresh_factory.begin() as s:
        job_id = admit(s).id
    seen, cursor = _read_all(fresh_factory, job_id, None)
    assert len(seen) == 1  # the `queued` event

    first_started = threading.Event()
    release_first = threading.Event()
    errors: list[BaseException] = []

    def slow_writer() -> None:
        try:
            with fresh_factory.begin() as s:
                append_event(s, job_id, "log", "slow writer")
                first_started.set()
                release_first.wait(10)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            first_started.set()

    def fast_writer() -> None:
        try:
            with fresh_factory.begin() as s:
                append_event(s, job_id, "log", "fast writer")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    slow = threading.Thread(target=slow_writer)
    slow.start()
    assert first_started.wait(10)
    fast = threading.Thread(target=fast_writer)
    fast.start()
    fast.join(1.0)  # on a correct store the fast writer waits for the slow one
    page, cursor = _read_all(fresh_factory, job_id, cursor)
    seen += page
    release_first.set()
    slow.join(10)
    fast.join(10)
    assert not errors, errors
    page, cursor = _read_all(fresh_factory, job_id, cursor)
    seen += page
    with fresh_factory() as s:
        every, _ = list_events(s, job_id, None, 1000)
    assert len(every) == 3
    assert seen == [e.id for e in every], "the cursor skipped or repeated an event"
