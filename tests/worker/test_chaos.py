"""The kill test: an api and two workers on Postgres and Redis take 20+ faults while they train —
SIGKILL and SIGSTOP (longer than the lease) of either worker at random points of a run, broker
flushes, api kills — and then every job must have ended right (docs/ARCHITECTURE.md#recovery):

- 0 lost: every job reaches a final state; 0 run twice: each step is recorded once, one
  completion, no job failed because of another attempt's files;
- every job completed (by resume or restart) unless its attempts ran out;
- every adapter is bit-identical to an uninterrupted run of the same request;
- no residue: every checkpoint directory is recorded by a job, every adapter directory is
  registered, and the only other entries are hidden work directories the registry sweep removes.

The summary line is printed (run with `-s` to see it) and written to `chaos-summary.txt` in the
test's temporary directory. The faults follow one seeded schedule; KILN_CHAOS_SEED picks another
(`KILN_CHAOS_SEED=7 pytest tests/worker/test_chaos.py -s`), and the summary names the seed.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter

import pytest
import redis
from sqlalchemy import create_engine, select

from kiln.store.models import Adapter, Checkpoint
from kiln_train.artifacts.adapter_layout import FAILED_RECEIPTS_DIR
from tests.api.conftest import sft_body, unique_name
from tests.kiln.store.store_support import fresh_postgres_database
from tests.services import redis_url
from tests.worker.stack import Stack
from worker.reconciler import _HIDDEN_WORK

pytestmark = pytest.mark.slow

REDIS_CHAOS = redis_url(15)
EVENTS = 22
DEFAULT_SEED = 20261201
LEASE, STALE = 6, 10  # the Stack's lease and runner-stale seconds
BODIES = [
    sft_body(5, epochs=4, checkpoint_interval=3, seed=61, optimizer={"kind": "adam_w"}),
    sft_body(4, epochs=4, seed=62, optimizer={"kind": "sgd"}, learning_rate=1e-3),  # no checkpoints
    sft_body(6, epochs=3, checkpoint_interval=4, seed=63),  # muon
    sft_body(3, epochs=5, checkpoint_interval=2, seed=64, optimizer={"kind": "adam_w"}),
]


def named(body: dict, name: str) -> dict:
    return {**body, "config": {**body["config"], "output_name": name}}


class Chaos:
    def __init__(self, stack: Stack, rng: random.Random) -> None:
        self.stack = stack
        self.rng = rng
        self.jobs: dict[str, tuple[int, str]] = {}  # job id -> (body index, adapter name)
        self.faults: Counter[str] = Counter()

    def submit(self, index: int) -> None:
        name = unique_name(f"chaos{index}")
        for _ in range(60):  # the api may be down or the runners silent for a moment
            code, body = self.stack.post("/v1/train/sft", named(BODIES[index], name))
            if code == 200:
                self.jobs[body["job_id"]] = (index, name)
                return
            time.sleep(1.0)
        raise AssertionError(f"could not submit: {code} {body}")

    def active(self) -> int:
        code, body = self.stack.get("/v1/train/queue")
        return len(body["running_jobs"]) + len(body["queued"]) if code == 200 else 2

    def fault(self) -> None:
        kind = self.rng.choices(["kill", "stop", "flush", "api"], weights=[35, 30, 15, 20])[0]
        worker = self.rng.choice(["worker-a", "worker-b"])
        if kind == "kill":
            self.stack.stop(worker, signal.SIGKILL)
            time.sleep(self.rng.uniform(0.5, 3.0))
            self.stack.start_worker(worker)
        elif kind == "stop":
            self.stack.send(worker, signal.SIGSTOP)
            time.sleep(LEASE + STALE + self.rng.uniform(1.0, 4.0))  # long enough to lose its job
            self.stack.send(worker, signal.SIGCONT)
        elif kind == "flush":
            redis.Redis.from_url(REDIS_CHAOS).flushdb()
        else:
            self.stack.stop("api", signal.SIGKILL)
            self.stack.start_api()
        self.faults[f"{kind} {worker}" if kind in ("kill", "stop") else kind] += 1


@pytest.fixture
def chaos_stack(tmp_path, tiny_model_dir):
    client = redis.Redis.from_url(REDIS_CHAOS)
    client.flushdb()
    with fresh_postgres_database() as url:
        stack = Stack(tmp_path, tiny_model_dir, url, REDIS_CHAOS)
        stack.env["KILN_TRAINING_MAX_ATTEMPTS"] = "12"
        try:
            yield stack, url
        finally:
            stack.close()
    client.flushdb()


def test_twenty_faults_lose_nothing_run_nothing_twice_and_keep_every_bit(chaos_stack, tmp_path):
    stack, url = chaos_stack
    stack.start_api()
    stack.start_worker("worker-a")
    stack.start_worker("worker-b")
    references = []
    for index, body in enumerate(BODIES):
        code, admitted = stack.post("/v1/train/sft", named(body, unique_name(f"ref{index}")))
        assert code == 200, admitted
        references.append(admitted["job_id"])
    reference_bytes = []
    for job_id in references:
        final = stack.wait_state(job_id, ("completed", "failed"))
        assert final["state"] == "completed", final
        reference_bytes.append(adapter_file(stack, final["adapter_name"]).read_bytes())

    seed = int(os.environ.get("KILN_CHAOS_SEED") or DEFAULT_SEED)
    chaos = Chaos(stack, random.Random(seed))
    for _ in range(EVENTS):
        while chaos.active() < 3:
            chaos.submit(len(chaos.jobs) % len(BODIES))
        time.sleep(chaos.rng.uniform(0.5, 3.0))  # let the fault land anywhere in a run
        chaos.fault()
    for job_id in chaos.jobs:
        stack.wait_state(job_id, ("completed", "failed"), timeout=420)

    outcomes = Counter()
    run_twice, identical, exhausted = [], 0, 0
    for job_id, (index, name) in chaos.jobs.items():
        status = stack.status(job_id)
        code, detail = stack.get(f"/v1/train/jobs/{job_id}")
        kinds = [e["kind"] for e in stack.events(job_id)]
        steps = [p["step"] for p in detail["loss_history"]]
        outcomes[status["state"]] += 1
        if status["state"] == "failed":
            # Only a job whose deliveries ran out may fail, and only as worker_lost.
            assert status["failure_reason"] == "worker_lost", (job_id, status)
            exhausted += 1
            continue
        if steps != list(range(1, status["total_steps"] + 1)) or kinds.count("completed") != 1:
            run_twice.append(job_id)
        if adapter_file(stack, name).read_bytes() == reference_bytes[index]:
            identical += 1
    residue = registry_residue(stack, url)
    summary = (
        f"chaos (seed {seed}): {sum(chaos.faults.values())} faults ({', '.join(f'{n} {k}' for k, n in sorted(chaos.faults.items()))}); "
        f"{len(chaos.jobs)} jobs: {outcomes['completed']} completed, {outcomes['failed']} failed "
        f"({exhausted} with attempts exhausted); 0 lost; {len(run_twice)} run twice; "
        f"{identical}/{outcomes['completed']} adapters bit-identical to uninterrupted runs; "
        f"residue: {len(residue)}"
    )
    print(summary)
    (tmp_path / "chaos-summary.txt").write_text(summary + "\n")
    assert sum(chaos.faults.values()) >= 20
    assert run_twice == []
    assert identical == outcomes["completed"]
    assert outcomes["completed"] + exhausted == len(chaos.jobs)
    assert residue == [], residue


def adapter_file(stack: Stack, name: str):
    return stack.root / "storage" / "adapters" / name / "adapter_model.safetensors"


def registry_residue(stack: Stack, url: str) -> list[str]:
    """Entries of the adapter registry that nothing accounts for (the sweep's hidden work
    directories are accounted for: they go once abandoned)."""
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.connect() as c:
        recorded = set(c.scalars(select(Checkpoint.basename)))
        registered = set(c.scalars(select(Adapter.name)))
    engine.dispose()
    residue = []
    for entry in (stack.root / "storage" / "adapters").iterdir():
        if entry.name.startswith("."):
            if not _HIDDEN_WORK.fullmatch(entry.name) and entry.name != FAILED_RECEIPTS_DIR:
                residue.append(entry.name)
        elif entry.name.endswith(".kiln-checkpoint"):
            if entry.name not in recorded:
                residue.append(entry.name)
        elif entry.name not in registered:
            residue.append(entry.name)
    return sorted(residue)
