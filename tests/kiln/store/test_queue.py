"""Queue positions on SQLite and Postgres: FIFO in admission order."""

from __future__ import annotations

from kiln.store import (
    claim_job,
    count_queued,
    count_tracked,
    list_queued,
    queue_position,
    queue_positions,
    request_cancel,
)
from tests.kiln.store.store_support import admit


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
