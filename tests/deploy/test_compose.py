"""The docker compose stack, checked without a Docker engine.

`docker-compose config` (Debian's docker-compose renders and validates a compose file with no
engine) must accept the stack and its CPU override; the rendered services must carry the
settings long GPU jobs need; every `kiln` command inside them must be a real command of this
project; the TOML and Flower config they mount must load; Flower must start with that config.

Read against the code: every KILN_* variable a service gets is a setting that loads (with the
kiln.toml it mounts), every path a service is told about lies on something mounted into it, the
api sees the model directory at the path the worker registers, the images give the non-root
`kiln` user a home and writable mount points, every `*:local` image can be built by `up`, and
Flower run by hand without basic auth stays on loopback.
"""

from __future__ import annotations

import os
import re
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
from pathlib import Path, PurePosixPath

import pytest
import yaml
from click.testing import CliRunner
from sqlalchemy.engine import make_url

from kiln.settings import load_settings
from kiln_cli.main import cli
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


def render(*files: Path, env_file: Path = ROOT / ".env.example") -> dict:
    """`docker-compose config` of the files, with the variables of `env_file`."""
    tool = shutil.which("docker-compose")
    assert tool, (
        "docker-compose (Debian package docker-compose) is required: scripts/test installs it when run as root with apt-get"
    )
    args = [tool, "--env-file", str(env_file)]
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
    for name in ("postgres", "redis", "api", "worker", "flower"):
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


# ----- the stack read against the code ------------------------------------------------------------


CLIENT_ONLY = {"KILN_API_URL", "KILN_API_TOKEN"}


@pytest.fixture(scope="module")
def services() -> dict:
    return {**render(COMPOSE)["services"], **render(COMPOSE, CPU_OVERRIDE)["services"]}


def mounts(service: dict) -> dict[str, str]:
    """container path -> source (host path or volume name)."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            out[volume["target"]] = str(volume.get("source"))
        else:
            source, target = volume.split(":")[:2]
            out[target] = source
    return out


def mounted(path: str, service: dict) -> bool:
    p = PurePosixPath(path)
    return any(p == PurePosixPath(t) or PurePosixPath(t) in p.parents for t in mounts(service))


def host_file(service: dict, container_path: str) -> Path:
    source = mounts(service)[container_path]
    assert source.startswith("/"), (container_path, source)  # a bind mount of a checked-in file
    return Path(source)


KILN_SERVICES = ("migrate", "api", "worker", "worker-cpu", "flower")


@pytest.mark.parametrize("name", KILN_SERVICES)
def test_every_kiln_variable_is_a_setting_that_loads(services, name):
    env = {k: str(v) for k, v in services[name]["environment"].items()}
    config = env.pop("KILN_CONFIG")
    assert mounted(config, services[name]), (name, config)
    toml = host_file(services[name], config)
    assert toml == ROOT / "deploy" / "kiln.toml"
    kiln_env = {k: v for k, v in env.items() if k.startswith("KILN_") and k not in CLIENT_ONLY}
    loaded = load_settings(toml, environ=kiln_env)
    for key in kiln_env:
        assert f"env:{key}" in loaded.sources.values(), (name, key)
    settings = loaded.settings
    assert settings.queue.broker_url == "redis://redis:6379/0"
    if name != "flower":
        assert settings.database_url.startswith("postgresql+psycopg://")
        assert "@postgres:5432/" in settings.database_url


@pytest.mark.parametrize("name", ["api", "worker", "worker-cpu"])
def test_storage_and_model_paths_are_mounted(services, name):
    service = services[name]
    env = service["environment"]
    assert mounts(service)[env["KILN_STORAGE_ROOT"]] == "storage"
    assert mounts(service)["/models"] == "models"
    if "KILN_MODEL_PATH" in env:
        assert mounted(env["KILN_MODEL_PATH"], service)


def test_the_api_reads_the_model_where_the_workers_register_it(services):
    """Admission loads the tokenizer from the runner's model_path on the api's own filesystem."""
    api = mounts(services["api"])
    for worker in ("worker", "worker-cpu"):
        path = PurePosixPath(services[worker]["environment"]["KILN_MODEL_PATH"])
        volume = [t for t, s in mounts(services[worker]).items() if PurePosixPath(t) in path.parents]
        assert volume == ["/models"], worker
        assert api["/models"] == mounts(services[worker])["/models"] == "models"


def test_healthchecks_probe_the_configured_port(services):
    settings = load_settings(ROOT / "deploy" / "kiln.toml", environ={}).settings
    test = services["api"]["healthcheck"]["test"]
    url = test[test.index("--url") + 1]
    assert url == f"http://127.0.0.1:{settings.server.port}/health"
    published = services["api"]["ports"][0]
    if isinstance(published, dict):
        target = published["target"]
    else:  # "127.0.0.1:8420:8420/tcp"
        target = str(published).rsplit(":", 1)[1].split("/")[0]
    assert int(target) == settings.server.port


def test_flower_mounts_the_config_it_is_given(services):
    flower = services["flower"]
    conf = next(a.split("=", 1)[1] for a in flower["command"] if a.startswith("--conf="))
    assert host_file(flower, conf) == ROOT / "deploy" / "flowerconfig.py"


def test_every_local_image_can_be_built_by_up(services):
    """`docker compose up` must not try to pull an image this project builds (`kiln-*:local`)."""
    for name, service in services.items():
        if service.get("image", "").endswith(":local"):
            assert "build" in service, name
            assert (ROOT / service["build"]["dockerfile"]).is_file()


@pytest.mark.parametrize("dockerfile", ["api.Dockerfile", "worker.Dockerfile"])
def test_images_give_kiln_a_home_and_writable_mount_points(dockerfile):
    text = (ROOT / "deploy" / dockerfile).read_text()
    run = " ".join(line.strip().rstrip("\\") for line in text.splitlines() if not line.startswith("#"))
    assert re.search(r"useradd [^&]*--create-home[^&]*--uid 10001 kiln", run), run
    # A system account above SYS_UID_MAX (999) makes useradd warn: uid 10001 is an ordinary user.
    assert not re.search(r"useradd [^&]*--system", run), run
    chown = re.search(r"chown kiln ([^&\n]+)", run)
    assert chown is not None
    owned = set(chown.group(1).split())
    assert {"/var/lib/kiln", "/models"} <= owned
    assert re.search(r"mkdir -p [^&]*/models", run)


def flower_options(environ: dict[str, str]) -> dict:
    conf: dict = {}
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        exec((ROOT / "deploy" / "flowerconfig.py").read_text(), conf)  # noqa: S102 (our own config file)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return conf


def test_flower_without_basic_auth_listens_on_loopback_only():
    assert flower_options({})["address"] == "127.0.0.1"
    authenticated = flower_options({"FLOWER_BASIC_AUTH": "admin:secret"})
    assert authenticated["address"] == "0.0.0.0"  # inside the container, published on 127.0.0.1
    assert authenticated["read_only"] is True


def test_a_password_of_the_documented_characters_survives_the_database_url(tmp_path):
    """.env.example: POSTGRES_PASSWORD of letters, digits, '-', '_' and '.' reaches every service's
    database URL intact (the URL is built by interpolation, without escaping)."""
    password = "Ab-9_x.Y"
    env_file = tmp_path / ".env"
    env_file.write_text(
        (ROOT / ".env.example")
        .read_text()
        .replace("POSTGRES_PASSWORD=change-me", f"POSTGRES_PASSWORD={password}")
    )
    rendered = render(COMPOSE, CPU_OVERRIDE, env_file=env_file)["services"]
    urls = [
        s["environment"]["KILN_DATABASE_URL"]
        for s in rendered.values()
        if "KILN_DATABASE_URL" in s.get("environment", {})
    ]
    assert len(urls) >= 3  # migrate, api, worker-cpu (the GPU worker is parked behind its profile)
    for url in urls:
        parsed = make_url(url)
        assert (parsed.username, parsed.password, parsed.host, parsed.database) == (
            "kiln",
            password,
            "postgres",
            "kiln",
        )
    assert rendered["postgres"]["environment"]["POSTGRES_PASSWORD"] == password


def test_dockerignore_keeps_the_context_small_and_every_copied_path():
    patterns = [
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".venv", ".git", ".kiln-demo", ".env"} <= set(patterns)
    for name in ("api.Dockerfile", "worker.Dockerfile"):
        for line in (ROOT / "deploy" / name).read_text().splitlines():
            if line.startswith("COPY "):
                for src in line.split()[1:-1]:
                    top = src.rstrip("/").split("/")[0]
                    assert top not in patterns and src not in patterns, (name, src)


@pytest.mark.parametrize("dockerfile", ["api.Dockerfile", "worker.Dockerfile"])
def test_images_install_kiln_under_the_tested_constraints(dockerfile):
    text = (ROOT / "deploy" / dockerfile).read_text()
    copied = [src for line in text.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]]
    assert "constraints.txt" in copied
    installs = [line for line in text.splitlines() if "pip install" in line]
    project = [line for line in installs if " . " in line or '".[' in line]  # the project itself
    assert project, installs
    assert all("pip install -c constraints.txt " in line for line in project), project
