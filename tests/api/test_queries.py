"""The list views answer from one read. A worker claiming a job between two statements of
GET /v1/train/status or GET /v1/train/queue (Postgres reads each statement afresh) must not
leave a queued job without a position, a gap in the positions, or a job missing from the queue
view. The claim is a real committed write on another connection, made while the route runs."""

from __future__ import annotations

import contextlib

from sqlalchemy import Engine, event

from kiln.store import claim_job
from tests.kiln.store.store_support import admit

JOBS_LIST = "ORDER BY training_jobs.queue_seq"


@contextlib.contextmanager
def claim_after_first_job_read(sessions, job_id: str, dialect: str):
    """Once the route has read the jobs list, a worker claims `job_id` (Postgres only: SQLite's
    reader holds the single write lock, so the claim could not land in between there)."""
    fired: list[bool] = []

    def after(conn, cursor, statement, params, context, executemany):
        if fired or JOBS_LIST not in statement or conn.dialect.name != dialect:
            return
        fired.append(True)
        if dialect == "postgresql":
            with sessions.begin() as s:
                assert claim_job(s, job_id, "w-claimer", 60) is not None

    event.listen(Engine, "after_cursor_execute", after)
    try:
        yield fired
    finally:
        event.remove(Engine, "after_cursor_execute", after)


def _seed(sessions, n: int) -> list[str]:
    with sessions.begin() as s:
        return [admit(s).id for _ in range(n)]


def test_status_list_positions_come_from_the_same_read(client, sessions, engine):
    ids = _seed(sessions, 3)
    with claim_after_first_job_read(sessions, ids[0], engine.dialect.name) as fired:
        response = client.get("/v1/train/status")
    assert fired
    assert response.status_code == 200
    rows = {r["job_id"]: r for r in response.get_json()}
    queued = [r for r in response.get_json() if r["state"] == "queued"]
    assert all(r["queue_position"] is not None for r in queued), queued
    assert [r["queue_position"] for r in queued] == list(range(1, len(queued) + 1))
    assert set(rows) == set(ids)


def test_queue_view_shows_every_job_exactly_once(client, sessions, engine):
    ids = _seed(sessions, 3)
    with claim_after_first_job_read(sessions, ids[0], engine.dialect.name) as fired:
        response = client.get("/v1/train/queue")
    assert fired
    assert response.status_code == 200
    out = response.get_json()
    listed = (
        [r["job_id"] for r in out["running_jobs"]]
        + [q["job_id"] for q in out["queued"]]
        + [c["job_id"] for c in out["completed"]]
    )
    assert sorted(listed) == sorted(ids), out
    assert [q["position"] for q in out["queued"]] == list(range(1, len(out["queued"]) + 1))
