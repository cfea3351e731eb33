"""The front door as `kiln serve` (gunicorn) runs it, over raw sockets: what the Flask test client
cannot send or never sees. A chunked body over `server.max_request_mb` (a 413, never a prefix
admitted), broken chunked framing, gunicorn's own 400/414/431 answers (in the api's envelope, not
HTML), and a submission beyond the admission slot (its 503 arrives whole, not as a reset under a
client still sending its body)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from sqlalchemy import func, select

from kiln.store import Job, make_engine, register_runner, session_factory, upgrade_database
from tests.api.conftest import REDIS_URL, example

LIMIT_MB = 4
LIMIT = LIMIT_MB << 20


@dataclass
class Served:
    port: int
    db_url: str
    queue: str

    def jobs(self) -> int:
        engine = make_engine(self.db_url)
        try:
            with engine.connect() as connection:
                return int(connection.execute(select(func.count()).select_from(Job)).scalar_one())
        finally:
            engine.dispose()

    def queued_messages(self) -> int:
        client = redis.Redis.from_url(REDIS_URL)
        try:
            return int(client.llen(self.queue))
        finally:
            client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory, runner_kwargs) -> Iterator[Served]:
    storage = tmp_path_factory.mktemp("served")
    db_url = f"sqlite:///{storage / 'kiln.db'}"
    upgrade_database(db_url)
    engine = make_engine(db_url)
    with session_factory(engine).begin() as session:
        register_runner(session, "runner-served", **runner_kwargs)
    engine.dispose()
    queue = f"kiln-api-served-{uuid.uuid4().hex[:10]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(
        KILN_STORAGE_ROOT=str(storage),
        KILN_DATABASE_URL=db_url,
        KILN_QUEUE_BROKER_URL=REDIS_URL,
        KILN_QUEUE_QUEUE_NAME=queue,
        KILN_SERVER_MAX_REQUEST_MB=str(LIMIT_MB),
        KILN_TRAINING_RUNNER_STALE_SECONDS="86400",  # the registered runner stays live for the module
        KILN_TRAINING_MAX_QUEUED_JOBS="1000",
    )
    port = _free_port()
    # Two worker processes share the one admission slot (server.max_concurrent_admissions = 1).
    server = subprocess.Popen(
        [sys.executable, "-m", "kiln_cli.main", "serve", "--port", str(port), "--workers", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert server.poll() is None, server.stdout.read().decode()[-3000:]
                assert time.monotonic() < deadline, "kiln serve did not start"
                time.sleep(0.3)
        yield Served(port, db_url, queue)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"*{queue}*"):
            client.delete(key)
        client.close()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict:
        assert self.headers["content-type"] == "application/json", self.headers
        return json.loads(self.body)["error"]


def exchange(port: int, data: bytes, timeout: float = 120) -> Answer:
    """Send `data` as it is, then read one complete answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_answer(sock)


def read_answer(sock: socket.socket) -> Answer:
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before an answer: {buffer!r}"
        buffer += chunk
    head, _, body = buffer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside the answer's body"
        body += chunk
    return Answer(int(status_line.split()[1]), headers, body[:length])


def chunked(body: bytes, size: int = 8192) -> bytes:
    chunks = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


def post_chunked(port: int, body: bytes) -> Answer:
    head = (
        b"POST /v1/train/sft HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    return exchange(port, head + chunked(body))


def padded(body: dict, size: int) -> bytes:
    """`body` as JSON followed by whitespace up to exactly `size` bytes."""
    text = json.dumps(body).encode()
    return text + b" " * (size - len(text))


def sft(rows: int) -> dict:
    return {
        "examples": [example(i) for i in range(rows)],
        "config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0},
    }


def test_a_chunked_body_over_the_limit_is_413_and_never_parsed(served):
    jobs, messages = served.jobs(), served.queued_messages()
    # A valid request padded to the limit, then junk: a parser given the first LIMIT bytes admits it.
    answer = post_chunked(served.port, padded(sft(1), LIMIT) + b"}junk" * 100)
    assert answer.status == 413
    error = answer.error()
    assert error["code"] == "training_request_too_large" and "server.max_request_mb" in error["message"]
    assert answer.headers["x-content-type-options"] == "nosniff"
    one_byte_over = post_chunked(served.port, padded(sft(1), LIMIT + 1))
    assert one_byte_over.status == 413 and one_byte_over.error()["code"] == "training_request_too_large"
    assert (served.jobs(), served.queued_messages()) == (jobs, messages)


def test_a_chunked_body_of_exactly_the_limit_is_admitted(served):
    jobs = served.jobs()
    answer = post_chunked(served.port, padded(sft(2), LIMIT))
    assert answer.status == 200, answer.body[:500]
    assert json.loads(answer.body)["rows_kept"] == 2
    assert served.jobs() == jobs + 1


def test_broken_chunked_framing_is_400_not_500(served):
    jobs = served.jobs()
    head = (
        b"POST /v1/train/sft HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    answer = exchange(served.port, head + b"zz\r\n{}\r\n0\r\n\r\n")
    assert answer.status == 400
    error = answer.error()
    assert error["code"] == "training_invalid_request" and "chunk" in error["message"].lower()
    assert served.jobs() == jobs


@pytest.mark.parametrize(
    ("request_bytes", "status", "code", "hint"),
    [
        (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 414, "uri_too_long", "4094 bytes"),
        (
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
            431,
            "request_header_fields_too_large",
            "8190 bytes",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + b"".join(b"X-%d: a\r\n" % i for i in range(120))
            + b"\r\n",
            431,
            "request_header_fields_too_large",
            "100 header fields",
        ),
        (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nNo Colon Here\r\n\r\n", 400, "bad_request", "HTTP/1.1"),
        (b"GARBAGE\r\n\r\n", 400, "bad_request", "HTTP/1.1"),
        (
            b"POST /v1/train/sft HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: foo, chunked\r\n\r\n",
            501,
            "not_implemented",
            "Content-Length",
        ),
    ],
)
def test_gunicorns_own_answers_carry_the_envelope(served, request_bytes, status, code, hint):
    answer = exchange(served.port, request_bytes)
    assert answer.status == status
    error = answer.error()
    assert error["code"] == code and error["message"] and hint in error["hint"]
    assert (
        answer.headers["x-content-type-options"] == "nosniff"
        and answer.headers["cache-control"] == "no-store"
    )
    assert answer.headers["connection"] == "close"


def test_a_submission_beyond_the_admission_slot_gets_its_whole_503(served):
    body = padded(sft(1), LIMIT)
    rows = 1000
    while len(json.dumps(sft(rows + 1000))) < LIMIT:
        rows += 1000
    big = padded(sft(rows), LIMIT)  # tens of thousands of rows: seconds of tokenization
    first_head = (
        b"POST /v1/train/sft HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(big)
    )
    first = socket.create_connection(("127.0.0.1", served.port), timeout=300)
    answers: dict[str, Answer] = {}
    order: list[str] = []

    def admit_first() -> None:
        first.sendall(first_head + big)
        answers["first"] = read_answer(first)
        order.append("first")

    thread = threading.Thread(target=admit_first)
    thread.start()
    time.sleep(1.0)  # the first submission is being tokenized now (it takes seconds)
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    # The whole 4 MiB body goes out although the answer is known after the headers: the client
    # must still get it (gunicorn itself drains only 64 KiB and would reset the connection).
    conn.request("POST", "/v1/train/sft", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    order.append("second")
    conn.close()
    thread.join(timeout=300)
    first.close()
    assert response.status == 503, payload[:300]
    error = json.loads(payload)["error"]
    assert error["code"] == "admission_busy" and response.getheader("Retry-After") == "2"
    assert answers["first"].status == 200 and order == ["second", "first"]
    assert json.loads(answers["first"].body)["rows_kept"] == rows
