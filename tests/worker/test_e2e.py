"""The whole service as people run it: real `kiln serve` and `kiln worker` processes.

Postgres + Redis (production shape) and the embedded defaults (SQLite + a SQLite broker). Covers
HTTP submit → completed job with receipt, downloadable adapter and loss curve; a worker killed
with SIGKILL mid-job (the job resumes from its exact checkpoint and never runs a step twice);
and an api restart with jobs in the queue (nothing is lost).
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from tests.api.conftest import sft_body, unique_name
from tests.kiln.test_store_support import fresh_postgres_database

pytestmark = pytest.mark.slow

KILN = [sys.executable, "-m", "kiln.cli.main"]
REDIS_E2E = "redis://127.0.0.1:6379/13"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """`kiln serve` and `kiln worker` processes sharing one environment."""

    def __init__(self, root: Path, model_dir: Path, database_url: str | None, broker_url: str | None):
        self.root = root
        self.port = free_port()
        self.env = {
            **os.environ,
            "KILN_STORAGE_ROOT": str(root / "storage"),
            "KILN_MODEL_PATH": str(model_dir),
            "KILN_SERVER_PORT": str(self.port),
            "KILN_QUEUE_QUEUE_NAME": f"kiln-e2e-{self.port}",
            "KILN_TRAINING_LEASE_SECONDS": "6",
            "KILN_TRAINING_HEARTBEAT_SECONDS": "1",
            "KILN_TRAINING_RECONCILE_INTERVAL_SECONDS": "2",
            "KILN_TRAINING_RUNNER_STALE_SECONDS": "10",
            "PYTHONUNBUFFERED": "1",
        }
        if database_url:
            self.env["KILN_DATABASE_URL"] = database_url
        if broker_url:
            self.env["KILN_QUEUE_BROKER_URL"] = broker_url
        self.procs: dict[str, subprocess.Popen] = {}
        subprocess.run([*KILN, "db", "upgrade"], env=self.env, check=True, capture_output=True)

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            [*KILN, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs[name] = proc
        return proc

    def start_api(self) -> None:
        self.start("api", "serve", "--workers", "1")
        self.wait(lambda: self.get("/health")[0] == 200, 60, "api health")

    def start_worker(self) -> None:
        self.start("worker", "worker")
        self.wait(
            lambda: (self.get("/health")[1] or {}).get("runner") is not None, 120, "runner registration"
        )

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs.pop(name)
        os.killpg(proc.pid, sig)  # the whole process group, like a container stop: gunicorn's children too
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name, signal.SIGKILL)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str):
        try:
            with urllib.request.urlopen(self.url(path), timeout=10) as r:
                body = r.read()
                kind = r.headers.get("Content-Type", "")
                return r.status, json.loads(body) if "json" in kind else body
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")
        except OSError:
            return None, None

    def post(self, path: str, body: dict):
        req = urllib.request.Request(
            self.url(path), data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    log = (self.root / f"{name}.log").read_text(errors="replace")[-3000:]
                    raise AssertionError(
                        f"{name} exited ({proc.returncode}) while waiting for {what}:\n{log}"
                    )
            time.sleep(0.5)
        logs = {
            n: (self.root / f"{n}.log").read_text(errors="replace")[-2000:]
            for n in ("api", "worker")
            if (self.root / f"{n}.log").exists()
        }
        raise AssertionError(f"timed out waiting for {what}: {logs}")

    def status(self, job_id: str) -> dict:
        code, body = self.get(f"/v1/train/status/{job_id}")
        assert code == 200, body
        return body

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout: float = 180) -> dict:
        self.wait(lambda: self.status(job_id)["state"] in states, timeout, f"job {job_id} in {states}")
        return self.status(job_id)


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
