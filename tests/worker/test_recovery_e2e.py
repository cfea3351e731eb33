"""Recovery as a tester provokes it: real `kiln serve` and `kiln worker` processes on Postgres and
Redis, signals sent by PID (docs/ARCHITECTURE.md#recovery).

- SIGKILL before the first checkpoint: the job runs again from step 0 (same pinned seed, same
  plan) and its adapter is bit-identical to an uninterrupted run's.
- SIGSTOP of the owner for longer than its lease while a second worker runs (wherever it lands,
  inside a transaction that holds the job row too): the job is taken over and completed by the
  second worker; the stopped one, continued, records nothing and publishes nothing; every step
  is recorded once and the adapter is an uninterrupted run's.
- A flushed broker database with several queued jobs: they all start as soon as the worker is
  free (or within two reconcile periods of an idle worker), oldest first.
"""

from __future__ import annotations

import signal
import time
from datetime import datetime

import pytest
import redis

from tests.api.conftest import sft_body, unique_name
from tests.kiln.store.store_support import fresh_postgres_database
from tests.services import redis_url
from tests.worker.stack import Stack

pytestmark = pytest.mark.slow

REDIS_RECOVERY = redis_url(14)
RECONCILE_SECONDS = 2.0  # the Stack's KILN_TRAINING_RECONCILE_INTERVAL_SECONDS


@pytest.fixture
def stack(tmp_path, tiny_model_dir):
    client = redis.Redis.from_url(REDIS_RECOVERY)
    client.flushdb()
    with fresh_postgres_database() as url:
        stack = Stack(tmp_path, tiny_model_dir, url, REDIS_RECOVERY)
        try:
            yield stack
        finally:
            stack.close()
    client.flushdb()


def submit(stack: Stack, body: dict) -> str:
    code, admitted = stack.post("/v1/train/sft", body)
    assert code == 200, admitted
    return admitted["job_id"]


def named(body: dict, name: str) -> dict:
    return {**body, "config": {**body["config"], "output_name": name}}


def adapter_bytes(stack: Stack, name: str) -> bytes:
    return (stack.root / "storage" / "adapters" / name / "adapter_model.safetensors").read_bytes()


def started_attempts(stack: Stack, job_id: str) -> list[tuple[int, int]]:
    return [
        (e["data"]["attempt"], e["data"]["start_step"])
        for e in stack.events(job_id)
        if e["kind"] == "started"
    ]


def loss_steps(stack: Stack, job_id: str) -> list[int]:
    code, detail = stack.get(f"/v1/train/jobs/{job_id}")
    assert code == 200
    return [point["step"] for point in detail["loss_history"]]


def at(event: dict) -> datetime:
    return datetime.fromisoformat(event["created_at"].replace("Z", "+00:00"))


def hidden_entries(stack: Stack) -> list[str]:
    return sorted(p.name for p in (stack.root / "storage" / "adapters").iterdir() if p.name.startswith("."))


def test_a_worker_killed_before_its_first_checkpoint_restarts_the_job_from_step_zero(stack):
    stack.start_api()
    stack.start_worker()
    body = sft_body(6, epochs=3, seed=41)  # no checkpoint_interval: the default, no checkpoint
    reference = submit(stack, named(body, unique_name("ref")))
    assert stack.wait_state(reference, ("completed", "failed"))["state"] == "completed"

    name = unique_name("killed-early")
    job_id = submit(stack, named(body, name))
    stack.wait(lambda: (stack.status(job_id).get("global_step") or 0) >= 3, 180, "step 3")
    stack.stop("worker", signal.SIGKILL)
    stack.start_worker()
    final = stack.wait_state(job_id, ("completed", "failed"), timeout=240)
    assert final["state"] == "completed", final
    assert started_attempts(stack, job_id) == [(1, 0), (2, 0)]
    requeued = [e for e in stack.events(job_id) if e["kind"] == "requeued"]
    assert len(requeued) == 1 and requeued[0]["data"]["restart"] is True
    assert loss_steps(stack, job_id) == list(range(1, 19))  # the lost attempt's rows were dropped
    code, ref_detail = stack.get(f"/v1/train/jobs/{reference}")
    ref_name = ref_detail["adapter_name"]
    assert adapter_bytes(stack, name) == adapter_bytes(stack, ref_name)
    assert hidden_entries(stack) == []


def test_an_owner_stopped_past_its_lease_is_superseded_and_records_nothing(stack):
    stack.start_api()
    stack.start_worker("worker-a")
    stack.start_worker("worker-b")
    rows, epochs = 16, 4  # 64 steps: the owner is still training when the signal lands, on a fast CPU too
    body = sft_body(rows, epochs=epochs, checkpoint_interval=4, seed=42)
    reference = submit(stack, named(body, unique_name("ref")))
    assert stack.wait_state(reference, ("completed", "failed"))["state"] == "completed"

    name = unique_name("stalled")
    job_id = submit(stack, named(body, name))
    stack.wait(lambda: (stack.status(job_id).get("global_step") or 0) >= 4, 180, "step 4")
    claimed_by = next(e["data"]["worker_id"] for e in stack.events(job_id) if e["kind"] == "started")
    owner = next(n for n in ("worker-a", "worker-b") if f"-{stack.procs[n].pid}-" in claimed_by)
    other = "worker-b" if owner == "worker-a" else "worker-a"
    stack.send(owner, signal.SIGSTOP)  # a VM freeze: no step, no heartbeat, no lease renewal
    try:
        assert stack.status(job_id)["state"] == "running", "the job ended before its owner was stopped"
        stack.wait(lambda: len(started_attempts(stack, job_id)) == 2, 120, f"the takeover by {other}")
        time.sleep(1.0)  # the new owner is training when the old one wakes up
    finally:
        stack.send(owner, signal.SIGCONT)
    final = stack.wait_state(job_id, ("completed", "failed"), timeout=240)
    assert final["state"] == "completed", final
    assert final.get("failure_reason") is None

    attempts = started_attempts(stack, job_id)
    assert [a for a, _ in attempts] == [1, 2] and attempts[1][1] % 4 == 0  # a checkpoint, or step 0
    taken_by = [e["data"]["worker_id"] for e in stack.events(job_id) if e["kind"] == "started"][1]
    assert f"-{stack.procs[other].pid}-" in taken_by
    assert loss_steps(stack, job_id) == list(range(1, rows * epochs + 1))  # each step once
    ref_name = stack.get(f"/v1/train/jobs/{reference}")[1]["adapter_name"]
    assert adapter_bytes(stack, name) == adapter_bytes(stack, ref_name)
    stack.wait(lambda: "superseded" in stack.log(owner), 60, f"{owner} noticing")
    assert stack.log(owner).count("superseded by a later claim") == 1
    kinds = [e["kind"] for e in stack.events(job_id)]
    assert kinds.count("completed") == 1 and "failed" not in kinds and kinds[-1] == "completed"
    assert hidden_entries(stack) == []
    # The continued worker still serves: the next jobs complete (on either worker).
    after = [submit(stack, named(sft_body(2, seed=43 + i), unique_name("after"))) for i in range(2)]
    for job in after:
        assert stack.wait_state(job, ("completed", "failed"))["state"] == "completed"


def test_a_flushed_broker_loses_no_queued_job_and_the_queue_drains_at_once(stack):
    stack.start_api()
    stack.start_worker()
    long_job = submit(stack, sft_body(8, epochs=3, seed=44, output_name=unique_name("long")))
    stack.wait(lambda: stack.status(long_job)["state"] == "running", 120, "the long job running")
    queued = [submit(stack, sft_body(2, seed=45 + i, output_name=unique_name(f"q{i}"))) for i in range(3)]
    redis.Redis.from_url(REDIS_RECOVERY).flushdb()  # every message is gone, the running one's too
    for job_id in [long_job, *queued]:
        assert stack.wait_state(job_id, ("completed", "failed"), timeout=240)["state"] == "completed"
    starts = [next(at(e) for e in stack.events(j) if e["kind"] == "started") for j in queued]
    assert starts == sorted(starts)  # FIFO
    long_done = next(at(e) for e in stack.events(long_job) if e["kind"] == "completed")
    assert (starts[0] - long_done).total_seconds() < RECONCILE_SECONDS  # no idle wait per job
    for earlier, later in zip(queued, queued[1:], strict=False):
        done = next(at(e) for e in stack.events(earlier) if e["kind"] == "completed")
        nxt = next(at(e) for e in stack.events(later) if e["kind"] == "started")
        assert (nxt - done).total_seconds() < RECONCILE_SECONDS


def test_jobs_queued_for_an_idle_worker_whose_messages_were_flushed_start_within_two_periods(stack):
    stack.start_api()
    stack.start_worker("first")
    stack.send("first", signal.SIGSTOP)  # its runner row stays fresh for a moment: jobs are admitted
    jobs = [submit(stack, sft_body(2, seed=50 + i, output_name=unique_name(f"idle{i}"))) for i in range(3)]
    stack.stop("first", signal.SIGKILL)
    redis.Redis.from_url(REDIS_RECOVERY).flushdb()  # Redis restarted without persistence
    stack.start_worker()
    ready = time.monotonic()
    stack.wait(lambda: stack.status(jobs[0])["state"] != "queued", 60, "the first job starting")
    assert time.monotonic() - ready < 2 * RECONCILE_SECONDS + 3  # + the claim and a poll
    for job_id in jobs:
        assert stack.wait_state(job_id, ("completed", "failed"), timeout=180)["state"] == "completed"
    starts = [next(at(e) for e in stack.events(j) if e["kind"] == "started") for j in jobs]
    assert starts == sorted(starts)
