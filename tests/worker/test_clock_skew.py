"""Hosts whose clocks disagree share one job store (PostgreSQL) safely.

The api, the worker and another worker's reconciler may run on different hosts. Leases,
heartbeats and queue times are stamped and compared on the database server's clock
(`store_now`), never on a process's own: a worker whose clock runs behind keeps its live job (no
reconciler takes it, so it never runs twice), and a dead worker whose clock ran ahead loses its
lease on time rather than as late as the skew.

SQLite is embedded (one host, one clock), so these run on PostgreSQL only.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from kiln import store
from kiln.store import models, states
from tests.api.conftest import sft_body, unique_name
from tests.kiln.store.store_support import migrated_database
from tests.worker.runtime_support import job_row, submit

pytestmark = pytest.mark.postgres

HOUR = timedelta(hours=1)


@pytest.fixture(scope="module")
def db_url(tmp_path_factory):
    with migrated_database("postgres", tmp_path_factory.mktemp("db")) as url:
        yield url


def skew(monkeypatch, offset: timedelta) -> None:
    """This process's clock (every host in these tests) is off by `offset`: the clock the store
    module reads, whichever name a caller imported it under."""

    class Skewed(datetime):
        @classmethod
        def now(cls, tz=None) -> datetime:
            return datetime.now(tz) + offset

    monkeypatch.setattr(models, "datetime", Skewed)
    assert abs(store.utcnow() - datetime.now(UTC) - offset) < timedelta(seconds=5)


def server_now(sessions) -> datetime:
    with sessions.begin() as s:
        return s.execute(select(func.now())).scalar_one().astimezone(UTC)


def near(value: datetime, reference: datetime, seconds: float = 60) -> bool:
    return abs((value - reference).total_seconds()) < seconds


def _register(sessions, runner_id: str, runner_kwargs) -> None:
    with sessions.begin() as s:
        store.register_runner(s, runner_id, **runner_kwargs)


def _submit_claimed(client, sessions, runner_kwargs, worker_id: str, lease_seconds: float) -> str:
    _register(sessions, worker_id, runner_kwargs)  # the live runner admission prices against
    job_id = submit(client, sft_body(2, output_name=unique_name("skew")))
    with sessions.begin() as s:
        assert store.claim_job(s, job_id, worker_id, lease_seconds=lease_seconds) is not None
        store.heartbeat_runner(s, worker_id, current_job_id=job_id, state=states.RUNNER_BUSY)
    return job_id


def test_a_worker_whose_clock_runs_behind_keeps_its_live_job(client, sessions, runner_kwargs, monkeypatch):
    skew(monkeypatch, -HOUR)  # the worker's host
    job_id = _submit_claimed(client, sessions, runner_kwargs, "worker-behind", lease_seconds=120)
    with sessions.begin() as s:
        assert store.renew_lease(s, job_id, "worker-behind", lease_seconds=120) is False
    monkeypatch.undo()  # the reconciler's host keeps true time
    with sessions.begin() as s:
        assert store.expired_leases(s, owner_fresh_seconds=60) == []
        assert store.expired_leases(s) == []  # not even by the lease alone
    job = job_row(sessions, job_id)
    now = server_now(sessions)
    assert job.state == states.RUNNING
    assert near(job.lease_expires_at, now + timedelta(seconds=120))
    for stamp in (job.submitted_at, job.started_at, job.heartbeat_at):
        assert near(stamp, now)


def test_a_dead_worker_whose_clock_ran_ahead_loses_its_lease_on_time(
    client, sessions, runner_kwargs, monkeypatch
):
    skew(monkeypatch, HOUR)
    job_id = _submit_claimed(client, sessions, runner_kwargs, "worker-ahead", lease_seconds=1)
    monkeypatch.undo()
    time.sleep(1.5)  # the worker dies; its one-second lease runs out by the server's clock
    with sessions.begin() as s:
        expired = [j.id for j in store.expired_leases(s, owner_fresh_seconds=60)]
    assert expired == [job_id]
    with sessions.begin() as s:
        store.fail_worker_lost(s, job_id)
    job = job_row(sessions, job_id)
    assert job.state == states.FAILED and job.failure_reason == "worker_lost"
    assert timedelta(0) <= job.finished_at - job.started_at < timedelta(minutes=1)


@pytest.mark.parametrize("offset", [-HOUR, HOUR], ids=["behind", "ahead"])
def test_a_job_run_on_skewed_hosts_reads_true_times(client, runtime, sessions, monkeypatch, offset):
    """Submit, claim, train and finish with every process an hour off: the rows carry the
    server's time, and the api's ages and durations are the real ones."""
    skew(monkeypatch, offset)
    job_id = submit(client, sft_body(2, output_name=unique_name("skewed-run")))
    assert runtime.run_job(job_id) == "completed"
    job = job_row(sessions, job_id)
    now = server_now(sessions)
    for stamp in (job.submitted_at, job.published_at, job.started_at, job.finished_at):
        assert near(stamp, now)
    assert job.submitted_at <= job.started_at <= job.finished_at
    with sessions.begin() as s:
        events, _ = store.list_events(s, job_id, limit=100)
        assert events and all(near(e.created_at, now) for e in events)
        steps = store.loss_history(s, job_id)
        assert [st.global_step for st in steps] == [1, 2] and all(near(st.created_at, now) for st in steps)
    status = client.get(f"/v1/train/status/{job_id}").get_json()
    assert 0 <= status["elapsed_secs"] < 600
    health = client.get("/health").get_json()
    assert 0 <= health["runner"]["heartbeat_age_s"] < 60
    metrics = client.get("/metrics").get_data(as_text=True)
    (age,) = [line for line in metrics.splitlines() if line.startswith("kiln_runner_heartbeat_age_seconds ")]
    assert 0 <= float(age.split()[1]) < 60
