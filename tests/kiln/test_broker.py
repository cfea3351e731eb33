"""The broker client: Celery's settings and the URL kombu is given (a real password-protected Redis)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from kiln.broker import celery_config, make_broker_client, publish_job
from kiln.settings import ConfigError, load_settings
from kiln.settings.broker_url import kombu_url

PASSWORD = "s3/cr@t:pw"
QUOTED = "s3%2Fcr%40t%3Apw"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def private_redis(tmp_path: Path):
    """A Redis server of this test's own that requires PASSWORD."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed (the test machine runs Redis on 127.0.0.1)")
    port = _free_port()
    proc = subprocess.Popen(
        [
            server,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--requirepass",
            PASSWORD,
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    yield port, client
    proc.terminate()
    proc.wait(timeout=10)


def test_a_query_password_reaches_redis_and_the_job_is_queued(tmp_path, private_redis):
    port, client = private_redis
    url = f"redis://127.0.0.1:{port}/0?password={QUOTED}"
    settings = load_settings(
        environ={"KILN_QUEUE_BROKER_URL": url, "KILN_QUEUE_QUEUE_NAME": "gpu-test"}, cwd=tmp_path
    ).settings
    app = make_broker_client(settings)
    publish_job(app, "job-123", "gpu-test")
    assert client.llen("gpu-test") == 1
    assert b"job-123" in client.lindex("gpu-test", 0)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            f"redis://h:6379/0?password={QUOTED}&ssl_cert_reqs=none",
            f"redis://:{QUOTED}@h:6379/0?ssl_cert_reqs=none",
        ),
        ("redis://u@h/1?password=x;redis://h2/0?password=y", "redis://u:x@h/1;redis://:y@h2/0"),
        ("redis://:pw@h:6379/0", "redis://:pw@h:6379/0"),
        ("sqla+sqlite:////var/lib/kiln/broker.db", "sqla+sqlite:////var/lib/kiln/broker.db"),
    ],
)
def test_kombu_url_moves_the_query_password_into_the_userinfo(given, expected):
    assert kombu_url(given) == expected


def test_celery_config_gives_kombu_the_moved_password(tmp_path):
    settings = load_settings(
        environ={"KILN_QUEUE_BROKER_URL": "redis://r:6379/2?password=pw"}, cwd=tmp_path
    ).settings
    assert celery_config(settings)["broker_url"] == "redis://:pw@r:6379/2"


def test_a_password_given_twice_stops_start_up_without_echoing_it(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_settings(environ={"KILN_QUEUE_BROKER_URL": "redis://:first@r/0?password=second"}, cwd=tmp_path)
    assert "given twice" in str(err.value)
    assert "first" not in str(err.value) and "second" not in str(err.value)
