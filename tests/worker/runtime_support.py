"""Reading a job's row, events and recorded steps from the store, admitting one through the api,
and expiring its lease, for the worker runtime tests."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import update

from kiln import store
from kiln.store.models import Job


class Killed(BaseException):
    """Stands in for SIGKILL at an exact point: nothing in the worker may catch it."""


def submit(client, body) -> str:
    response = client.post("/v1/train/sft", json=body)
    assert response.status_code == 200, response.get_json()
    return response.get_json()["job_id"]


def job_row(sessions, job_id):
    with sessions() as s:
        return store.get_job(s, job_id, include_deleted=True)


def event_kinds(sessions, job_id) -> list[str]:
    with sessions() as s:
        events, _ = store.list_events(s, job_id, limit=1000)
        return [e.kind for e in events]


def steps(sessions, job_id) -> list[int]:
    with sessions() as s:
        return [row.global_step for row in store.loss_history(s, job_id)]


def checkpoint_names(settings, name: str) -> list[str]:
    return sorted(p.name for p in settings.adapters_dir.glob(f"{name}-checkpoint-step-*"))


def expire_lease(sessions, job_id: str) -> None:
    with sessions.begin() as s:
        s.execute(
            update(Job).where(Job.id == job_id).values(lease_expires_at=store.utcnow() - timedelta(seconds=1))
        )
