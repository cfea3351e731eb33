"""Benchmark the front door: admission latency and status-read throughput.

    .venv/bin/python qualification/bench_api.py [--admissions 40] [--seconds 10] [--clients 8]
                                                [--backends sqlite,postgres]

1. Admission latency: `POST /v1/train/sft` with 100 inline rows, through the Flask app in this
   process (validation, runner lookup, ingestion with the real Qwen3.5 tokenizer, memory
   planning, the admission transaction, the Redis publish), against a runner row registered from
   a tiny Qwen3.5 model exactly as the worker registers it. One warm-up admission loads the
   tokenizer first; then p50/p99 over `--admissions` submissions.
2. Status throughput: `kiln serve` (gunicorn, 2 workers x 4 threads) on loopback; `--clients`
   threads, each with one keep-alive connection, GET /v1/train/status/<id> for `--seconds`
   (bounded load: at most one request in flight per client). Requests/s and p50/p99 latency.

Needs Redis at KILN_TEST_REDIS (default redis://127.0.0.1:6379; db 12, a queue of its own that is
deleted afterwards) and, for the postgres backend, the Postgres
server at KILN_TEST_POSTGRES_URL (default postgresql://postgres@127.0.0.1:5432/test): a database
`kiln_bench_<random>` is created and dropped.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The tests' Redis server (KILN_TEST_REDIS, as in tests/services.py), so a second checkout can
# benchmark against its own.
REDIS_URL = os.environ.get("KILN_TEST_REDIS", "redis://127.0.0.1:6379").rstrip("/") + "/12"
QUEUE = f"kiln-bench-{uuid.uuid4().hex[:8]}"  # its own queue; deleted afterwards
POSTGRES_ADMIN_URL = os.environ.get("KILN_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
ROWS = 100


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def conversation(i: int) -> dict:
    return {
        "messages": [
            {"role": "system", "content": "You are a careful arithmetic tutor."},
            {"role": "user", "content": f"Row {i}: what is {i} times {i + 3}? Explain briefly."},
            {"role": "assistant", "content": f"{i} x {i + 3} = {i * (i + 3)}. Multiply {i} by {i + 3}."},
        ]
    }


@contextmanager
def database(backend: str, workdir: Path):
    if backend == "sqlite":
        yield f"sqlite:///{workdir / 'kiln.db'}"
        return
    import psycopg
    from sqlalchemy.engine import make_url

    name = f"kiln_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def runner_row(model_dir: Path) -> dict:
    from kiln_train.train.resident import load_resident
    from worker.runner import runner_registration

    kwargs = runner_registration(load_resident(model_dir))
    kwargs["free_memory_bytes"] = 16 << 30  # a fixed budget: the figure must not depend on the host
    kwargs["total_memory_bytes"] = 24 << 30
    return kwargs


def bench_admission(settings, runner_kwargs: dict, count: int) -> tuple[list[float], str]:
    from api import create_app
    from kiln.store import register_runner

    app = create_app(settings)
    services = app.extensions["kiln"]
    with services.sessions.begin() as session:
        register_runner(session, "bench-runner", **runner_kwargs)
    client = app.test_client()
    body = {"examples": [conversation(i) for i in range(ROWS)], "config": {"epochs": 1}}
    warm = client.post("/v1/train/sft", json=body)  # loads the tokenizer once
    assert warm.status_code == 200, warm.get_json()
    timings = []
    job_id = warm.get_json()["job_id"]
    for _ in range(count):
        started = time.perf_counter()
        response = client.post("/v1/train/sft", json=body)
        timings.append(time.perf_counter() - started)
        assert response.status_code == 200, response.get_json()
        assert response.get_json()["rows_kept"] == ROWS
    services.close()
    return timings, job_id


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gunicorn(env: dict, port: int):
    cmd = [sys.executable, "-m", "kiln_cli.main", "serve", "--port", str(port), "--workers", "2"]
    server = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.3)
        else:
            raise RuntimeError("kiln serve did not start")
        yield
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)


def bench_status(port: int, job_id: str, clients: int, seconds: float) -> tuple[int, list[float]]:
    latencies: list[list[float]] = [[] for _ in range(clients)]
    stop = time.monotonic() + seconds
    path = f"/v1/train/status/{job_id}"

    def client(index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while time.monotonic() < stop:
            started = time.perf_counter()
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"status {response.status}")
            latencies[index].append(time.perf_counter() - started)
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    flat = [x for per in latencies for x in per]
    return int(len(flat) / elapsed), flat


def run(backend: str, args, model_dir: Path, runner_kwargs: dict) -> dict:
    import redis

    from kiln.settings import Settings
    from kiln.store import upgrade_database

    with tempfile.TemporaryDirectory() as tmp, database(backend, Path(tmp)) as url:
        storage = Path(tmp) / "storage"
        upgrade_database(url)
        settings = Settings.model_validate(
            {
                "storage": {"root": str(storage)},
                "database": {"url": url},
                "queue": {"broker_url": REDIS_URL, "queue_name": QUEUE},
                "training": {
                    "max_queued_jobs": args.admissions + 10,
                    "max_tracked_jobs": args.admissions + 10,
                },
            }
        )
        timings, job_id = bench_admission(settings, runner_kwargs, args.admissions)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        env.update(
            KILN_STORAGE_ROOT=str(storage),
            KILN_DATABASE_URL=url,
            KILN_QUEUE_BROKER_URL=REDIS_URL,
            KILN_QUEUE_QUEUE_NAME=QUEUE,
        )
        port = free_port()
        with gunicorn(env, port):
            bench_status(port, job_id, args.clients, 1.0)  # warm connections and caches
            rps, latencies = bench_status(port, job_id, args.clients, args.seconds)
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=f"*{QUEUE}*"):
        client.delete(key)
    return {
        "backend": backend,
        "admission_rows": ROWS,
        "admissions": len(timings),
        "admission_p50_ms": round(percentile(timings, 50) * 1000, 1),
        "admission_p99_ms": round(percentile(timings, 99) * 1000, 1),
        "admission_mean_ms": round(statistics.fmean(timings) * 1000, 1),
        "status_clients": args.clients,
        "status_requests": len(latencies),
        "status_rps": rps,
        "status_p50_ms": round(percentile(latencies, 50) * 1000, 2),
        "status_p99_ms": round(percentile(latencies, 99) * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--admissions", type=int, default=40)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--backends", default="sqlite,postgres")
    args = parser.parse_args()

    from kiln_train.model.tiny import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(Path(tmp) / "tiny", preset="tiny")
        runner_kwargs = runner_row(model_dir)
        results = [run(b.strip(), args, model_dir, runner_kwargs) for b in args.backends.split(",")]
    print(f"host: {os.cpu_count()} CPUs; gunicorn 2 workers x 4 threads; admission = {ROWS} inline rows")
    for r in results:
        print(
            f"{r['backend']:>8}: admission p50 {r['admission_p50_ms']} ms, p99 {r['admission_p99_ms']} ms "
            f"(n={r['admissions']}); GET status {r['status_rps']} req/s with {r['status_clients']} clients "
            f"(p50 {r['status_p50_ms']} ms, p99 {r['status_p99_ms']} ms, n={r['status_requests']})"
        )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
