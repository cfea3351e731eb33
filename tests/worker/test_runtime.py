"""The resident worker runtime against the real store (SQLite and Postgres) and a real broker.

Jobs are admitted through the api; `run_job` is what the Celery task calls for a queue message.
A warm-shutdown release waits for a heartbeat that already read the run, so the lease it
expires is never renewed.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
from safetensors.torch import load_file
from sqlalchemy import update

from kiln import store
from kiln.store import states
from kiln.store.models import Admission, Job
from tests.api.conftest import sft_body, unique_name
from tests.worker.runtime_support import event_kinds, job_row, steps, submit
from worker.runtime import CurrentRun


def test_job_runs_to_completion_and_records_everything(client, runtime, sessions, settings):
    name = unique_name("done")
    job_id = submit(client, sft_body(3, epochs=2, checkpoint_interval=2, output_name=name, seed=11))
    assert runtime.run_job(job_id) == "completed"

    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.failure_reason is None
    assert job.global_step == job.total_steps == 6
    assert job.final_loss is not None and job.receipt["status"] == "success"
    assert job.adapter_path == str(settings.adapters_dir / name)
    assert steps(sessions, job_id) == [1, 2, 3, 4, 5, 6]
    kinds = event_kinds(sessions, job_id)
    assert kinds[:3] == ["queued", "started", "plan_verified"]
    assert kinds.count("epoch_complete") == 2 and kinds.count("checkpoint_saved") == 2
    assert kinds[-1] == "completed"
    with sessions() as s:
        adapter = store.get_adapter(s, name)
        assert adapter is not None and adapter.job_id == job_id and adapter.rank == 4
        assert [c.global_step for c in store.list_checkpoints(s, job_id)] == [2, 4]
    files = sorted(p.name for p in (settings.adapters_dir / name).iterdir())
    assert files == [
        "adapter_config.json",
        "adapter_manifest.json",
        "adapter_model.safetensors",
        "train_receipt.json",
    ]
    # A redelivered message for a finished job is dropped and changes nothing.
    assert runtime.run_job(job_id) == "dropped"
    assert job_row(sessions, job_id).attempts == 1


def _tamper(sessions, job_id, **admission) -> None:
    with sessions.begin() as s:
        s.execute(update(Admission).where(Admission.job_id == job_id).values(**admission))


@pytest.mark.parametrize(
    ("tamper", "field"),
    [
        ({"loss_route": "full_logits"}, "loss_route"),
        ({"execution_identity_digest": "sha256:" + "0" * 64}, "execution_identity"),
        ({"kept_corpus_sha256": "sha256:" + "1" * 64}, "data.kept_corpus_sha256"),
    ],
)
def test_pinned_plan_drift_fails_before_any_training(client, runtime, sessions, settings, tamper, field):
    name = unique_name("drift")
    job_id = submit(client, sft_body(2, output_name=name))
    _tamper(sessions, job_id, **tamper)
    assert runtime.run_job(job_id) == "failed"
    job = job_row(sessions, job_id)
    assert job.state == states.FAILED and job.failure_reason == "plan_drift"
    assert job.error_code == "training_plan_drift" and job.error_message.startswith(field)
    assert steps(sessions, job_id) == []
    assert not (settings.adapters_dir / name).exists()
    assert "plan_verified" not in event_kinds(sessions, job_id)


def test_dataset_changed_after_admission_is_plan_drift(client, runtime, sessions, settings):
    data = settings.datasets_dir / "rows.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    rows = sft_body(3)["examples"]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    body = {"dataset_path": "rows.jsonl", "config": sft_body(1)["config"]}
    job_id = submit(client, body)
    rows[1]["messages"][1]["content"] = "an edited answer"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    assert runtime.run_job(job_id) == "failed"
    job = job_row(sessions, job_id)
    assert job.failure_reason == "plan_drift" and "dataset file changed" in job.error_message


def test_cancelled_queued_job_never_starts(client, runtime, sessions):
    job_id = submit(client, sft_body(2))
    response = client.delete(f"/v1/train/queue/{job_id}")
    assert response.status_code == 200 and response.get_json()["status"] == "cancelled"
    assert runtime.run_job(job_id) == "dropped"
    job = job_row(sessions, job_id)
    assert job.state == states.FAILED and job.failure_reason == "cancelled"
    assert job.started_at is None and steps(sessions, job_id) == []


def test_cancelled_running_job_stops_at_a_step_boundary_with_a_checkpoint(
    client, runtime, sessions, settings
):
    name = unique_name("cancel")
    job_id = submit(client, sft_body(4, epochs=3, output_name=name))
    original = runtime.recording.on_step

    def on_step(jid, report):
        original(jid, report)
        if report.global_step == 3:
            assert client.delete(f"/v1/train/queue/{jid}").get_json()["status"] == "cancelling"

    runtime.recording.on_step = on_step
    assert runtime.run_job(job_id) == "failed"
    job = job_row(sessions, job_id)
    assert job.failure_reason == "cancelled" and job.global_step == 4  # the flag is seen after step 4's write
    assert job.receipt["status"] == "failed" and job.receipt["failure_reason"] == "cancelled"
    assert job.latest_checkpoint == f"{name}-checkpoint-step-00000004.kiln-checkpoint"
    assert (settings.adapters_dir / job.latest_checkpoint / "checkpoint_manifest.json").is_file()
    assert not (settings.adapters_dir / name).exists()


def test_worker_shutdown_releases_the_job_and_the_resume_is_bit_exact(
    client, runtime, sessions, settings, broker
):
    """A warm shutdown mid-job checkpoints, requeues, and the resumed run equals a straight run."""
    straight, resumed = unique_name("straight"), unique_name("resumed")
    config = {"epochs": 2, "seed": 1234, "checkpoint_interval": 100, "optimizer": {"kind": "adam_w"}}
    straight_id = submit(client, sft_body(3, output_name=straight, **config))
    assert runtime.run_job(straight_id) == "completed"

    job_id = submit(client, sft_body(3, output_name=resumed, **config))
    original = runtime.recording.on_step

    def on_step(jid, report):
        original(jid, report)
        if report.global_step == 4:
            runtime.request_shutdown()

    runtime.recording.on_step = on_step
    assert runtime.run_job(job_id) == "requeued"
    job = job_row(sessions, job_id)
    assert job.state == states.QUEUED and job.resume_checkpoint.endswith("step-00000004.kiln-checkpoint")
    assert job_id in broker.task_ids()  # republished by the reconciler

    runtime.recording.on_step = original
    runtime.shutdown.clear()
    assert runtime.run_job(job_id) == "completed"
    job = job_row(sessions, job_id)
    assert job.attempts == 2 and steps(sessions, job_id) == list(range(1, 7))
    a = load_file(str(settings.adapters_dir / straight / "adapter_model.safetensors"))
    b = load_file(str(settings.adapters_dir / resumed / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)
    with sessions() as s:
        history_a = [r.loss for r in store.loss_history(s, straight_id)]
        history_b = [r.loss for r in store.loss_history(s, job_id)]
    assert history_a == history_b


def test_an_expired_lease_without_checkpoint_restarts_from_step_zero(client, runtime, sessions, settings):
    """No checkpoint to resume: the job runs again from step 0 with its pinned seed (the same
    bits) while attempts remain; only then does it fail `worker_lost`. The first attempt reached
    step 1, further than any before it (progress); the next ones died there again (none)."""
    body = sft_body(2, seed=31)
    reference = submit(client, {**body, "config": {**body["config"], "output_name": unique_name("ref")}})
    assert runtime.run_job(reference) == "completed"
    job_id = submit(client, body)
    last = settings.training.max_attempts + 1
    for attempt in range(1, last + 1):
        with sessions.begin() as s:
            assert store.claim_job(s, job_id, "dead-worker", lease_seconds=30).attempts == attempt
            store.record_step(
                s,
                job_id,
                "dead-worker",
                global_step=1,
                epoch=0,
                loss=1.0,
                learning_rate=1e-3,
                step_ms=1.0,
                tokens=3,
                supervised_tokens=1,
            )
            s.execute(
                update(Job)
                .where(Job.id == job_id)
                .values(lease_expires_at=store.utcnow() - timedelta(seconds=1))
            )
        done = runtime.reconciler.run_once()
        job = job_row(sessions, job_id)
        if attempt < last:
            assert done["resumed"] == 1 and job.state == states.QUEUED and job.global_step == 0
            assert steps(sessions, job_id) == []  # the lost attempt's rows are dropped
            with sessions() as s:
                events, _ = store.list_events(s, job_id, limit=1000)
            requeued = [e for e in events if e.kind == "requeued"][-1]
            assert requeued.data["restart"] is True and requeued.data["attempts"] == attempt
            assert "restarting from step 0" in requeued.message
            assert requeued.data["progress"]["advanced"] is (attempt == 1)
            assert requeued.data["progress"]["stalled_attempts"] == attempt - 1
        else:
            assert done["failed"] == 1
            assert job.state == states.FAILED and job.failure_reason == "worker_lost"
    assert runtime.run_job(job_id) == "dropped"


def test_a_restarted_job_computes_the_same_adapter(client, runtime, sessions, settings):
    body = sft_body(3, epochs=2, seed=32)
    names = [unique_name("once"), unique_name("twice")]
    first = submit(client, {**body, "config": {**body["config"], "output_name": names[0]}})
    assert runtime.run_job(first) == "completed"
    second = submit(client, {**body, "config": {**body["config"], "output_name": names[1]}})
    with sessions.begin() as s:
        assert store.claim_job(s, second, "dead-worker", lease_seconds=30) is not None
        s.execute(
            update(Job).where(Job.id == second).values(lease_expires_at=store.utcnow() - timedelta(seconds=1))
        )
    assert runtime.reconciler.run_once()["resumed"] == 1
    assert runtime.run_job(second) == "completed"
    assert job_row(sessions, second).attempts == 2
    a, b = (settings.adapters_dir / n / "adapter_model.safetensors" for n in names)
    assert a.read_bytes() == b.read_bytes()


def test_unpublished_job_is_published_by_the_reconciler(client, app, runtime, sessions, settings, broker):
    class BrokenBroker:
        def send_task(self, *args, **kwargs):
            raise ConnectionError("broker down")

    app.extensions["kiln"].celery = BrokenBroker()
    job_id = submit(client, sft_body(2))
    assert broker.task_ids() == []
    with sessions.begin() as s:  # older than the reconciler's publish grace period
        s.execute(
            update(Job).where(Job.id == job_id).values(submitted_at=store.utcnow() - timedelta(minutes=1))
        )
    assert runtime.reconciler.run_once()["republished"] == 1
    assert broker.task_ids() == [job_id]
    assert job_row(sessions, job_id).published_at is not None
    assert "republished" in event_kinds(sessions, job_id)


def test_a_job_past_its_delivery_budget_fails(client, runtime, sessions, settings):
    job_id = submit(client, sft_body(2))
    with sessions.begin() as s:
        s.execute(update(Job).where(Job.id == job_id).values(attempts=settings.training.max_attempts))
    assert runtime.run_job(job_id) == "dropped"
    job = job_row(sessions, job_id)
    assert job.state == states.FAILED and job.failure_reason == "worker_lost"
    assert "gave up" in job.error_message and steps(sessions, job_id) == []


def test_any_queue_message_runs_the_oldest_queued_job_first(client, runtime, sessions):
    """Messages may arrive out of admission order; execution still follows queue_seq (FIFO)."""
    ids = [submit(client, sft_body(1, output_name=unique_name(f"fifo{i}"))) for i in range(3)]
    assert runtime.run_job(ids[2]) == "completed"
    jobs = [job_row(sessions, i) for i in ids]
    assert [j.state for j in jobs] == [states.COMPLETED] * 3
    assert jobs[0].started_at < jobs[1].started_at < jobs[2].started_at
    assert [runtime.run_job(i) for i in ids[:2]] == ["dropped", "dropped"]


def test_an_adapter_name_taken_after_admission_fails_the_job_cleanly(client, runtime, sessions, settings):
    name = unique_name("taken")
    job_id = submit(client, sft_body(2, output_name=name))
    (settings.adapters_dir / name).mkdir(parents=True)  # someone published that name meanwhile
    assert runtime.run_job(job_id) == "failed"
    job = job_row(sessions, job_id)
    assert job.state == states.FAILED and job.failure_reason == "training_error"
    assert "already exists" in job.error_message and steps(sessions, job_id) == []


# ----- a release and a heartbeat that already read the run ----------------------------------------


class _PausingFactory:
    """The runtime's session factory, pausing `begin()` on the thread named `pause_thread`."""

    def __init__(self, inner, pause_thread: str):
        self.inner, self.pause_thread = inner, pause_thread
        self.entered, self.go = threading.Event(), threading.Event()

    def begin(self):
        if threading.current_thread().name == self.pause_thread:
            self.entered.set()
            assert self.go.wait(30)
        return self.inner.begin()

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_a_release_waits_for_the_heartbeat_that_already_read_the_run(client, runtime, sessions):
    job_id = submit(client, sft_body(2, output_name=unique_name("hb-race")))
    pinned = runtime._claim(job_id)
    assert pinned is not None
    runtime.run = CurrentRun(job_id, 1, pinned.attempt)
    factory = runtime.factory
    pausing = runtime.factory = _PausingFactory(factory, "hb")
    outcome: list[str] = []
    heartbeat = threading.Thread(target=runtime.heartbeat, name="hb")
    release = threading.Thread(target=lambda: outcome.append(runtime._release_for_resume(job_id)), name="rel")
    try:
        heartbeat.start()
        assert pausing.entered.wait(30)  # the heartbeat holds the run it read, not yet renewed
        release.start()
        time.sleep(0.5)
        assert release.is_alive(), "the release went ahead of a heartbeat that had read the run"
        pausing.go.set()
        heartbeat.join(30)
        release.join(30)
    finally:
        pausing.go.set()
        runtime.factory = factory
    assert outcome == ["requeued"] and runtime.run is None
    job = job_row(sessions, job_id)
    # Let go: requeued (from step 0: no checkpoint here), never running on a renewed lease.
    renewed = job.lease_expires_at is not None and job.lease_expires_at > store.utcnow()
    assert not (job.state == "running" and renewed), (job.state, job.lease_expires_at)
    assert job.state == "queued" and job.global_step == 0
