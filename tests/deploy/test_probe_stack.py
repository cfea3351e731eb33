"""The compose stack read against the code: every KILN_* variable a service gets is a setting that
loads (with the kiln.toml it mounts), every path a service is told about lies on something mounted
into it, the api sees the model directory at the path the worker registers, the images give the
non-root `kiln` user a home and writable mount points, every `*:local` image can be built by
`up`, and Flower run by hand without basic auth stays on loopback.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml
from sqlalchemy.engine import make_url

from kiln.settings import load_settings
from tests.deploy.test_compose import COMPOSE, CPU_OVERRIDE, ROOT, render

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
    done = subprocess.run(
        [
            shutil.which("docker-compose"),
            "--env-file",
            str(env_file),
            "-f",
            str(COMPOSE),
            "-f",
            str(CPU_OVERRIDE),
            "config",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    rendered = yaml.safe_load(done.stdout)["services"]
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
