"""The whole service as people run it: real `kiln serve` and `kiln worker` processes.

Postgres + Redis (production shape) and the embedded defaults (SQLite + a SQLite broker). Covers
HTTP submit → completed job with receipt, downloadable adapter and loss curve; a worker killed
with SIGKILL mid-job (the job resumes from its exact checkpoint and never runs a step twice);
and an api restart with jobs in the queue (nothing is lost).
"""

from __future__ import annotations

import io
import signal
import subprocess
import tarfile
from pathlib import Path

import pytest
import redis

from tests.api.conftest import sft_body, unique_name
from tests.kiln.store.store_support import fresh_postgres_database
from tests.worker.stack import KILN, REDIS_E2E, Stack

pytestmark = pytest.mark.slow


@pytest.fixture
def production_stack(tmp_path, tiny_model_dir):
    client = redis.Redis.from_url(REDIS_E2E)
    client.flushdb()
    with fresh_postgres_database() as url:
        stack = Stack(tmp_path, tiny_model_dir, url, REDIS_E2E)
        try:
            yield stack
        finally:
            stack.close()
    client.flushdb()


def events(stack: Stack, job_id: str) -> list[dict]:
    code, body = stack.get(f"/v1/train/jobs/{job_id}/events?limit=1000")
    assert code == 200
    return body["data"]


def test_http_submit_runs_to_a_downloadable_adapter(production_stack):
    stack = production_stack
    stack.start_api()
    stack.start_worker()
    name = unique_name("e2e")
    code, body = stack.post("/v1/train/sft", sft_body(4, epochs=2, checkpoint_interval=3, output_name=name))
    assert code == 200, body
    job_id = body["job_id"]
    final = stack.wait_state(job_id, ("completed", "failed"))
    assert final["state"] == "completed", final
    assert final["progress"] == 1.0 and final["adapter_name"] == name

    code, detail = stack.get(f"/v1/train/jobs/{job_id}")
    assert code == 200
    assert len(detail["loss_history"]) == 8
    assert detail["train_receipt"]["status"] == "success"
    assert detail["train_receipt"]["runtime"]["sft_loss_route"] == "kt_tape_flce"
    assert detail["latest_checkpoint"]["global_step"] == 6

    code, archive = stack.get(f"/v1/adapters/{name}/download")
    assert code == 200
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        names = {Path(m.name).name for m in tar.getmembers()}
    assert {"adapter_config.json", "adapter_model.safetensors", "train_receipt.json"} <= names

    health = subprocess.run(
        [*KILN, "health", "worker", "--max-age", "30"], env=stack.env, capture_output=True
    )
    assert health.returncode == 0, health.stderr
    api_health = subprocess.run(
        [*KILN, "health", "api", "--url", stack.url("/health")], env=stack.env, capture_output=True
    )
    assert api_health.returncode == 0, api_health.stderr


def test_sigkilled_worker_job_resumes_from_its_checkpoint(production_stack):
    stack = production_stack
    stack.start_api()
    stack.start_worker()
    name = unique_name("killed")
    body = sft_body(6, epochs=3, checkpoint_interval=4, output_name=name, seed=99)
    code, admitted = stack.post("/v1/train/sft", body)
    assert code == 200, admitted
    job_id = admitted["job_id"]
    stack.wait(lambda: (stack.status(job_id).get("global_step") or 0) >= 6, 180, "step 6")
    stack.stop("worker", signal.SIGKILL)
    killed_at = stack.status(job_id)["global_step"]
    assert stack.status(job_id)["state"] == "running"  # nobody knows yet

    stack.start_worker()  # its reconciler finds the expired lease and requeues from step 4 or later
    final = stack.wait_state(job_id, ("completed", "failed"), timeout=240)
    assert final["state"] == "completed", final

    code, detail = stack.get(f"/v1/train/jobs/{job_id}")
    assert [point["step"] for point in detail["loss_history"]] == list(range(1, 19))  # every step once
    kinds = [e["kind"] for e in events(stack, job_id)]
    assert kinds.count("started") == 2 and "requeued" in kinds and kinds[-1] == "completed"
    requeued = next(e for e in events(stack, job_id) if e["kind"] == "requeued")
    assert 4 <= requeued["data"]["global_step"] <= killed_at


def test_api_killed_with_a_full_queue_loses_nothing(production_stack):
    stack = production_stack
    stack.start_api()
    stack.start_worker()
    job_ids = []
    for i in range(3):
        code, body = stack.post("/v1/train/sft", sft_body(4, epochs=2, output_name=unique_name(f"q{i}")))
        assert code == 200, body
        job_ids.append(body["job_id"])
    stack.stop("api", signal.SIGKILL)  # jobs 2 and 3 are still queued
    stack.start_api()
    started = []
    for job_id in job_ids:
        final = stack.wait_state(job_id, ("completed", "failed"))
        assert final["state"] == "completed", final
        job_events = events(stack, job_id)
        assert [e["kind"] for e in job_events].count("started") == 1
        started.append(next(e["created_at"] for e in job_events if e["kind"] == "started"))
    assert started == sorted(started)  # FIFO


def test_embedded_defaults_run_a_job(tmp_path, tiny_model_dir):
    stack = Stack(tmp_path, tiny_model_dir, None, None)
    try:
        stack.start_api()
        stack.start_worker()
        code, body = stack.post("/v1/train/sft", sft_body(2, output_name=unique_name("embedded")))
        assert code == 200, body
        assert stack.wait_state(body["job_id"], ("completed", "failed"))["state"] == "completed"
    finally:
        stack.close()
