"""`kiln serve` (gunicorn), `kiln health api`, `kiln db upgrade`, run as the real command."""

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

import pytest
from click.testing import CliRunner

from kiln.store import current_revision, head_revision, make_engine
from kiln_cli.main import cli
from tests.api.conftest import REDIS_URL


def _env(storage) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(
        KILN_STORAGE_ROOT=str(storage),
        KILN_QUEUE_BROKER_URL=REDIS_URL,
        KILN_QUEUE_QUEUE_NAME="kiln-api-serve-test",
    )
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_refuses_a_public_bind_without_tokens(tmp_path):
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0"], env=_env(tmp_path))
    assert result.exit_code == 2
    assert "not a loopback address" in result.output and "api_tokens" in result.output


def test_serve_refuses_an_unmigrated_database(tmp_path):
    result = CliRunner().invoke(cli, ["serve"], env=_env(tmp_path))
    assert result.exit_code == 2
    assert "kiln db upgrade" in result.output


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://kiln:hunter2@127.0.0.1:9/kiln",
        "postgresql+psycopg://kiln@127.0.0.1:9/kiln?password=hunter2",
        "postgresql+psycopg://kiln@127.0.0.1:9/kiln?sslpassword=hunter2&password=hunter3",
    ],
)
def test_serve_names_an_unreachable_database_without_its_password(url, tmp_path):
    result = CliRunner().invoke(cli, ["serve"], env={**_env(tmp_path), "KILN_DATABASE_URL": url})
    assert result.exit_code == 2
    assert "job database postgresql+psycopg://kiln" in result.output and "127.0.0.1:9" in result.output
    assert "hunter" not in result.output and "***" in result.output


def test_db_upgrade_creates_the_schema(tmp_path):
    result = CliRunner().invoke(cli, ["db", "upgrade"], env=_env(tmp_path))
    assert result.exit_code == 0, result.output
    engine = make_engine(f"sqlite:///{tmp_path / 'kiln.db'}")
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
    assert f"revision {head_revision()}" in result.output


def test_health_api_fails_when_nothing_listens():
    port = _free_port()
    result = CliRunner().invoke(
        cli, ["health", "api", "--url", f"http://127.0.0.1:{port}/health", "--timeout", "1"]
    )
    assert result.exit_code == 1 and "unreachable" in result.output


def test_serve_runs_gunicorn_and_answers_health(tmp_path):
    env = _env(tmp_path)
    port = _free_port()
    kiln = [sys.executable, "-m", "kiln_cli.main"]
    subprocess.run([*kiln, "db", "upgrade"], env=env, check=True, capture_output=True, timeout=120)
    server = subprocess.Popen(
        [*kiln, "serve", "--port", str(port), "--workers", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            probe = subprocess.run(
                [*kiln, "health", "api", "--url", f"{url}/health"], env=env, capture_output=True, text=True
            )
            if probe.returncode == 0:
                break
            assert server.poll() is None, server.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "kiln serve did not become healthy"
            time.sleep(0.5)
        assert "HTTP 200" in probe.stdout
        with urllib.request.urlopen(f"{url}/v1/train/status", timeout=5) as response:
            assert response.status == 200 and response.read() == b"[]"
        # Submissions land on both workers; the counters are summed over the worker processes.
        body = json.dumps({"examples": [{"messages": [{"role": "user", "content": "a"}]}]}).encode()
        for _ in range(6):
            request = urllib.request.Request(
                f"{url}/v1/train/sft", data=body, method="POST", headers={"Content-Type": "application/json"}
            )
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=5)
            assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "10"
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            text = response.read().decode()
        assert 'kiln_admissions_total{code="training_no_runner",outcome="rejected"} 6.0' in text
        assert "kiln_queue_depth 0.0" in text and "kiln_runner_up 0.0" in text
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    assert server.returncode == 0


def test_serve_allows_a_public_bind_when_told_to(tmp_path):
    # The bind check passes; start-up then stops at the (unmigrated) schema check instead.
    result = CliRunner().invoke(
        cli, ["serve", "--host", "0.0.0.0", "--allow-unauthenticated-remote"], env=_env(tmp_path)
    )
    assert result.exit_code == 2
    assert "loopback" not in result.output and "kiln db upgrade" in result.output
    tokens = CliRunner().invoke(
        cli, ["serve", "--host", "0.0.0.0"], env={**_env(tmp_path), "KILN_SERVER_API_TOKENS": "t1"}
    )
    assert tokens.exit_code == 2 and "kiln db upgrade" in tokens.output
