"""Failures around the resident runtime (docs/recovery.md#database-outages): broken storage, a job
store that blinks, a lease that runs out under a live worker or is taken from it, a worker killed
while publishing. The row must always end in a truthful state, a job never runs twice, and
nothing half-published or unrecorded keeps a name a later run needs.

Real store (SQLite and Postgres), real broker; faults are injected only where a real one cannot
be produced in-process (an outage of the database connection, a kill at an exact point).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest
from sqlalchemy import update
from sqlalchemy.exc import OperationalError

from kiln import store
from kiln.store import states
from kiln.store.models import Job, Runner
from tests.api.conftest import sft_body, unique_name
from tests.worker.runtime_support import (
    Killed,
    checkpoint_names,
    event_kinds,
    expire_lease,
    job_row,
    steps,
    submit,
)


class FlakyStore:
    """The runtime's session factory with injected connection failures: the next `fail_before`
    transactions fail before they commit, the next `fail_after` ones right after they commit
    (the answer is lost, the write is not)."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.fail_before = 0
        self.fail_after = 0
        self.healthy_first = 0  # transactions that pass before the armed failures apply

    def __call__(self, *args, **kwargs):
        return self.factory(*args, **kwargs)

    @contextlib.contextmanager
    def begin(self):
        if self.healthy_first:
            self.healthy_first -= 1
            with self.factory.begin() as session:
                yield session
            return
        if self.fail_before:
            self.fail_before -= 1
            raise OperationalError("BEGIN", {}, ConnectionError("server closed the connection unexpectedly"))
        with self.factory.begin() as session:
            yield session
        if self.fail_after:
            self.fail_after -= 1
            raise OperationalError("COMMIT", {}, ConnectionError("connection lost after COMMIT"))


@pytest.fixture
def flaky(runtime) -> FlakyStore:
    runtime.factory = FlakyStore(runtime.factory)
    runtime.db_retry_delays = (0.01, 0.01, 0.01)
    return runtime.factory


def test_unusable_output_root_fails_the_job_instead_of_leaving_it_running(
    client, runtime, sessions, settings
):
    """The trainer could not publish the adapter nor even its failed receipt; the exception left
    the worker and the row stayed `running` until the lease ran out."""
    name = unique_name("noroot")
    job_id = submit(client, sft_body(2, output_name=name))
    adapters = settings.adapters_dir
    adapters.rename(adapters.with_name("adapters-moved"))
    adapters.write_text("not a directory\n")  # every write under the output root now fails
    try:
        assert runtime.run_job(job_id) == "failed"
    finally:
        adapters.unlink()
        adapters.with_name("adapters-moved").rename(adapters)
    job = job_row(sessions, job_id)
    assert job.state == states.FAILED and job.failure_reason == "training_error"
    assert job.error_code == "training_worker_error" and "worker error:" in job.error_message
    assert job.lease_expires_at is None and job.adapter_path is None
    with sessions() as s:
        assert store.get_adapter(s, name) is None
    assert not (adapters / name).exists()
    assert runtime.run_job(job_id) == "dropped"  # a redelivered message changes nothing


def test_a_brief_store_outage_while_recording_progress_is_ridden_out(client, runtime, sessions, flaky):
    """One failed progress write does not fail the job; a write whose commit went through but
    whose answer was lost is not written twice either."""
    job_id = submit(client, sft_body(2, epochs=2, output_name=unique_name("blip")))
    original = runtime.recording.on_step

    def on_step(jid, report):
        if report.global_step == 2:
            flaky.fail_before = 2  # the connection drops twice, then comes back
        if report.global_step == 3:
            flaky.fail_after = 1  # step 3 commits, the acknowledgement is lost
        original(jid, report)

    runtime.recording.on_step = on_step
    assert runtime.run_job(job_id) == "completed"
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.global_step == 4
    assert steps(sessions, job_id) == [1, 2, 3, 4]
    assert event_kinds(sessions, job_id).count("epoch_complete") == 2


def test_a_long_store_outage_mid_run_leaves_the_job_to_be_resumed(client, runtime, sessions, flaky):
    """Progress could not be recorded through all retries: the job does not end `failed` with the
    OperationalError as a training error; it is left running for the reconciler, which resumes it
    from its newest checkpoint once the lease has run out."""
    name = unique_name("outage")
    job_id = submit(client, sft_body(3, epochs=1, checkpoint_interval=1, output_name=name))
    original = runtime.recording.on_step

    def on_step(jid, report):
        if report.global_step == 2:
            flaky.fail_before = len(runtime.db_retry_delays) + 1  # every attempt fails
        original(jid, report)

    runtime.recording.on_step = on_step
    with pytest.raises(OperationalError):
        runtime.run_job(job_id)
    runtime.recording.on_step = original
    job = job_row(sessions, job_id)
    assert job.state == states.RUNNING and job.failure_reason is None and steps(sessions, job_id) == [1]
    expire_lease(sessions, job_id)
    assert runtime.reconciler.run_once()["resumed"] == 1
    assert runtime.run_job(job_id) == "completed"
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.attempts == 2
    assert steps(sessions, job_id) == [1, 2, 3]


def test_store_down_at_dequeue_retries_the_message(client, runtime, sessions, broker, flaky):
    """The task retries until the store answers and runs the job, rather than failing and being
    acknowledged, which would leave the published `queued` row waiting for a message."""
    from kiln.broker import TRAIN_SFT_TASK
    from worker.tasks import install_runtime

    train_sft_task = runtime.celery.tasks[TRAIN_SFT_TASK]
    job_id = submit(client, sft_body(1, output_name=unique_name("down")))
    flaky.fail_before = 8  # two whole deliveries find the store unreachable
    install_runtime(runtime)
    try:
        result = train_sft_task.apply(args=[job_id])
    finally:
        install_runtime(None)
    assert result.state == "SUCCESS" and result.get() == "completed"
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.attempts == 1


def test_a_message_during_shutdown_is_handed_back_unclaimed(client, runtime, sessions):
    """A worker in warm shutdown hands the next message (often the job it has just released) back
    to the broker unclaimed, rather than run one step, checkpoint and release it again."""
    from celery.exceptions import Reject

    from kiln.broker import TRAIN_SFT_TASK
    from worker.tasks import install_runtime

    train_sft_task = runtime.celery.tasks[TRAIN_SFT_TASK]
    job_id = submit(client, sft_body(1, output_name=unique_name("shut")))
    runtime.shutdown.set()
    assert runtime.run_job(job_id) == "deferred"
    install_runtime(runtime)
    try:
        with pytest.raises(Reject) as rejected:
            train_sft_task.run(job_id)
    finally:
        install_runtime(None)
    assert rejected.value.requeue is True
    job = job_row(sessions, job_id)
    assert job.state == states.QUEUED and job.attempts == 0 and job.worker_id is None
    assert steps(sessions, job_id) == []
    runtime.shutdown.clear()
    assert runtime.run_job(job_id) == "completed"


def test_a_claim_whose_commit_answer_was_lost_is_run_not_stranded(client, runtime, sessions, flaky):
    """The claim committed but the connection dropped before the answer: a retry finds the job
    `running` under this very worker. Dropping the message then would strand it until the lease
    ran out (and burn a delivery attempt)."""
    job_id = submit(client, sft_body(2, output_name=unique_name("claimlost")))
    flaky.healthy_first = 1  # the FIFO look-up passes; the claim's COMMIT answer is lost
    flaky.fail_after = 1
    assert runtime.run_job(job_id) == "completed"
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.attempts == 1
    assert event_kinds(sessions, job_id).count("started") == 1


def test_an_expired_lease_under_a_live_worker_is_not_taken_over(
    client, runtime, second_worker, sessions, settings
):
    """Another worker's reconciler requeued (or failed) a job whose owner was still training it:
    two runners on one job."""
    name = unique_name("alive")
    job_id = submit(client, sft_body(4, epochs=1, checkpoint_interval=2, output_name=name))
    seen: dict = {}
    original = runtime.recording.on_step

    def on_step(jid, report):
        original(jid, report)
        if report.global_step == 3:
            expire_lease(sessions, jid)  # a stalled renewal, a clock step: the lease ran out
            seen["reconciled"] = second_worker.reconciler.run_once()
            seen["redelivered"] = second_worker.run_job(jid)
            seen["state"] = job_row(sessions, jid).state

    runtime.recording.on_step = on_step
    assert runtime.run_job(job_id) == "completed"
    assert seen["reconciled"]["resumed"] == 0 and seen["reconciled"]["failed"] == 0
    assert seen["redelivered"] == "dropped" and seen["state"] == states.RUNNING
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.attempts == 1 and job.worker_id == runtime.worker_id
    assert steps(sessions, job_id) == [1, 2, 3, 4]
    assert event_kinds(sessions, job_id).count("started") == 1
    assert second_worker.run_job(job_id) == "dropped"


def test_a_dead_workers_expired_lease_is_still_taken_over(client, runtime, second_worker, sessions):
    """The liveness guard must not shelter a worker that stopped beating."""
    job_id = submit(client, sft_body(2, output_name=unique_name("dead")))
    with sessions.begin() as s:
        assert store.claim_job(s, job_id, runtime.worker_id, lease_seconds=30) is not None
        store.heartbeat_runner(s, runtime.worker_id, current_job_id=job_id)
        s.execute(
            update(Runner)
            .where(Runner.id == runtime.worker_id)
            .values(heartbeat_at=store.utcnow() - timedelta(seconds=5))
        )
    expire_lease(sessions, job_id)  # expired after the owner's last heartbeat: the owner died
    assert second_worker.reconciler.run_once()["resumed"] == 1  # no checkpoint: from step 0 again
    job = job_row(sessions, job_id)
    assert job.state == states.QUEUED and job.worker_id is None and job.failure_reason is None


def test_a_worker_that_lost_its_job_stops_and_publishes_nothing_more(client, runtime, sessions, settings):
    """The job was taken over (another owner now runs it) right after this worker recorded step 2:
    the step-2 checkpoint it was about to publish fails its fence check, so nothing appears under
    the new owner's names and nothing more is recorded."""
    name = unique_name("taken")
    job_id = submit(client, sft_body(4, epochs=1, checkpoint_interval=1, output_name=name))
    original = runtime.recording.on_step

    def on_step(jid, report):
        original(jid, report)
        if report.global_step == 2:
            with sessions.begin() as s:  # the reconciler gave the job to worker-2
                s.execute(update(Job).where(Job.id == jid).values(worker_id="worker-2"))

    runtime.recording.on_step = on_step
    assert runtime.run_job(job_id) == "lost"
    job = job_row(sessions, job_id)
    assert job.state == states.RUNNING and job.worker_id == "worker-2" and job.failure_reason is None
    assert steps(sessions, job_id) == [1, 2]
    assert checkpoint_names(settings, name) == [f"{name}-checkpoint-step-00000001.kiln-checkpoint"]
    with sessions() as s:
        assert [c.global_step for c in store.list_checkpoints(s, job_id)] == [1]
    assert not (settings.adapters_dir / name).exists()
    assert [p.name for p in settings.adapters_dir.iterdir() if p.name.startswith(".")] == []


def _killed_after_publishing_step_4(client, runtime, name):
    """Submits a six-step job checkpointing every two steps; its first attempt dies once the step-4
    checkpoint stands under its final name, before the store records it."""
    job_id = submit(client, sft_body(3, epochs=2, checkpoint_interval=2, seed=5, output_name=name))
    original = runtime.recording.on_checkpoint

    def on_checkpoint(jid, record):
        if record["global_step"] == 4:
            raise Killed  # after the rename, before the row
        original(jid, record)

    runtime.recording.on_checkpoint = on_checkpoint
    with pytest.raises(Killed):
        runtime.run_job(job_id)
    runtime.recording.on_checkpoint = original
    return job_id


def test_a_checkpoint_killed_between_publishing_and_recording_is_adopted(client, runtime, sessions, settings):
    """The checkpoint was complete under its final name but not in the store (its step was): the
    next attempt resumes from it, recorded as adopted, instead of redoing the steps before it."""
    name = unique_name("ckkill")
    job_id = _killed_after_publishing_step_4(client, runtime, name)
    step4 = f"{name}-checkpoint-step-00000004.kiln-checkpoint"
    assert job_row(sessions, job_id).state == states.RUNNING and step4 in checkpoint_names(settings, name)
    expire_lease(sessions, job_id)
    assert runtime.reconciler.run_once()["resumed"] == 1
    job = job_row(sessions, job_id)
    assert job.state == states.QUEUED and job.resume_checkpoint == step4 and job.global_step == 4
    with sessions() as s:
        adopted = store.get_checkpoint(s, job_id, step4)
        assert adopted is not None and adopted.write_ms is None
        events, _ = store.list_events(s, job_id, limit=1000)
        assert any(e.kind == "checkpoint_saved" and (e.data or {}).get("adopted") for e in events)
    from kiln_train import checkpoint as ckpt

    assert (
        "sha256:" + ckpt.load_checkpoint(settings.adapters_dir / step4).manifest_sha256
        == adopted.manifest_sha256
    )
    assert runtime.run_job(job_id) == "completed"
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.attempts == 2 and job.global_step == 6
    assert steps(sessions, job_id) == [1, 2, 3, 4, 5, 6]
    with sessions() as s:
        assert [c.global_step for c in store.list_checkpoints(s, job_id)] == [2, 4]
        assert store.get_adapter(s, name).job_id == job_id
        events, _ = store.list_events(s, job_id, limit=1000)
    started = [e for e in events if e.kind == "started"]
    assert [(e.data["attempt"], e.data["start_step"]) for e in started] == [(1, 0), (2, 4)]


def test_an_unrecorded_checkpoint_that_does_not_verify_is_withdrawn_not_adopted(
    client, runtime, sessions, settings
):
    """The worker died between publishing a checkpoint and recording it, and the published copy
    is damaged (a flipped byte): the next attempt does not adopt it but withdraws it, resumes from
    the recorded checkpoint before it, and writes and records that step again."""
    name = unique_name("ckorphan")
    job_id = _killed_after_publishing_step_4(client, runtime, name)
    step2 = f"{name}-checkpoint-step-00000002.kiln-checkpoint"
    step4 = f"{name}-checkpoint-step-00000004.kiln-checkpoint"
    assert step4 in checkpoint_names(settings, name)
    weights = settings.adapters_dir / step4 / "adapter.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    expire_lease(sessions, job_id)
    assert runtime.reconciler.run_once()["resumed"] == 1
    job = job_row(sessions, job_id)
    assert job.state == states.QUEUED and job.resume_checkpoint == step2 and job.global_step == 2
    assert step4 not in checkpoint_names(settings, name)
    with sessions() as s:
        assert [c.global_step for c in store.list_checkpoints(s, job_id)] == [2]
        events, _ = store.list_events(s, job_id, limit=1000)
    assert not any((e.data or {}).get("adopted") for e in events)
    assert runtime.run_job(job_id) == "completed"
    assert steps(sessions, job_id) == [1, 2, 3, 4, 5, 6]
    with sessions() as s:
        assert [c.global_step for c in store.list_checkpoints(s, job_id)] == [2, 4]
    from kiln_train import checkpoint as ckpt

    ckpt.load_checkpoint(settings.adapters_dir / step4, verify_hashes=True)  # the rewritten one verifies


def test_a_recorded_checkpoint_damaged_on_disk_is_skipped_and_rewritten_on_resume(
    client, runtime, sessions, settings
):
    """The newest recorded checkpoint no longer validates (a flipped byte): the job resumes from
    the one before it, the damaged one is withdrawn with its row, and the resumed run writes and
    records that step again instead of failing on the taken name."""
    name = unique_name("ckrot")
    job_id = submit(client, sft_body(3, epochs=3, checkpoint_interval=2, seed=5, output_name=name))
    original = runtime.recording.on_step

    def on_step(jid, report):
        original(jid, report)
        if report.global_step == 5:
            raise Killed

    runtime.recording.on_step = on_step
    with pytest.raises(Killed):
        runtime.run_job(job_id)
    runtime.recording.on_step = original
    step4 = f"{name}-checkpoint-step-00000004.kiln-checkpoint"
    with sessions() as s:
        assert [c.global_step for c in store.list_checkpoints(s, job_id)] == [2, 4]
    adapter_file = settings.adapters_dir / step4 / "adapter.safetensors"
    data = bytearray(adapter_file.read_bytes())
    data[-1] ^= 0x01
    adapter_file.write_bytes(bytes(data))
    expire_lease(sessions, job_id)
    assert runtime.reconciler.run_once()["resumed"] == 1
    job = job_row(sessions, job_id)
    assert job.state == states.QUEUED
    assert (
        job.resume_checkpoint == f"{name}-checkpoint-step-00000002.kiln-checkpoint" and job.global_step == 2
    )
    assert step4 not in checkpoint_names(settings, name)
    with sessions() as s:
        assert [c.global_step for c in store.list_checkpoints(s, job_id)] == [2]
    assert runtime.run_job(job_id) == "completed"
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.global_step == 9
    assert steps(sessions, job_id) == list(range(1, 10))
    with sessions() as s:
        recorded = store.list_checkpoints(s, job_id)
        assert [c.global_step for c in recorded] == [2, 4, 6, 8]
    from kiln_train import checkpoint as ckpt

    rewritten = ckpt.load_checkpoint(settings.adapters_dir / step4, verify_hashes=True)
    assert "sha256:" + rewritten.manifest_sha256.removeprefix("sha256:") == recorded[1].manifest_sha256


def test_killed_after_publishing_the_adapter_completes_from_it(client, runtime, sessions, settings):
    """The adapter was published under its final name, then the worker died before recording it:
    the reconciler completes the job from that adapter and registers it, rather than failing the
    job `worker_lost` and leaving an unregistered adapter holding the name."""
    name = unique_name("adkill")
    job_id = submit(client, sft_body(2, epochs=1, output_name=name))

    def killed(pinned, result):
        raise Killed

    runtime._record_result = killed
    with pytest.raises(Killed):
        runtime.run_job(job_id)
    assert (settings.adapters_dir / name / "adapter_model.safetensors").is_file()
    assert job_row(sessions, job_id).state == states.RUNNING
    expire_lease(sessions, job_id)
    assert runtime.reconciler.run_once()["completed"] == 1
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.failure_reason is None
    assert job.adapter_path == str(settings.adapters_dir / name) and job.receipt["status"] == "success"
    with sessions() as s:
        adapter = store.get_adapter(s, name)
        assert adapter is not None and adapter.job_id == job_id and adapter.rank == 4
    assert runtime.run_job(job_id) == "dropped"


def test_killed_before_the_adapter_rename_is_never_completed(
    client, runtime, sessions, settings, monkeypatch
):
    """A kill inside adapter publication leaves only a hidden staging directory: the job is not
    completed from it, the staging goes at once (its owner is known dead) and the job runs again
    from step 0."""
    import kiln_train.train.trainer

    name = unique_name("prekill")
    job_id = submit(client, sft_body(2, epochs=1, output_name=name))

    def killed_mid_publication(*args, **kwargs):
        (settings.adapters_dir / f".{name}.incomplete-0000").mkdir()
        raise Killed

    monkeypatch.setattr(kiln_train.train.trainer, "publish_success", killed_mid_publication)
    with pytest.raises(Killed):
        runtime.run_job(job_id)
    expire_lease(sessions, job_id)
    assert runtime.reconciler.run_once()["resumed"] == 1
    job = job_row(sessions, job_id)
    assert job.state == states.QUEUED and job.global_step == 0 and job.resume_checkpoint is None
    assert not (settings.adapters_dir / name).exists()
    assert not (settings.adapters_dir / f".{name}.incomplete-0000").exists()
    with sessions() as s:
        assert store.get_adapter(s, name) is None
    monkeypatch.undo()
    assert runtime.run_job(job_id) == "completed"
    with sessions() as s:
        assert store.get_adapter(s, name).job_id == job_id
