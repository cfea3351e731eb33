"""Benchmark: `/health` and status latency while clients submit max-size bodies.

    .venv/bin/python qualification/bench_health.py [--clients 8] [--body-mb 8] [--seconds 30]
                                                   [--backend sqlite|postgres]
                                                   [--uploads 0] [--exports 0]

`kiln serve` (gunicorn, 2 workers x 4 threads: the defaults) runs on loopback with
`server.max_request_mb = --body-mb` and a live runner registered from a tiny Qwen3.5 model (the
real Qwen3.5 tokenizer), its heartbeat kept fresh. `--clients` threads each POST a body of exactly
`--body-mb` MiB (inline conversations, the last bytes JSON whitespace) to `/v1/train/sft` again and
again for `--seconds`; a 503 is retried after its Retry-After. Meanwhile one prober GETs `/health`
and one GETs `/v1/train/status` back to back, each on its own keep-alive connection. Prints the
probes' p50/p95/p99/max latency and the submissions' outcomes. Target: `/health` p99 < 100 ms.

`--uploads N` adds N threads each uploading a JSON Lines dataset of exactly `--body-mb` MiB to
`POST /v1/datasets` (deleted again once stored), and `--exports M` adds M threads each asking for
an HF export of 40 conversations (`POST /v1/train/hf/sft/exports`, deleted once written): the
issue-30 load is `--clients 0 --uploads 8 --exports 4 --body-mb 64`. Every route that tokenizes
takes one of the server's admission slots or answers 503 `admission_busy` at once, so /health
keeps its threads and cores.

Needs Redis at KILN_TEST_REDIS (default redis://127.0.0.1:6379; db 12, a queue of its own that is
deleted afterwards); the postgres backend needs KILN_TEST_POSTGRES_URL (default
postgresql://postgres@127.0.0.1:5432/test).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qualification.bench_api import (  # noqa: E402
    QUEUE,
    REDIS_URL,
    database,
    free_port,
    gunicorn,
    percentile,
    runner_row,
)

MIB = 1 << 20
RUNNER_ID = "bench-health-runner"
PROBE_TIMEOUT_S = 60.0


def conversation(i: int) -> bytes:
    """One ~2 KB conversation, as JSON."""
    text = f"Row {i}: " + " ".join(f"word{(i * 7 + k) % 997}" for k in range(220))
    return json.dumps(
        {
            "messages": [
                {"role": "user", "content": f"Summarise row {i}."},
                {"role": "assistant", "content": text},
            ]
        }
    ).encode()


def conversations(budget: int) -> list[bytes]:
    """As many conversations as fit `budget` bytes with one separator byte each."""
    rows: list[bytes] = []
    length = 0
    while length + len(row := conversation(len(rows))) + 1 <= budget:
        rows.append(row)
        length += len(row) + 1
    return rows


def max_size_body(size: int) -> bytes:
    """A valid SFT request of exactly `size` bytes: ~2 KB conversations, padded with whitespace."""
    head = b'{"config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0}, "examples": ['
    body = head + b",".join(conversations(size - len(head) - 2)) + b"]}"
    return body + b" " * (size - len(body))


def max_size_dataset(size: int) -> bytes:
    """A JSON Lines dataset of exactly `size` bytes (the last line padded with spaces)."""
    body = b"".join(row + b"\n" for row in conversations(size - 1))
    return body + b" " * (size - len(body))


def export_body(name: str) -> bytes:
    rows = [json.loads(conversation(i)) for i in range(40)]
    config = {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0, "optimizer": {"kind": "sgd"}, "seed": 1}
    return json.dumps({"name": name, "examples": rows, "config": config}).encode()


def creator(port: int, kind: str, ident: int, body: bytes, stop: threading.Event, outcomes: Counter) -> None:
    """Upload datasets (`kind` "upload") or ask for exports ("export") again and again, deleting
    each one created; a 503 is retried after its Retry-After."""
    n = 0
    while not stop.is_set():
        n += 1
        name = f"bench-{ident}-{n}"
        if kind == "upload":
            path, delete, data, ctype = (
                f"/v1/datasets?name={name}.jsonl",
                f"/v1/datasets/{name}.jsonl",
                body,
                "application/x-ndjson",
            )
        else:
            path, delete, data, ctype = (
                "/v1/train/hf/sft/exports",
                f"/v1/train/hf/exports/{name}",
                export_body(name),
                "application/json",
            )
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        try:
            conn.request(
                "POST", path, body=data, headers={"Content-Type": ctype, "Content-Length": str(len(data))}
            )
            response = conn.getresponse()
            payload = response.read()
            if response.status == 201:
                conn.request("DELETE", delete)
                conn.getresponse().read()
        except OSError as exc:
            outcomes[f"{kind} connection error: {type(exc).__name__}"] += 1
            time.sleep(0.5)
            continue
        finally:
            conn.close()
        code = (
            json.loads(payload)["error"]["code"]
            if response.status >= 400 and payload.startswith(b"{")
            else ""
        )
        outcomes[f"{kind} {response.status} {code}".rstrip()] += 1
        if response.status == 503:
            retry = response.getheader("Retry-After")
            time.sleep(float(retry) if retry else 0.5)


def keep_runner_alive(url: str, runner_kwargs: dict, stop: threading.Event) -> None:
    from kiln.store import heartbeat_runner, make_engine, register_runner, session_factory

    engine = make_engine(url)
    sessions = session_factory(engine)
    with sessions.begin() as session:
        register_runner(session, RUNNER_ID, **runner_kwargs)
    while not stop.wait(2.0):
        with sessions.begin() as session:
            heartbeat_runner(session, RUNNER_ID)
    engine.dispose()


def probe(port: int, path: str, stop: threading.Event, out: list[float], statuses: Counter) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PROBE_TIMEOUT_S)
    while not stop.is_set():
        started = time.perf_counter()
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
        except OSError:  # no answer within the timeout: counted, at the time it was given up on
            out.append(time.perf_counter() - started)
            statuses["no answer"] += 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PROBE_TIMEOUT_S)
            continue
        out.append(time.perf_counter() - started)
        statuses[response.status] += 1
        time.sleep(0.01)
    conn.close()


def submitter(port: int, body: bytes, stop: threading.Event, outcomes: Counter, admit_s: list[float]) -> None:
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        started = time.perf_counter()
        try:
            conn.request("POST", "/v1/train/sft", body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
        except OSError as exc:
            outcomes[f"connection error: {type(exc).__name__}"] += 1
            conn.close()
            time.sleep(0.5)
            continue
        conn.close()
        if response.status == 200:
            admit_s.append(time.perf_counter() - started)
            outcomes["200 admitted"] += 1
            continue
        code = json.loads(payload)["error"]["code"] if payload.startswith(b"{") else "?"
        outcomes[f"{response.status} {code}"] += 1
        retry = response.getheader("Retry-After")
        time.sleep(float(retry) if retry else 0.5)


def summary(name: str, values: list[float]) -> dict:
    if not values:
        return {"probe": name, "n": 0}
    return {
        "probe": name,
        "n": len(values),
        "p50_ms": round(percentile(values, 50) * 1000, 1),
        "p95_ms": round(percentile(values, 95) * 1000, 1),
        "p99_ms": round(percentile(values, 99) * 1000, 1),
        "max_ms": round(max(values) * 1000, 1),
    }


def run(args, runner_kwargs: dict) -> dict:
    import redis

    from kiln.store import upgrade_database

    body = max_size_body(int(args.body_mb * MIB))
    with tempfile.TemporaryDirectory() as tmp, database(args.backend, Path(tmp)) as url:
        storage = Path(tmp) / "storage"
        upgrade_database(url)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        env.update(
            KILN_STORAGE_ROOT=str(storage),
            KILN_DATABASE_URL=url,
            KILN_QUEUE_BROKER_URL=REDIS_URL,
            KILN_QUEUE_QUEUE_NAME=QUEUE,
            KILN_SERVER_MAX_REQUEST_MB=str(args.body_mb),
            KILN_TRAINING_MAX_QUEUED_JOBS="100000",
            KILN_TRAINING_MAX_TRACKED_JOBS="100000",
        )
        stop_runner = threading.Event()
        alive = threading.Thread(target=keep_runner_alive, args=(url, runner_kwargs, stop_runner))
        alive.start()
        port = free_port()
        try:
            with gunicorn(env, port):
                # Warm each worker's tokenizer cache with one small admission, outside the figures.
                warm = max_size_body(64 << 10)
                for _ in range(4):
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                    conn.request(
                        "POST", "/v1/train/sft", body=warm, headers={"Content-Type": "application/json"}
                    )
                    conn.getresponse().read()
                    conn.close()
                stop = threading.Event()
                health: list[float] = []
                status: list[float] = []
                probe_statuses: Counter = Counter()
                outcomes: Counter = Counter()
                admit_s: list[float] = []
                threads = [
                    threading.Thread(target=probe, args=(port, "/health", stop, health, probe_statuses)),
                    threading.Thread(
                        target=probe, args=(port, "/v1/train/status", stop, status, probe_statuses)
                    ),
                ]
                threads += [
                    threading.Thread(target=submitter, args=(port, body, stop, outcomes, admit_s))
                    for _ in range(args.clients)
                ]
                dataset = max_size_dataset(int(args.body_mb * MIB)) if args.uploads else b""
                threads += [
                    threading.Thread(target=creator, args=(port, "upload", i, dataset, stop, outcomes))
                    for i in range(args.uploads)
                ]
                threads += [
                    threading.Thread(target=creator, args=(port, "export", i, b"", stop, outcomes))
                    for i in range(args.exports)
                ]
                for t in threads:
                    t.start()
                time.sleep(args.seconds)
                stop.set()
                for t in threads:
                    t.join()
        finally:
            stop_runner.set()
            alive.join()
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=f"*{QUEUE}*"):
        client.delete(key)
    return {
        "backend": args.backend,
        "clients": args.clients,
        "uploads": args.uploads,
        "exports": args.exports,
        "body_bytes": len(body),
        "seconds": args.seconds,
        "health": summary("/health", health),
        "status": summary("/v1/train/status", status),
        "probe_statuses": dict(probe_statuses),
        "submissions": dict(outcomes),
        "admission": summary("POST /v1/train/sft (200)", admit_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--body-mb", type=float, default=8.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--uploads", type=int, default=0)
    parser.add_argument("--exports", type=int, default=0)
    args = parser.parse_args()

    from kiln_train.model.tiny import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        runner_kwargs = runner_row(write_tiny_checkpoint(Path(tmp) / "tiny", preset="tiny"))
        result = run(args, runner_kwargs)
    h, s = result["health"], result["status"]
    print(
        f"host: {os.cpu_count()} CPUs; {args.clients} clients posting {result['body_bytes']} B bodies, "
        f"{args.uploads} uploaders of {result['body_bytes']} B datasets and {args.exports} exporters for "
        f"{args.seconds:g} s ({args.backend})"
    )
    for r in (h, s, result["admission"]):
        if r["n"]:
            print(
                f"  {r['probe']}: p50 {r['p50_ms']} ms, p95 {r['p95_ms']} ms, p99 {r['p99_ms']} ms, "
                f"max {r['max_ms']} ms (n={r['n']})"
            )
    print(f"  requests: {result['submissions']}; probe answers: {result['probe_statuses']}")
    print(f"  target /health p99 < 100 ms: {'met' if h['n'] and h['p99_ms'] < 100 else 'NOT met'}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
