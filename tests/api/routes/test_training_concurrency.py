"""Concurrent submissions (SQLite's serialised writer, Postgres's advisory lock): 50 at once are
each admitted exactly once, in order; a duplicated Idempotency-Key admits one job."""

from __future__ import annotations

import threading

import pytest

from kiln.store import Job, JobEvent
from tests.api.conftest import make_settings, sft_body

THREADS = 50


@pytest.fixture
def settings(storage, db_url, engine, broker):
    # Every submission is admitted at once: this module tests the store's serialised admission
    # writes, not the admission slots (tests/api/test_front_door.py does).
    return make_settings(storage, db_url, broker.queue, server={"max_concurrent_admissions": THREADS})


def _run_concurrently(app, requests: list[tuple[dict, dict]]) -> list[tuple[int, dict]]:
    barrier = threading.Barrier(len(requests))
    results: list = [None] * len(requests)

    def submit(index: int) -> None:
        client = app.test_client()
        body, headers = requests[index]
        barrier.wait()
        response = client.post("/v1/train/sft", json=body, headers=headers)
        results[index] = (response.status_code, response.get_json())

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(not t.is_alive() for t in threads)
    return results


def test_fifty_concurrent_submissions_are_admitted_exactly_once_in_order(
    app, client, sessions, broker, runner
):
    requests = [(sft_body(1 + i % 3, output_name=f"c-{i:02d}"), {}) for i in range(THREADS)]
    results = _run_concurrently(app, requests)
    assert [status for status, _ in results] == [200] * THREADS, [r for r in results if r[0] != 200][:3]
    job_ids = [out["job_id"] for _, out in results]
    assert len(set(job_ids)) == THREADS

    with sessions() as session:
        jobs = session.query(Job).order_by(Job.queue_seq).all()
        first_events = {
            e.job_id: e.id for e in session.query(JobEvent).filter(JobEvent.kind == "queued").all()
        }
    assert len(jobs) == THREADS and {j.id for j in jobs} == set(job_ids)
    seqs = [j.queue_seq for j in jobs]
    assert seqs == sorted(set(seqs))  # unique, strictly increasing
    # Admission order is commit order: each job's first event was written in the same
    # serialised transaction, so event ids rise with queue_seq, and so do submission times.
    event_ids = [first_events[j.id] for j in jobs]
    assert event_ids == sorted(event_ids)
    assert [j.submitted_at for j in jobs] == sorted(j.submitted_at for j in jobs)
    # Each request's adapter name went to exactly its own job.
    by_id = {
        out["job_id"]: body["config"]["output_name"]
        for (body, _), (_, out) in zip(requests, results, strict=True)
    }
    assert {j.id: j.adapter_name for j in jobs} == by_id

    queue = client.get("/v1/train/queue").get_json()["queued"]
    assert [q["job_id"] for q in queue] == [j.id for j in jobs]
    assert [q["position"] for q in queue] == list(range(1, THREADS + 1))
    published = broker.task_ids()
    assert sorted(published) == sorted(job_ids)  # one message per job, none twice


def test_concurrent_duplicates_of_one_idempotency_key_admit_one_job(app, sessions, broker, runner):
    body = sft_body(2, output_name="once")
    results = _run_concurrently(app, [(body, {"Idempotency-Key": "same"})] * 10)
    assert [status for status, _ in results] == [200] * 10
    assert len({out["job_id"] for _, out in results}) == 1
    with sessions() as session:
        assert session.query(Job).count() == 1
    assert len(broker.task_ids()) == 1
