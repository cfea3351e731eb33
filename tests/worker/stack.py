"""Real `kiln serve` and `kiln worker` processes sharing one environment, for the end-to-end
tests: start, stop (any signal, the whole process group), wait for states, read the api."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.services import redis_url

KILN = [sys.executable, "-m", "kiln_cli.main"]
REDIS_E2E = redis_url(13)


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

    def start_worker(self, name: str = "worker") -> None:
        """Start a `kiln worker` process and wait until it registered its runner."""
        self.start(name, "worker")
        self.wait(lambda: "ready: backend" in self.log(name), 120, f"{name} registration")

    def send(self, name: str, sig: int) -> None:
        """Send `sig` (SIGSTOP, SIGCONT, SIGKILL, ...) to the process group of `name`, no waiting."""
        os.killpg(self.procs[name].pid, sig)

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, job_id: str) -> list[dict]:
        code, body = self.get(f"/v1/train/jobs/{job_id}/events?limit=1000")
        assert code == 200, body
        return body["data"]

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
        logs = {n: self.log(n)[-2000:] for n in self.procs}
        raise AssertionError(f"timed out waiting for {what}: {logs}")

    def status(self, job_id: str) -> dict:
        code, body = self.get(f"/v1/train/status/{job_id}")
        assert code == 200, body
        return body

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout: float = 180) -> dict:
        self.wait(lambda: self.status(job_id)["state"] in states, timeout, f"job {job_id} in {states}")
        return self.status(job_id)
