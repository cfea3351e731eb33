"""A worker that stalls past its lease and wakes after its job was given to another claim must
change nothing the current owner records or publishes (docs/ARCHITECTURE.md#fencing).

Two resident runtimes share the real store (SQLite and Postgres) and broker. The stale one runs
its job in a thread that is held at an exact point of a publication (what a SIGSTOP there does:
a real-process SIGSTOP test is in test_recovery_e2e.py); meanwhile its lease runs out, its runner
row goes silent, the other worker's reconciler takes the job over and the other worker runs it.
Then the stale thread is let go.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

from sqlalchemy import update

from kiln import store
from kiln.store import states
from kiln.store.models import Job, Runner
from kiln_train import checkpoint as ckpt
from kiln_train.artifacts import adapter as adapter_module
from kiln_train.checkpoint import publish as publish_module
from tests.api.conftest import sft_body, unique_name
from tests.worker.runtime_support import checkpoint_names, event_kinds, job_row, steps, submit


class Stall:
    """Holds the stale worker's thread right after `original` returns for a matching target."""

    def __init__(self, thread_name: str, matches) -> None:
        self.thread_name = thread_name
        self.matches = matches
        self.reached = threading.Event()
        self.release = threading.Event()

    def wrap(self, original):
        def wrapped(source, target, *args, **kwargs):
            result = original(source, target, *args, **kwargs)
            if threading.current_thread().name == self.thread_name and self.matches(Path(target)):
                self.reached.set()
                assert self.release.wait(120), "the stalled worker was never let go"
            return result

        return wrapped


def run_in_thread(runtime, job_id: str, name: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def target() -> None:
        out["outcome"] = runtime.run_job(job_id)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread, out


def presume_dead(sessions, job_id: str, worker_id: str) -> None:
    """The lease ran out and the runner went silent: what a stalled process looks like."""
    past = store.utcnow() - timedelta(seconds=600)
    with sessions.begin() as s:
        s.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=past))
        s.execute(update(Runner).where(Runner.id == worker_id).values(heartbeat_at=past))


def reference_adapter(client, runtime, settings, body: dict) -> bytes:
    """The adapter bytes of an uninterrupted run of the same job (another name, same seed)."""
    name = unique_name("reference")
    ref = submit(client, {**body, "config": {**body["config"], "output_name": name}})
    assert runtime.run_job(ref) == "completed"
    return (settings.adapters_dir / name / adapter_module.ADAPTER_MODEL).read_bytes()


def test_a_stale_owner_that_wakes_after_a_takeover_leaves_the_new_owners_checkpoints(
    client, runtime, second_worker, sessions, settings, monkeypatch
):
    """Held right after renaming the step-2 checkpoint into place, before recording it."""
    name = unique_name("stale-ckpt")
    body = sft_body(3, epochs=2, checkpoint_interval=1, seed=21, output_name=name)
    expected = reference_adapter(client, second_worker, settings, body)
    job_id = submit(client, body)
    stall = Stall("stale-worker", lambda target: target.name.endswith("-step-00000002.kiln-checkpoint"))
    monkeypatch.setattr(publish_module, "rename_into_place", stall.wrap(publish_module.rename_into_place))
    thread, out = run_in_thread(runtime, job_id, "stale-worker")
    assert stall.reached.wait(120)

    presume_dead(sessions, job_id, runtime.worker_id)
    reconciled = second_worker.reconciler.run_once()
    assert reconciled["resumed"] == 1
    assert second_worker.run_job(job_id) == "completed"
    finished = job_row(sessions, job_id)
    assert finished.state == states.COMPLETED and finished.attempts == 2
    assert finished.worker_id == second_worker.worker_id

    stall.release.set()
    thread.join(120)
    assert out["outcome"] == "lost"

    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.failure_reason is None
    assert steps(sessions, job_id) == [1, 2, 3, 4, 5, 6]
    with sessions() as s:
        recorded = {c.basename: c.manifest_sha256 for c in store.list_checkpoints(s, job_id)}
    assert sorted(recorded) == checkpoint_names(settings, name)  # every recorded one is on disk
    for basename, digest in recorded.items():
        loaded = ckpt.load_checkpoint(settings.adapters_dir / basename)
        assert "sha256:" + loaded.manifest_sha256 == digest
    assert (settings.adapters_dir / name / adapter_module.ADAPTER_MODEL).read_bytes() == expected
    assert [p.name for p in settings.adapters_dir.iterdir() if p.name.startswith(".")] == []


def test_a_stale_owner_that_wakes_after_its_adapter_completed_the_job_does_not_withdraw_it(
    client, runtime, second_worker, sessions, settings, monkeypatch
):
    """Held right after renaming the adapter into place, before recording the completion: the
    reconciler completes the job from that adapter, and the stale worker must not take it back."""
    name = unique_name("stale-adapter")
    job_id = submit(client, sft_body(2, epochs=1, seed=22, output_name=name))
    stall = Stall("stale-worker", lambda target: target.name == name)
    monkeypatch.setattr(adapter_module, "rename_no_replace", stall.wrap(adapter_module.rename_no_replace))
    thread, out = run_in_thread(runtime, job_id, "stale-worker")
    assert stall.reached.wait(120)

    presume_dead(sessions, job_id, runtime.worker_id)
    assert second_worker.reconciler.run_once()["completed"] == 1
    stall.release.set()
    thread.join(120)
    assert out["outcome"] == "lost"

    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.attempts == 1
    adapter_dir = settings.adapters_dir / name
    assert (adapter_dir / adapter_module.ADAPTER_MODEL).is_file()
    with sessions() as s:
        assert store.get_adapter(s, name).job_id == job_id
    download = client.get(f"/v1/adapters/{name}/download")
    assert download.status_code == 200


def test_a_stale_owner_woken_before_publishing_its_adapter_publishes_nothing(
    client, runtime, second_worker, sessions, settings, monkeypatch
):
    """Held between the last step and the adapter publication (its staging is written): the job
    is restarted elsewhere and completed there; the stale run's adapter never appears and the
    completed job keeps the current owner's adapter."""
    name = unique_name("stale-late")
    body = sft_body(2, epochs=1, seed=23, output_name=name)
    expected = reference_adapter(client, second_worker, settings, body)
    job_id = submit(client, body)
    reached, release = threading.Event(), threading.Event()
    original = adapter_module.fsync_dir

    def fsync_dir(path):
        original(path)
        staging = Path(path).name.startswith(f".{name}.incomplete-")
        if staging and threading.current_thread().name == "stale-worker":
            reached.set()
            assert release.wait(120)

    monkeypatch.setattr(adapter_module, "fsync_dir", fsync_dir)
    thread, out = run_in_thread(runtime, job_id, "stale-worker")
    assert reached.wait(120)
    presume_dead(sessions, job_id, runtime.worker_id)
    assert second_worker.reconciler.run_once()["resumed"] == 1  # restarted from step 0
    assert second_worker.run_job(job_id) == "completed"
    release.set()
    thread.join(120)
    assert out["outcome"] == "lost"

    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.attempts == 2 and job.failure_reason is None
    assert (settings.adapters_dir / name / adapter_module.ADAPTER_MODEL).read_bytes() == expected
    with sessions() as s:
        assert store.get_adapter(s, name).job_id == job_id
    assert [
        p.name for p in settings.adapters_dir.iterdir() if name in p.name and p.name.startswith(".")
    ] == []


def test_a_stale_owner_writes_no_row_after_its_claim_is_superseded(
    client, runtime, second_worker, sessions, settings, monkeypatch
):
    """Held inside a step (before its row is written) while the job is restarted and run to the
    end elsewhere: on waking, the stale run writes no step, event or outcome."""
    name = unique_name("stale-rows")
    job_id = submit(client, sft_body(3, epochs=1, seed=24, output_name=name))
    reached, release = threading.Event(), threading.Event()
    original = runtime.recording.on_step

    def on_step(jid, report):
        if report.global_step == 2 and threading.current_thread().name == "stale-worker":
            reached.set()
            assert release.wait(120)
        original(jid, report)

    monkeypatch.setattr(runtime.recording, "on_step", on_step)
    thread, out = run_in_thread(runtime, job_id, "stale-worker")
    assert reached.wait(120)
    presume_dead(sessions, job_id, runtime.worker_id)
    assert second_worker.reconciler.run_once()["resumed"] == 1
    assert second_worker.run_job(job_id) == "completed"
    with sessions() as s:
        events_before = len(store.list_events(s, job_id, limit=1000)[0])
    release.set()
    thread.join(120)
    assert out["outcome"] == "lost"
    with sessions() as s:
        assert len(store.list_events(s, job_id, limit=1000)[0]) == events_before
    assert steps(sessions, job_id) == [1, 2, 3]
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.worker_id == second_worker.worker_id
    kinds = event_kinds(sessions, job_id)
    assert kinds.count("started") == 2 and kinds[-1] == "completed"
