"""Preemption that makes progress never fails a job; dying at the same point again and again does
(docs/recovery.md#attempts-that-make-progress). The worker is killed in process (`Killed` raised
from its step hook, the lease then expired) and the real reconciler settles each loss."""

from __future__ import annotations

import json

import pytest

from kiln import store
from kiln.store import states
from tests.api.conftest import sft_body, unique_name
from tests.worker.runtime_support import Killed, expire_lease, job_row, steps, submit


def _lose(runtime, sessions, job_id: str) -> dict:
    """Run the job until its step hook kills the worker; let the lease lapse; reconcile."""
    with pytest.raises(Killed):
        runtime.run_job(job_id)
    runtime.run = None
    expire_lease(sessions, job_id)
    return runtime.reconciler.run_once()


def _settled(sessions, job_id: str) -> list[tuple[str, str, dict]]:
    with sessions() as s:
        events, _ = store.list_events(s, job_id, limit=1000)
    return [(e.kind, e.message, e.data["progress"]) for e in events if "progress" in (e.data or {})]


def test_a_job_that_advances_on_every_attempt_is_never_failed(client, runtime, sessions, settings):
    """Killed on the second step of every attempt (after one new checkpoint): 7 losses with
    max_attempts 3, and the job still completes with every step recorded once."""
    assert settings.training.max_attempts == 3
    name = unique_name("preempted")
    job_id = submit(client, sft_body(4, epochs=2, seed=3, checkpoint_interval=1, output_name=name))
    original = runtime.recording.on_step
    first: dict = {}

    def preempted(jid, report):
        original(jid, report)
        start = first.setdefault("step", report.global_step)
        if report.global_step > start:
            raise Killed  # recorded, but its checkpoint is never published

    runtime.recording.on_step = preempted
    losses = 0
    while True:
        first.clear()
        try:
            outcome = runtime.run_job(job_id)
            break
        except Killed:
            runtime.run = None
            losses += 1
            assert losses < 10
        expire_lease(sessions, job_id)
        done = runtime.reconciler.run_once()
        assert done["resumed"] == 1 and done["failed"] == 0, (losses, done)
    assert outcome == "completed" and losses == 7
    job = job_row(sessions, job_id)
    assert job.state == states.COMPLETED and job.attempts == 8
    assert steps(sessions, job_id) == list(range(1, 9))
    settled = _settled(sessions, job_id)
    assert [p["reached_step"] for _, _, p in settled] == [2, 3, 4, 5, 6, 7, 8]
    assert [p["checkpoint_step"] for _, _, p in settled] == [1, 2, 3, 4, 5, 6, 7]
    assert all(p["advanced"] and p["stalled_attempts"] == 0 for _, _, p in settled)
    assert "attempt 4 advanced from step 3 to step 5" in settled[3][1]
    receipt = json.loads((settings.adapters_dir / name / "train_receipt.json").read_text())
    assert receipt["attempts"] == {"attempt": 8, "earlier": [p for _, _, p in settled]}


def test_a_job_that_dies_at_the_same_point_fails_and_says_so(client, runtime, sessions, settings):
    """Checkpoints every 2 steps, killed at step 3 every time: the first attempt advanced (a
    checkpoint at 2), the next three only redid step 3, and the third of those fails the job."""
    name = unique_name("stuck")
    job_id = submit(client, sft_body(4, epochs=1, seed=3, checkpoint_interval=2, output_name=name))
    original = runtime.recording.on_step

    def dies_at_three(jid, report):
        original(jid, report)
        if report.global_step == 3:
            raise Killed

    runtime.recording.on_step = dies_at_three
    outcomes = [_lose(runtime, sessions, job_id) for _ in range(4)]
    assert [(o["resumed"], o["failed"]) for o in outcomes] == [(1, 0), (1, 0), (1, 0), (0, 1)]
    job = job_row(sessions, job_id)
    assert job.state == states.FAILED and job.failure_reason == "worker_lost"
    assert (
        "lost 3 attempts without progress (training.max_attempts 3); the last, attempt 4, stopped at "
        "step 3, no further than step 3 reached before"
    ) in job.error_message
    settled = _settled(sessions, job_id)
    assert [k for k, _, _ in settled] == ["requeued", "requeued", "requeued", "worker_lost"]
    assert [
        (p["start_step"], p["reached_step"], p["advanced"], p["stalled_attempts"]) for _, _, p in settled
    ] == [
        (0, 3, True, 0),
        (2, 3, False, 1),
        (2, 3, False, 2),
        (2, 3, False, 3),
    ]
    assert "attempt 2 made no progress: it stopped at step 3, no further than step 3" in settled[1][1]
    runtime.recording.on_step = original
    assert runtime.run_job(job_id) == "dropped"
