"""Job reads and deletion: `GET /v1/train/status[/{id}]`, `GET /v1/train/jobs/{id}` (loss
history, receipt, latest checkpoint), `GET /v1/train/jobs/{id}/events` (cursor pages),
`DELETE /v1/train/jobs/{id}` (finished jobs only)."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

from kiln.store import append_event, claim_job, finish_job, record_checkpoint, record_step, utcnow
from tests.api.conftest import sft_body
from tests.kiln_train.checkpoint.checkpoint_support import publish as publish_checkpoint

STATUS_FIELDS = {
    "job_id",
    "state",
    "progress",
    "current_loss",
    "adapter_name",
    "effective_seed",
    "started_at",
    "elapsed_secs",
    "submitted_unix_ms",
    "finished_unix_ms",
    "job_type",
    "training_data",
    "error",
    "failure_reason",
    "queue_position",
    "global_step",
    "total_steps",
    "validation_history",
    "model",
}


def _submit(client, n: int = 2, **config) -> dict:
    response = client.post("/v1/train/sft", json=sft_body(n, **config))
    assert response.status_code == 200, response.get_json()
    return response.get_json()


def _run(sessions, job_id: str, losses: list[float], worker: str = "w-1") -> None:
    with sessions.begin() as session:
        assert claim_job(session, job_id, worker, 60) is not None
        for step, loss in enumerate(losses, start=1):
            record_step(
                session,
                job_id,
                worker,
                global_step=step,
                epoch=0,
                loss=loss,
                learning_rate=1e-3,
                step_ms=10.0,
                tokens=20,
                supervised_tokens=5,
            )


def test_status_of_queued_running_and_finished_jobs(client, sessions, runner):
    a = _submit(client, 2, epochs=2)
    b = _submit(client, 3)
    queued = client.get(f"/v1/train/status/{b['job_id']}").get_json()
    assert set(queued) == STATUS_FIELDS
    assert queued["state"] == "queued" and queued["queue_position"] == 2
    assert queued["started_at"] is None and queued["elapsed_secs"] == 0.0 and queued["progress"] == 0.0
    assert queued["effective_seed"] == b["effective_seed"] and queued["job_type"] == "sft"
    assert queued["training_data"]["source"] == "inline" and queued["training_data"]["rows"] == 3
    assert queued["training_data"]["admitted_corpus_sha256"].startswith("sha256:")
    assert abs(queued["submitted_unix_ms"] / 1000 - utcnow().timestamp()) < 60

    _run(sessions, a["job_id"], [2.0, 1.5])
    running = client.get(f"/v1/train/status/{a['job_id']}").get_json()
    assert running["state"] == "running" and running["progress"] == 0.5  # 2 of 4 steps
    assert running["current_loss"] == 1.5 and running["queue_position"] is None
    assert re.fullmatch(r"\d+s ago", running["started_at"])
    assert client.get(f"/v1/train/status/{b['job_id']}").get_json()["queue_position"] == 1

    with sessions.begin() as session:
        finish_job(session, a["job_id"], "completed", worker_id="w-1", final_loss=1.2, global_step=4)
    done = client.get(f"/v1/train/status/{a['job_id']}").get_json()
    assert done["state"] == "completed" and done["progress"] == 1.0
    assert done["finished_unix_ms"] >= done["submitted_unix_ms"] and done["error"] is None

    listing = client.get("/v1/train/status").get_json()
    assert [s["job_id"] for s in listing] == [a["job_id"], b["job_id"]]
    assert all(set(s) == STATUS_FIELDS for s in listing)


def test_cancelled_job_reports_its_reason(client, runner):
    job = _submit(client)
    client.delete(f"/v1/train/queue/{job['job_id']}")
    status = client.get(f"/v1/train/status/{job['job_id']}").get_json()
    assert status["state"] == "failed" and status["failure_reason"] == "cancelled"
    assert status["error"] == "cancelled before it started"


def test_unknown_job_is_404_training_job_not_found(client):
    for path in ("/v1/train/status/nope", "/v1/train/jobs/nope", "/v1/train/jobs/nope/events"):
        response = client.get(path)
        assert response.status_code == 404
        assert response.get_json()["error"]["code"] == "training_job_not_found"


def test_job_detail_has_loss_history_receipt_and_latest_checkpoint(client, sessions, settings, runner):
    job = _submit(client, 2, epochs=2)
    job_id = job["job_id"]
    _run(sessions, job_id, [2.0, 1.0, 0.5])
    published = publish_checkpoint(settings.adapters_dir, global_step=7)
    path = Path(published.path)
    with sessions.begin() as session:
        record_checkpoint(
            session,
            job_id,
            checkpoint_id=published.manifest.checkpoint_id,
            basename=path.name,
            path=str(path),
            global_step=7,
            epoch_index=1,
            cursor=2,
            manifest_sha256="sha256:" + published.manifest_sha256.removeprefix("sha256:"),
            size_bytes=1,
            write_ms=1.0,
        )
        finish_job(
            session,
            job_id,
            "completed",
            worker_id="w-1",
            receipt={"schema": "kiln.train-receipt", "ok": True},
        )
    detail = client.get(f"/v1/train/jobs/{job_id}").get_json()
    assert set(detail) >= STATUS_FIELDS
    assert [s["loss"] for s in detail["loss_history"]] == [2.0, 1.0, 0.5]
    assert [s["step"] for s in detail["loss_history"]] == [1, 2, 3]
    assert [s["progress"] for s in detail["loss_history"]] == [0.25, 0.5, 0.75]
    assert detail["train_receipt"] == {"schema": "kiln.train-receipt", "ok": True}
    checkpoint = detail["latest_checkpoint"]
    assert checkpoint["resume_checkpoint"] == path.name
    assert checkpoint["checkpoint_id"] == published.manifest.checkpoint_id
    assert (checkpoint["global_step"], checkpoint["total_steps"]) == (7, 10)
    assert (checkpoint["next_epoch_index"], checkpoint["next_cursor_in_epoch"]) == (1, 2)
    assert checkpoint["complete"] is False and checkpoint["training_kind"] == "sft"
    assert checkpoint["data_content_sha256"].startswith("sha256:") and checkpoint["data_item_count"] == 5
    assert detail["checkpoint_error"] is None and detail["auto_load"] is True
    assert detail["replay_request"]["examples"] == sft_body(2)["examples"]
    assert detail["replay_request"]["config"]["seed"] == job["effective_seed"]


def test_job_detail_reports_a_broken_checkpoint_and_reads_the_receipt_file(
    client, sessions, settings, runner
):
    job = _submit(client, 1, output_name="from-file")
    job_id = job["job_id"]
    _run(sessions, job_id, [1.0])
    bad = settings.adapters_dir / "from-file-checkpoint-step-00000001.kiln-checkpoint"
    bad.mkdir(parents=True)
    (settings.adapters_dir / "from-file").mkdir()
    (settings.adapters_dir / "from-file" / "train_receipt.json").write_text('{"from": "disk"}')
    with sessions.begin() as session:
        record_checkpoint(
            session,
            job_id,
            checkpoint_id="x",
            basename=bad.name,
            path=str(bad),
            global_step=1,
            epoch_index=0,
            cursor=1,
            manifest_sha256="sha256:" + "0" * 64,
            size_bytes=0,
            write_ms=0.0,
        )
        finish_job(session, job_id, "completed", worker_id="w-1")
    detail = client.get(f"/v1/train/jobs/{job_id}").get_json()
    assert detail["latest_checkpoint"] is None
    assert "manifest" in detail["checkpoint_error"] and bad.name in detail["checkpoint_error"]
    assert detail["train_receipt"] == {"from": "disk"}


def test_loss_history_is_thinned_to_1024_samples_keeping_the_last():
    from api.serializers import LOSS_HISTORY_MAX, loss_samples

    start = utcnow()
    job = SimpleNamespace(total_steps=3000, started_at=start)
    steps = [
        SimpleNamespace(global_step=i, epoch=0, loss=1.0 / i, created_at=start + timedelta(seconds=i))
        for i in range(1, 3001)
    ]
    samples = loss_samples(job, steps)
    assert len(samples) == LOSS_HISTORY_MAX
    assert samples[0].step == 1 and samples[-1].step == 3000 and samples[-1].progress == 1.0
    assert samples[-1].elapsed_secs == 3000.0
    assert [s.step for s in samples] == sorted({s.step for s in samples})


def test_events_are_paged_by_cursor(client, sessions, runner):
    job_id = _submit(client)["job_id"]
    with sessions.begin() as session:
        for i in range(4):
            append_event(session, job_id, "note", f"note {i}", data={"i": i})
    page = client.get(f"/v1/train/jobs/{job_id}/events?limit=2").get_json()
    assert [e["kind"] for e in page["data"]] == ["queued", "note"]
    assert page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (page["data"][0]["id"], page["data"][1]["id"])
    assert page["data"][0]["data"]["rows_kept"] == 2 and page["data"][0]["created_at"].endswith("Z")
    second = client.get(f"/v1/train/jobs/{job_id}/events?after={page['last_id']}&limit=2").get_json()
    assert [e["message"] for e in second["data"]] == ["note 1", "note 2"] and second["has_more"] is True
    last = client.get(f"/v1/train/jobs/{job_id}/events?after={second['last_id']}").get_json()
    assert [e["data"] for e in last["data"]] == [{"i": 3}] and last["has_more"] is False
    empty = client.get(f"/v1/train/jobs/{job_id}/events?after={last['last_id']}").get_json()
    assert empty == {"data": [], "has_more": False, "first_id": None, "last_id": None}


def test_event_query_parameters_are_checked(client, runner):
    job_id = _submit(client)["job_id"]
    for query in ("limit=0", "limit=1001", "limit=abc", "after=-1"):
        response = client.get(f"/v1/train/jobs/{job_id}/events?{query}")
        assert response.status_code == 400, query
        assert response.get_json()["error"]["code"] == "training_invalid_request"


def test_delete_job_only_when_finished(client, runner):
    job_id = _submit(client)["job_id"]
    active = client.delete(f"/v1/train/jobs/{job_id}")
    assert active.status_code == 409
    assert active.get_json()["error"]["code"] == "training_job_active"
    client.delete(f"/v1/train/queue/{job_id}")
    deleted = client.delete(f"/v1/train/jobs/{job_id}")
    assert deleted.status_code == 200
    assert deleted.get_json() == {"job_id": job_id, "status": "deleted", "removed_archive_file": False}
    assert client.get(f"/v1/train/status/{job_id}").status_code == 404
    assert client.get("/v1/train/status").get_json() == []
    again = client.delete(f"/v1/train/jobs/{job_id}")
    assert again.status_code == 404 and again.get_json()["error"]["code"] == "training_job_not_found"
