"""The api on a free port in a thread, for the CLI tests: werkzeug's server over a migrated SQLite
store, the test's own Redis queue and, when given, a live runner row for the tiny model. A WSGI
recorder keeps every request so a test sees exactly what the CLI sent (body, bearer token,
Idempotency-Key). No worker runs, so jobs stay queued unless a test cancels them."""

from __future__ import annotations

import io
import json
import threading
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from werkzeug.serving import make_server

from api import create_app
from kiln.settings import Settings
from kiln.store import make_engine, register_runner, session_factory
from tests.api.conftest import REDIS_URL, example, make_settings
from tests.kiln.store.store_support import migrated_database

PROFILE = "native_online_lora_v1"
TOKEN = "cli-test-token"


# ----- a real api in a thread -----------------------------------------------------------------


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    authorization: str | None
    idempotency_key: str | None
    body: bytes

    def json(self):
        return json.loads(self.body)


class Recorder:
    """WSGI middleware keeping every request the server receives."""

    def __init__(self, app) -> None:
        self.app = app
        self.requests: list[Recorded] = []

    def __call__(self, environ, start_response):
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        environ["wsgi.input"] = io.BytesIO(body)
        self.requests.append(
            Recorded(
                environ["REQUEST_METHOD"],
                environ["PATH_INFO"],
                dict(urllib.parse.parse_qsl(environ.get("QUERY_STRING", ""))),
                environ.get("HTTP_AUTHORIZATION"),
                environ.get("HTTP_IDEMPOTENCY_KEY"),
                body,
            )
        )
        return self.app(environ, start_response)

    def posts(self) -> list[Recorded]:
        return [r for r in self.requests if r.method == "POST"]


@dataclass
class Server:
    url: str
    port: int
    settings: Settings
    sessions: object
    recorder: Recorder
    queue: str
    stop: Callable[[], None]


@contextmanager
def api_server(root: Path, runner: dict | None, **sections: dict) -> Iterator[Server]:
    """The api on a free port over a fresh SQLite store (with a live runner when given)."""
    storage = root / "storage"
    storage.mkdir(parents=True)
    queue = f"kiln-cli-test-{uuid.uuid4().hex[:10]}"
    with migrated_database("sqlite", root) as db_url:
        sections.setdefault("training", {})["runner_stale_seconds"] = 3600
        settings = make_settings(storage, db_url, queue, **sections)
        settings.ensure_dirs()
        engine = make_engine(db_url)
        sessions = session_factory(engine)
        if runner is not None:
            with sessions.begin() as session:
                register_runner(session, "runner-cli", **runner)
        app = create_app(settings)
        recorder = Recorder(app.wsgi_app)
        app.wsgi_app = recorder
        server = make_server("127.0.0.1", 0, app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        port = server.server_port

        def stop() -> None:
            server.shutdown()
            server.server_close()
            thread.join()

        try:
            yield Server(f"http://127.0.0.1:{port}", port, settings, sessions, recorder, queue, stop)
        finally:
            stop()
            app.extensions["kiln"].close()
            engine.dispose()
            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=f"*{queue}*"):
                client.delete(key)
            client.close()


def write_jsonl(path: Path, rows: list, blank_lines: bool = False) -> Path:
    lines = []
    for row in rows:
        lines.append(row if isinstance(row, str) else json.dumps(row))
        if blank_lines:
            lines.append("   ")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def name(prefix: str = "cli") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def submit(kiln, tmp_path, *flags: str, rows: int = 2) -> dict:
    data = write_jsonl(tmp_path / f"{uuid.uuid4().hex[:6]}.jsonl", [example(i) for i in range(rows)])
    code, out, err = kiln(
        "train", "sft", "--data", str(data), "--rank", "4", "--alpha", "8", "--epochs", "1",
        "--output-name", name(), *flags, "--no-wait", "--json",
    )  # fmt: skip
    assert code == 0, err
    return json.loads(out)


def http_json(server: Server, method: str, path: str):
    request = urllib.request.Request(server.url + path, method=method)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())
