"""`GET /v1/train/queue` and `DELETE /v1/train/queue/{id}` (cancel and its 409s)."""

from __future__ import annotations

from kiln.store import Job, claim_job, finish_job
from tests.api.conftest import sft_body


def _submit(client, **config) -> str:
    response = client.post("/v1/train/sft", json=sft_body(1, **config))
    assert response.status_code == 200, response.get_json()
    return response.get_json()["job_id"]


def test_queue_shows_running_queued_positions_and_finished(client, sessions, runner):
    first, second, third, fourth = (_submit(client, output_name=f"q-{i}") for i in range(4))
    with sessions.begin() as session:
        claim_job(session, first, "w-1", 60)
        claim_job(session, fourth, "w-2", 60)
        finish_job(
            session, fourth, "failed", worker_id="w-2", failure_reason="oom", error_message="out of memory"
        )
    queue = client.get("/v1/train/queue").get_json()
    assert set(queue) == {"running", "running_jobs", "queued", "completed"}
    assert queue["running"]["job_id"] == first and queue["running"]["state"] == "running"
    assert [j["job_id"] for j in queue["running_jobs"]] == [first]
    assert queue["queued"] == [
        {"job_id": second, "job_type": "sft", "adapter_name": "q-1", "position": 1},
        {"job_id": third, "job_type": "sft", "adapter_name": "q-2", "position": 2},
    ]
    assert [j["job_id"] for j in queue["completed"]] == [fourth]
    assert (
        queue["completed"][0]["failure_reason"] == "oom" and queue["completed"][0]["error"] == "out of memory"
    )


def test_empty_queue(client):
    assert client.get("/v1/train/queue").get_json() == {
        "running": None,
        "running_jobs": [],
        "queued": [],
        "completed": [],
    }


def test_cancel_a_queued_job(client, sessions, broker, runner):
    job_id = _submit(client)
    assert broker.task_ids() == [job_id]
    response = client.delete(f"/v1/train/queue/{job_id}")
    assert response.status_code == 200
    assert response.get_json() == {"status": "cancelled", "job_id": job_id}
    with sessions() as session:
        job = session.get(Job, job_id)
    assert (job.state, job.failure_reason, job.cancel_requested) == ("failed", "cancelled", True)
    assert client.get("/v1/train/queue").get_json()["queued"] == []


def test_cancel_a_running_job_is_cooperative(client, sessions, runner):
    job_id = _submit(client)
    with sessions.begin() as session:
        claim_job(session, job_id, "w-1", 60)
    response = client.delete(f"/v1/train/queue/{job_id}")
    assert response.status_code == 200
    body = response.get_json()
    assert body["status"] == "cancelling" and body["job_id"] == job_id
    assert body["message"] == "stop requested — the trainer aborts at the next step boundary"
    with sessions() as session:
        job = session.get(Job, job_id)
    assert job.state == "running" and job.cancel_requested is True


def test_cancel_a_finished_job_is_409_not_cancellable(client, sessions, runner):
    job_id = _submit(client)
    client.delete(f"/v1/train/queue/{job_id}")
    again = client.delete(f"/v1/train/queue/{job_id}")
    assert again.status_code == 409
    assert again.get_json()["error"]["code"] == "training_job_not_cancellable"


def test_cancel_race_with_a_claim_is_409_already_started(client, sessions, runner, monkeypatch):
    """The job is claimed between the cancel's read and its conditional update."""
    import kiln.store.jobs as jobs

    job_id = _submit(client)
    if sessions.kw["bind"].dialect.name == "sqlite":
        # SQLite serialises writers (BEGIN IMMEDIATE): the claim and the cancel cannot interleave,
        # so the cancel sees the claimed job and asks it to stop cooperatively.
        with sessions.begin() as other:
            claim_job(other, job_id, "w-1", 60)
        response = client.delete(f"/v1/train/queue/{job_id}")
        assert response.status_code == 200 and response.get_json()["status"] == "cancelling"
        return

    original = jobs.update

    def claim_first(*args, **kwargs):
        monkeypatch.setattr(jobs, "update", original)
        with sessions.begin() as other:
            claim_job(other, job_id, "w-1", 60)
        return original(*args, **kwargs)

    monkeypatch.setattr(jobs, "update", claim_first)
    response = client.delete(f"/v1/train/queue/{job_id}")
    assert response.status_code == 409
    assert response.get_json()["error"]["code"] == "training_job_already_started"


def test_cancel_an_unknown_job_is_404(client):
    response = client.delete("/v1/train/queue/nope")
    assert response.status_code == 404
    assert response.get_json()["error"]["code"] == "training_job_not_found"
