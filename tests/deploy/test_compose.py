"""The docker compose stack, checked without a Docker engine.

`docker-compose config` (Debian's docker-compose renders and validates a compose file with no
engine) must accept the stack and its CPU override; the rendered services must carry the
settings long GPU jobs need; every `kiln` command inside them must be a real command of this
project; the TOML and Flower config they mount must load; Flower must start with that config.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from kiln.cli.main import cli
from kiln.settings import load_settings
from tests.services import redis_url

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CPU_OVERRIDE = ROOT / "deploy" / "compose.cpu.yml"


def host_ips(ports: list) -> set[str]:
    """Host addresses of published ports (long syntax dicts or `ip:host:container` strings)."""
    out = set()
    for p in ports:
        out.add(str(p.get("host_ip", "")) if isinstance(p, dict) else str(p).split(":")[0])
    return out


def render(*files: Path) -> dict:
    tool = shutil.which("docker-compose")
    assert tool, (
        "docker-compose (Debian package docker-compose) is required: scripts/test installs it when run as root with apt-get"
    )
    args = [tool, "--env-file", str(ROOT / ".env.example")]
    for f in files:
        args += ["-f", str(f)]
    done = subprocess.run([*args, "config"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module")
def stack() -> dict:
    return render(COMPOSE)


def test_services_and_dependencies(stack):
    services = stack["services"]
    assert set(services) == {"postgres", "redis", "migrate", "api", "worker", "flower"}
    assert services["api"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["worker"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("postgres", "redis", "api", "worker"):
        assert "test" in services[name]["healthcheck"], name
    assert set(stack["volumes"]) >= {"pgdata", "redisdata", "storage", "models", "flowerdata"}


def test_redis_keeps_messages_and_is_private(stack):
    redis = stack["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command
    assert "ports" not in redis


def test_worker_owns_one_gpu_and_time_to_checkpoint(stack):
    worker = stack["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"capabilities": ["gpu"], "device_ids": ["0"], "driver": "nvidia"}]
    assert worker["environment"]["KILN_MODEL_DEVICE"] == "cuda"
    grace = worker["stop_grace_period"]
    assert grace.endswith("m") and int(grace[:-1]) >= 2 or grace.endswith("s") and int(grace[:-1]) >= 120


def test_flower_is_authenticated_read_only_and_local(stack):
    flower = stack["services"]["flower"]
    assert host_ips(flower["ports"]) == {"127.0.0.1"}
    assert "FLOWER_BASIC_AUTH" in flower["environment"]
    conf = {}
    exec((ROOT / "deploy" / "flowerconfig.py").read_text(), conf)  # noqa: S102 (our own config file)
    assert conf["read_only"] is True and conf["persistent"] is True
    assert any(
        str(v).split(":")[1] == "/var/lib/flower" if isinstance(v, str) else v["target"] == "/var/lib/flower"
        for v in flower["volumes"]
    )


def test_api_is_published_on_loopback_only(stack):
    assert host_ips(stack["services"]["api"]["ports"]) == {"127.0.0.1"}


def test_cpu_override_parks_the_gpu_worker():
    services = render(COMPOSE, CPU_OVERRIDE)["services"]
    assert services["worker"]["profiles"] == ["gpu"]
    cpu = services["worker-cpu"]
    assert cpu["environment"]["KILN_MODEL_DEVICE"] == "cpu"
    assert "deploy" not in cpu
    assert "init-tiny" in " ".join(cpu["command"])


def _kiln_commands(services: dict) -> list[list[str]]:
    commands = []
    for svc in services.values():
        for key in ("command",):
            cmd = svc.get(key)
            if cmd is None:
                continue
            cmd = list(cmd) if isinstance(cmd, list) else shlex.split(cmd)
            if cmd[:2] == ["sh", "-c"]:
                for part in cmd[2].split("&&"):
                    words = shlex.split(part.replace("exec ", ""))
                    if words and words[0] == "kiln":
                        commands.append(words)
            elif cmd and cmd[0] == "kiln":
                commands.append(cmd)
        test = svc.get("healthcheck", {}).get("test", [])
        if len(test) > 1 and test[0] == "CMD" and test[1] == "kiln":
            commands.append(test[1:])
    return commands


def test_every_kiln_command_in_the_stack_exists_with_its_flags():
    services = {**render(COMPOSE)["services"], **render(COMPOSE, CPU_OVERRIDE)["services"]}
    commands = _kiln_commands(services)
    assert {tuple(c[:3]) for c in commands} >= {
        ("kiln", "db", "upgrade"),
        ("kiln", "serve"),
        ("kiln", "worker"),
        ("kiln", "health", "api"),
        ("kiln", "health", "worker"),
        ("kiln", "model", "init-tiny"),
    }
    runner = CliRunner()
    for words in commands:
        # Positional arguments are dropped; every option must be one the command declares.
        path = [w for w in words[1:] if not w.startswith("-") and not w.startswith("/")]
        options = [w.split("=")[0] for w in words[1:] if w.startswith("--")]
        result = runner.invoke(cli, [*path, "--help"])
        assert result.exit_code == 0, (words, result.output)
        for option in options:
            assert option in result.output, (words, option)


def test_the_mounted_kiln_toml_is_valid():
    loaded = load_settings(ROOT / "deploy" / "kiln.toml", environ={})
    assert loaded.settings.queue.visibility_timeout_s >= 86400
    assert loaded.settings.model.device == "cuda"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_flower_starts_with_the_stack_config(tmp_path):
    """The exact Flower command of the compose file, against a real Redis, with basic auth."""
    port = _free_port()
    conf = tmp_path / "flowerconfig.py"
    conf.write_text(
        (ROOT / "deploy" / "flowerconfig.py")
        .read_text()
        .replace('"/var/lib/flower/flower.db"', repr(str(tmp_path / "flower.db")))
        .replace("port = 5555", f"port = {port}")
        .replace('address = "0.0.0.0"', 'address = "127.0.0.1"')
    )
    env = {
        **os.environ,
        "KILN_QUEUE_BROKER_URL": redis_url(14),
        "FLOWER_BASIC_AUTH": "admin:secret",
    }
    celery = Path(sys.executable).with_name("celery")
    proc = subprocess.Popen(
        [str(celery), "-A", "worker.celery_entry", "flower", f"--conf={conf}"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline, status = time.monotonic() + 60, None
        while time.monotonic() < deadline and status is None:
            try:
                urllib.request.urlopen(url, timeout=2)
                status = 200
            except urllib.error.HTTPError as e:
                status = e.code
            except OSError:
                time.sleep(0.5)
        assert status == 401  # basic auth required
        auth = {"Authorization": "Basic " + b64encode(b"admin:secret").decode()}
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth), timeout=5) as r:
            assert r.status == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_images_copy_only_what_exists():
    for name in ("api.Dockerfile", "worker.Dockerfile"):
        for line in (ROOT / "deploy" / name).read_text().splitlines():
            if line.startswith("COPY "):
                for src in line.split()[1:-1]:
                    assert (ROOT / src).exists(), (name, src)
