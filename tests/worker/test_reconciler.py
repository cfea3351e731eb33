"""The reconciler and the runtime's recovery paths on the real store (SQLite and Postgres) and real
Redis: nothing admitted is ever lost, a job never runs twice, its row ends truthful.

- A queue message lost with the broker (Redis restarted without persistence, or flushed; or the
  unacked message of a newer job held by a worker that died while running an older job first)
  is published again, once, for a job that waited past an idle worker; a busy or freshly idle
  worker's waiting jobs are not published twice.
- Warm shutdowns (a rolling deploy) are graceful releases, not failed deliveries: they never use
  up a job's delivery budget, while crashes still do.
- A reconciler killed between requeueing a job and withdrawing the checkpoint its dead worker
  published but never recorded does not doom the resume; a user resume never withdraws a later
  checkpoint it did not write.
- Hidden work directories that outlive their process (a publication's `.<name>.incomplete-<id>`,
  a withdrawal's `.withdrawn-...`, an adapter deletion's `.trash-<hex>`, left by a SIGKILL, an OOM
  kill or power loss) are swept from the adapter registry once nothing has touched them for
  `ABANDONED_AFTER_SECONDS`, and nothing else is: published adapters and checkpoints, live
  staging, other hidden entries, symlinks.

`Killed` stands in for SIGKILL at an exact point.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from kiln import store
from kiln.store import states
from kiln.store.models import Job
from kiln_train import checkpoint as ckpt
from kiln_train.checkpoint import discover_checkpoints, load_checkpoint
from tests.api.conftest import sft_body, unique_name
from tests.kiln_train.checkpoint.checkpoint_support import publish
from tests.worker.runtime_support import (
    Killed,
    checkpoint_names,
    event_kinds,
    expire_lease,
    job_row,
    steps,
    submit,
)
from worker import reconciler as reconciler_mod
from worker.reconciler import ABANDONED_AFTER_SECONDS, sweep_abandoned, withdraw

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT = "support-bot-checkpoint-step-00000007.kiln-checkpoint"


def _age_message(sessions, runtime, job_id: str, seconds: float = 300) -> None:
    """The job was published `seconds` ago and the worker has been idle since then."""
    past = store.utcnow() - timedelta(seconds=seconds)
    with sessions.begin() as s:
        s.execute(update(Job).where(Job.id == job_id).values(submitted_at=past, published_at=past))
    runtime.idle_since = past - timedelta(seconds=1)


def test_a_message_lost_with_the_broker_is_published_again(client, runtime, sessions, broker):
    job_id = submit(client, sft_body(2, output_name=unique_name("flushed")))
    assert broker.task_ids() == [job_id]
    broker.client.delete(broker.queue)  # Redis restarted without persistence: the message is gone
    assert broker.task_ids() == []
    _age_message(sessions, runtime, job_id)
    assert runtime.reconciler.run_once()["republished"] == 1
    assert broker.task_ids() == [job_id]
    assert "republished" in event_kinds(sessions, job_id)
    # Stamped: the next pass does not publish it again.
    assert runtime.reconciler.run_once()["republished"] == 0
    assert broker.task_ids() == [job_id]
    assert runtime.run_job(job_id) == "completed"
    assert job_row(sessions, job_id).attempts == 1


def test_a_busy_or_freshly_idle_worker_does_not_republish_waiting_jobs(client, runtime, sessions, broker):
    """A queued job behind a running one is waiting, not lost: no duplicate messages."""
    job_id = submit(client, sft_body(2, output_name=unique_name("waiting")))
    _age_message(sessions, runtime, job_id)
    runtime.idle_since = None  # busy with another job
    assert runtime.reconciler.run_once()["republished"] == 0
    runtime.idle_since = store.utcnow()  # that job just ended: the next message is on its way
    assert runtime.reconciler.run_once()["republished"] == 0
    runtime.idle_since = store.utcnow() - timedelta(minutes=10)
    runtime.shutdown.set()  # a worker on its way out consumes nothing: it republishes nothing either
    assert runtime.reconciler.run_once()["republished"] == 0
    runtime.shutdown.clear()
    assert broker.task_ids() == [job_id]


def test_run_job_marks_the_worker_busy_then_idle(client, runtime, sessions):
    job_id = submit(client, sft_body(1, output_name=unique_name("idle")))
    seen = {}
    original = runtime.recording.on_step

    def on_step(jid, report):
        seen["idle_since"] = runtime.idle_since
        original(jid, report)

    runtime.recording.on_step = on_step
    before = store.utcnow()
    assert runtime.run_job(job_id) == "completed"
    assert seen["idle_since"] is None
    assert runtime.idle_since is not None and runtime.idle_since >= before


def test_graceful_releases_do_not_use_up_the_delivery_budget(client, runtime, sessions, settings):
    """max_attempts is 3: three warm shutdowns in a row (a rolling deploy) requeue the job from its
    checkpoint each time, and it still completes (never `worker_lost`)."""
    assert settings.training.max_attempts == 3
    name = unique_name("deploys")
    job_id = submit(client, sft_body(4, epochs=1, seed=3, checkpoint_interval=100, output_name=name))
    original = runtime.recording.on_step

    def on_step(jid, report):
        original(jid, report)
        runtime.request_shutdown()

    runtime.recording.on_step = on_step
    for release in range(1, 4):
        assert runtime.run_job(job_id) == "requeued"
        job = job_row(sessions, job_id)
        assert job.state == states.QUEUED, (release, job.state, job.failure_reason)
        assert job.resume_checkpoint.endswith(f"step-{release:08d}.kiln-checkpoint")
        runtime.shutdown.clear()
    runtime.recording.on_step = original
    assert runtime.run_job(job_id) == "completed"
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.failure_reason is None
    assert steps(sessions, job_id) == [1, 2, 3, 4]
    assert event_kinds(sessions, job_id).count("started") == 4


def test_crash_deliveries_still_exhaust_the_budget_after_graceful_releases(
    client, runtime, sessions, settings
):
    """Only graceful releases are forgiven: a job whose worker keeps dying at the same step still
    fails. (The first crash got one step further than anyone before, so it counts as progress.)"""
    name = unique_name("poison")
    job_id = submit(client, sft_body(4, epochs=1, seed=3, checkpoint_interval=1, output_name=name))
    original = runtime.recording.on_step

    def release(jid, report):
        original(jid, report)
        runtime.request_shutdown()

    runtime.recording.on_step = release
    assert runtime.run_job(job_id) == "requeued"
    runtime.shutdown.clear()

    def die(jid, report):
        original(jid, report)
        raise Killed

    runtime.recording.on_step = die
    outcomes = []
    for _ in range(settings.training.max_attempts + 1):
        with pytest.raises(Killed):
            runtime.run_job(job_id)
        runtime.run = None
        expire_lease(sessions, job_id)
        outcomes.append(runtime.reconciler.run_once())
    job = job_row(sessions, job_id)
    assert [o["resumed"] for o in outcomes] == [1, 1, 1, 0] and outcomes[-1]["failed"] == 1
    assert job.state == states.FAILED and job.failure_reason == "worker_lost"
    assert "lost 3 attempts without progress (training.max_attempts 3)" in job.error_message
    assert "stopped at step 2, no further than step 2 reached before" in job.error_message


def test_a_reconciler_killed_before_withdrawing_does_not_doom_the_resume(client, runtime, sessions, settings):
    """The job is requeued from step 2 while the step-4 checkpoint its dead worker published (never
    recorded, and damaged meanwhile, so not adoptable) is still on disk: the resumed run withdraws
    it and completes, rather than failing with `already exists` at step 4."""
    name = unique_name("rckill")
    job_id = submit(client, sft_body(3, epochs=2, checkpoint_interval=2, seed=5, output_name=name))
    original = runtime.recording.on_checkpoint

    def on_checkpoint(jid, record):
        if record["global_step"] == 4:
            loop = Path(record["path"]) / ckpt.LOOP_STATE_FILE
            data = loop.read_bytes()
            loop.unlink()
            loop.write_bytes(data.replace(b"{", b"{ ", 1))  # no longer the bytes its manifest names
            raise Killed  # the worker dies after the rename, before the row
        original(jid, record)

    runtime.recording.on_checkpoint = on_checkpoint
    with pytest.raises(Killed):
        runtime.run_job(job_id)
    runtime.recording.on_checkpoint = original
    runtime.run = None
    expire_lease(sessions, job_id)

    def killed_withdraw(*args, **kwargs):
        raise Killed  # the reconciler's worker dies right after the requeue committed

    runtime.reconciler._withdraw_unrecorded = killed_withdraw
    with pytest.raises(Killed):
        runtime.reconciler.run_once()
    del runtime.reconciler._withdraw_unrecorded
    step4 = f"{name}-checkpoint-step-00000004.kiln-checkpoint"
    job = job_row(sessions, job_id)
    assert job.state == states.QUEUED and job.resume_checkpoint.endswith("step-00000002.kiln-checkpoint")
    assert step4 in checkpoint_names(settings, name)

    assert runtime.run_job(job_id) == "completed"
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.global_step == 6, (job.failure_reason, job.error_message)
    assert steps(sessions, job_id) == [1, 2, 3, 4, 5, 6]
    with sessions() as s:
        recorded = store.list_checkpoints(s, job_id)
    assert [c.global_step for c in recorded] == [2, 4]

    rewritten = ckpt.load_checkpoint(settings.adapters_dir / step4, verify_hashes=True)
    assert recorded[1].manifest_sha256.removeprefix("sha256:") == rewritten.manifest_sha256


def test_a_user_resume_does_not_withdraw_a_later_checkpoint_it_did_not_write(
    client, runtime, sessions, settings
):
    """The dequeue clean-up is for the job's own unrecorded checkpoints only: a user resume of an
    older checkpoint still fails on reaching a later existing name (docs/checkpoints.md#resume)."""
    name = unique_name("older")
    # An explicit segment count keeps this about the clean-up; resuming an auto-planned run is
    # tested in tests/worker/test_resume_auto_plan.py.
    config = {"epochs": 2, "checkpoint_interval": 2, "seed": 5, "grad_checkpoint_segments": 1}
    first = submit(client, sft_body(3, output_name=name, **config))
    original = runtime.recording.on_step

    def on_step(jid, report):
        original(jid, report)
        if report.global_step == 3:  # seen after step 4's write, which is a checkpoint step
            assert client.delete(f"/v1/train/queue/{jid}").status_code == 200

    runtime.recording.on_step = on_step
    assert runtime.run_job(first) == "failed"
    runtime.recording.on_step = original
    step2 = f"{name}-checkpoint-step-00000002.kiln-checkpoint"
    step4 = f"{name}-checkpoint-step-00000004.kiln-checkpoint"
    assert checkpoint_names(settings, name) == [step2, step4]
    # Admission refuses a resume behind a later checkpoint; the later one reappears after it.
    aside = settings.storage_root / "aside"
    (settings.adapters_dir / step4).rename(aside)
    body = sft_body(3, output_name=name, resume_checkpoint=step2, **config)
    response = client.post("/v1/train/sft", json=body)
    assert response.status_code == 200, response.get_json()
    second = response.get_json()["job_id"]
    aside.rename(settings.adapters_dir / step4)
    assert runtime.run_job(second) == "failed"
    job = job_row(sessions, second)
    assert "already exists" in job.error_message
    assert checkpoint_names(settings, name) == [step2, step4]


# ----- sweeps of abandoned work directories -------------------------------------------------------


def _killed_mid_publication(registry: Path, what: str) -> None:
    """A real process SIGKILLed in the middle of publishing (after its first file is written)."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        registry = Path({str(registry)!r})
        if {what!r} == "checkpoint":
            from kiln_train.checkpoint import publish as publish_module
            from tests.kiln_train.checkpoint.checkpoint_support import publish
            original = publish_module.write_artifacts
            def dying(*args, **kwargs):
                original(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)
            publish_module.write_artifacts = dying
            publish(registry, 9)
        else:
            import torch
            from kiln_train.artifacts import adapter
            def dying(output):
                os.kill(os.getpid(), signal.SIGKILL)
            adapter.publish_adapter(
                registry, "half-written", {{"w": torch.zeros(2, 2)}}, rank=2, alpha=4.0,
                build_receipt=dying, build_manifest=lambda receipt, hashes: {{}},
            )
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -9, proc.stderr


def _crash_residue(registry: Path) -> list[str]:
    """The four kinds of residue, made by the code that makes them."""
    registry.mkdir(parents=True, exist_ok=True)
    _killed_mid_publication(registry, "checkpoint")
    _killed_mid_publication(registry, "adapter")
    # A withdrawal and a deletion whose rmtree did not get to finish.
    victim = registry / "withdrawn-one"
    (victim / "deep").mkdir(parents=True)
    (victim / "deep" / "weights.bin").write_bytes(b"x" * 4096)
    original_rmtree = reconciler_mod.shutil.rmtree
    reconciler_mod.shutil.rmtree = lambda *a, **k: None
    try:
        withdraw(victim)
    finally:
        reconciler_mod.shutil.rmtree = original_rmtree
    trash = registry / f".trash-{'ab' * 16}"
    (trash / "deleted-adapter").mkdir(parents=True)
    (trash / "deleted-adapter" / "adapter_model.safetensors").write_bytes(b"y" * 100)
    residue = sorted(e.name for e in registry.iterdir() if e.name.startswith("."))
    assert len(residue) == 4, residue
    assert any(n.startswith(f".{CHECKPOINT.replace('00000007', '00000009')}.incomplete-") for n in residue)
    assert any(n.startswith(".half-written.incomplete-") for n in residue)
    assert any(n.startswith(".withdrawn-") and n.endswith("-withdrawn-one") for n in residue)
    assert trash.name in residue
    return residue


def test_crash_residue_is_swept_once_abandoned_and_nothing_else(tmp_path):
    registry = tmp_path / "adapters"
    residue = _crash_residue(registry)
    published = publish(registry, 7)
    # What must survive: a published checkpoint, an adapter, another hidden file, a symlink
    # whose name looks like staging and whose target is outside the registry.
    (registry / "my-adapter").mkdir()
    (registry / "my-adapter" / "adapter_model.safetensors").write_bytes(b"z")
    (registry / ".registry.lock").write_text("")
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (registry / f".linked.incomplete-{'cd' * 16}").symlink_to(outside, target_is_directory=True)

    fresh = time.time()
    assert sweep_abandoned(registry) == []  # just written: a live process could still own them
    assert sweep_abandoned(registry, now=fresh + ABANDONED_AFTER_SECONDS - 60) == []
    swept = sweep_abandoned(registry, now=fresh + ABANDONED_AFTER_SECONDS + 60)
    assert sorted(swept) == residue
    assert sorted(os.listdir(registry)) == sorted(
        [".registry.lock", f".linked.incomplete-{'cd' * 16}", CHECKPOINT, "my-adapter"]
    )
    assert (outside / "keep.txt").read_text() == "keep"
    assert load_checkpoint(published.path, verify_hashes=True).manifest.checkpoint_id == "sft-step-00000007"
    assert [(c.path.name, c.error) for c in discover_checkpoints(registry, "support-bot")] == [
        (CHECKPOINT, None)
    ]
    assert sweep_abandoned(registry, now=fresh + 10 * ABANDONED_AFTER_SECONDS) == []


def test_recent_activity_deep_inside_keeps_a_staging_directory(tmp_path):
    staging = tmp_path / f".big.incomplete-{'ef' * 16}"
    (staging / "a" / "b").mkdir(parents=True)
    born = staging.lstat().st_ctime
    time.sleep(0.05)
    (staging / "a" / "b" / "shard.bin").write_bytes(b"still writing")
    written = (staging / "a" / "b" / "shard.bin").lstat().st_mtime
    assert written > born
    # Old by the directory's own stamps, young by the file being written deep inside.
    now = born + ABANDONED_AFTER_SECONDS + (written - born) / 2
    assert sweep_abandoned(tmp_path, now=now) == []
    assert staging.is_dir()
    assert sweep_abandoned(tmp_path, now=written + ABANDONED_AFTER_SECONDS + 1) == [staging.name]
    assert not staging.exists()


def test_a_missing_registry_sweeps_nothing(tmp_path):
    assert sweep_abandoned(tmp_path / "absent") == []


def test_the_worker_s_reconciler_sweeps_and_its_jobs_still_train(client, runtime, settings, monkeypatch):
    """Through the running worker: residue next to a live registry goes, a job still trains and
    publishes after the pass, and the pass reports how much it swept."""
    residue = _crash_residue(settings.adapters_dir)
    assert runtime.reconciler.run_once()["swept"] == 0  # fresh: left alone
    monkeypatch.setattr(reconciler_mod, "ABANDONED_AFTER_SECONDS", 0.0)
    assert runtime.reconciler.run_once()["swept"] == len(residue)
    assert not any(e.name.startswith(".") for e in settings.adapters_dir.iterdir())
    name = unique_name("after-sweep")
    job_id = submit(client, sft_body(2, output_name=name))
    assert runtime.run_job(job_id) == "completed"
    assert (settings.adapters_dir / name / "adapter_model.safetensors").is_file()
    assert runtime.reconciler.run_once()["swept"] == 0


@pytest.mark.parametrize(
    "name",
    [
        ".incomplete-" + "a" * 32,  # no name before the marker
        "visible.incomplete-" + "a" * 32,  # not hidden
        ".withdrawn-short-x",
        ".trash-" + "g" * 32,
        ".trash-" + "a" * 31,
    ],
)
def test_only_the_hidden_work_names_are_swept(tmp_path, name):
    (tmp_path / name).mkdir()
    assert sweep_abandoned(tmp_path, older_than=0.0, now=time.time() + 60) == []
    assert (tmp_path / name).is_dir()


def test_an_undeletable_directory_is_reported_once_and_left(tmp_path, monkeypatch, caplog):
    stuck = tmp_path / f".stuck.incomplete-{'12' * 16}"
    stuck.mkdir()
    (stuck / "part").write_bytes(b"p")
    monkeypatch.setattr(reconciler_mod.shutil, "rmtree", lambda *a, **k: None)  # EPERM, EBUSY ...
    later = time.time() + ABANDONED_AFTER_SECONDS + 60
    with caplog.at_level("WARNING", logger="worker.reconciler"):
        assert sweep_abandoned(tmp_path, now=later) == []
        assert sweep_abandoned(tmp_path, now=later) == []
    reports = [r.getMessage() for r in caplog.records if "could not delete" in r.getMessage()]
    assert reports == [f"could not delete the abandoned work directory {stuck}; delete it by hand"]
    assert (stuck / "part").read_bytes() == b"p"
    monkeypatch.undo()
    assert sweep_abandoned(tmp_path, now=later) == [stuck.name]
