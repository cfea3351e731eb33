"""A hostile run against the real `kiln serve` (gunicorn): deep JSON in an import archive and in a
body, ranks past the model, a line past the bound, a body past the limit, path tricks, bad tokens.
Every answer is a 4xx envelope, never a 5xx, and the api's log (its stderr, `api.log`) holds no
traceback and no error line afterwards."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request

from kiln.store import make_engine, register_runner, session_factory
from tests.api.conftest import REDIS_URL, example
from tests.kiln_cli.test_service_cmd import _free_port

TOKEN = "hostile-run-token"
DEEP = b"[" * 100_000 + b"]" * 100_000


def _tar_gz(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"run/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _send(url: str, method: str, path: str, body: bytes | None = None, ctype: str | None = None, token=TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if ctype:
        headers["Content-Type"] = ctype
    request = urllib.request.Request(url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _hostile(registry: str) -> list[tuple[str, str, bytes | None, str | None, object, int]]:
    sft = {"examples": [example(0)], "config": {"epochs": 1, "lora_rank": 4, "lora_alpha": 8.0}}
    export = {"name": "big", "examples": [example(0)], "config": {"lora_rank": 8192, "lora_alpha": 16.0}}
    safetensors = (2).to_bytes(8, "little") + b"{}"
    long_line = json.dumps(example(0)).encode()[:-1] + b', "pad": "' + b"x" * (1 << 20) + b'"}\n'
    j, nd, gz = "application/json", "application/x-ndjson", "application/gzip"
    return [
        (
            "POST",
            "/v1/train/hf/peft/imports/deep",
            _tar_gz({"adapter_config.json": DEEP, "adapter_model.safetensors": safetensors}),
            gz,
            TOKEN,
            400,
        ),
        (
            "POST",
            "/v1/train/hf/peft/imports/header",
            _tar_gz(
                {
                    "adapter_config.json": b'{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}',
                    "adapter_model.safetensors": len(DEEP).to_bytes(8, "little") + DEEP,
                }
            ),
            gz,
            TOKEN,
            400,
        ),
        ("POST", "/v1/train/hf/peft/imports/garbage", b"\x1f\x8b not a gzip", gz, TOKEN, 400),
        ("POST", "/v1/train/hf/sft/exports", json.dumps(export).encode(), j, TOKEN, 400),
        ("POST", "/v1/datasets?name=long.jsonl", long_line, nd, TOKEN, 400),
        ("POST", "/v1/data/inspect", DEEP + b"\n", nd, TOKEN, 200),  # a rejected row, reported
        ("POST", "/v1/datasets?name=..%2Fescape.jsonl", b"{}\n", nd, TOKEN, 400),
        ("POST", "/v1/train/sft", b'{"examples": ' + DEEP + b"}", j, TOKEN, 400),
        (
            "POST",
            "/v1/train/sft",
            json.dumps({**sft, "config": {**sft["config"], "resume_checkpoint": f"{registry}/.."}}).encode(),
            j,
            TOKEN,
            400,
        ),
        (
            "POST",
            "/v1/train/sft",
            b'{"examples": [{"messages": [{"role": "user", "content": "\\ud800"}]}]}',
            j,
            TOKEN,
            400,
        ),
        ("POST", "/v1/train/sft", b"x" * (2 << 20) + b"x", j, TOKEN, 413),
        ("POST", "/v1/train/sft", json.dumps(sft).encode(), "text/plain", TOKEN, 415),
        ("GET", "/v1/adapters/..%2F..%2Fetc/download", None, None, TOKEN, 404),
        ("GET", "/v1/train/jobs/%00/events", None, None, TOKEN, 404),
        ("GET", "/v1/train/status", None, None, None, 401),
        ("GET", "/metrics", None, None, "wrong-token", 401),
    ]


def test_a_hostile_run_gets_4xx_answers_and_leaves_no_traceback_in_the_api_log(tmp_path, runner_kwargs):
    storage = tmp_path / "storage"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(
        KILN_STORAGE_ROOT=str(storage),
        KILN_QUEUE_BROKER_URL=REDIS_URL,
        KILN_QUEUE_QUEUE_NAME="kiln-hostile-run-test",
        KILN_SERVER_API_TOKENS=TOKEN,
        KILN_SERVER_MAX_REQUEST_MB="2",
        KILN_TRAINING_RUNNER_STALE_SECONDS="3600",
    )
    kiln = [sys.executable, "-m", "kiln_cli.main"]
    subprocess.run([*kiln, "db", "upgrade"], env=env, check=True, capture_output=True, timeout=120)
    engine = make_engine(f"sqlite:///{storage / 'kiln.db'}")
    with session_factory(engine).begin() as session:
        register_runner(session, "hostile-runner", **runner_kwargs)
    engine.dispose()
    port = _free_port()
    log_path = tmp_path / "api.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [*kiln, "serve", "--port", str(port), "--workers", "1"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while _probe(url) != 200:
            assert server.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "kiln serve did not become healthy"
            time.sleep(0.5)
        answers = []
        for method, path, body, ctype, token, status in _hostile(str(storage.resolve() / "adapters")):
            got, payload = _send(url, method, path, body, ctype, token)
            answers.append((method, path[:60], got, status))
            assert got == status, (method, path[:80], got, payload[:300])
            if got == 200:
                (row,) = json.loads(payload)["rows"]
                assert "nested deeper than" in row["facts"]["detail"], row
                continue
            error = json.loads(payload)["error"]
            assert set(error) == {"code", "message", "hint"} and isinstance(error["hint"], str)
            assert str(storage.resolve()) not in error["message"], error
        assert _probe(url) == 200  # still up
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
    log = log_path.read_text(errors="replace")
    assert "Booting worker" in log  # the log is the server's
    assert "Traceback" not in log, log[-4000:]
    assert "[ERROR]" not in log and " ERROR " not in log, log[-4000:]


def _probe(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status
    except (urllib.error.URLError, OSError):
        return None
