"""Startup bounds and build inputs of the compose stack, read from the rendered files (no engine):
migrate waits for the database within a bound, Flower has a health check on its open page, the
Postgres image and the CPU worker's torch come from `.env`, and the worker image takes wheels
from deploy/wheels/ without copying them (docs/deployment.md)."""

from __future__ import annotations

import re

from tests.deploy.test_compose import COMPOSE, CPU_OVERRIDE, ROOT, flower_options, render


def test_flower_health_check_asks_the_open_healthcheck_page_on_its_port():
    services = render(COMPOSE)["services"]
    conf = flower_options({"FLOWER_BASIC_AUTH": "admin:secret"})
    test = services["flower"]["healthcheck"]["test"]
    assert test[:4] == ["CMD", "kiln", "health", "api"]
    assert test[test.index("--url") + 1] == f"http://127.0.0.1:{conf['port']}/healthcheck"


def test_migrate_waits_for_the_database_within_a_bound():
    services = render(COMPOSE)["services"]
    command = services["migrate"]["command"]
    assert command[:3] == ["kiln", "db", "upgrade"]
    waits = [a for a in command if a.startswith("--wait=")]
    assert len(waits) == 1 and 30 <= float(waits[0].split("=", 1)[1]) <= 600
    assert services["migrate"]["restart"] == "no"


def test_the_postgres_image_defaults_to_16_and_can_be_chosen(tmp_path):
    assert render(COMPOSE)["services"]["postgres"]["image"] == "postgres:16-bookworm"
    env_file = tmp_path / ".env"
    env_file.write_text((ROOT / ".env.example").read_text() + "KILN_POSTGRES_IMAGE=postgres:17-bookworm\n")
    chosen = render(COMPOSE, env_file=env_file)["services"]["postgres"]["image"]
    assert chosen == "postgres:17-bookworm"


def test_the_worker_image_takes_wheels_from_deploy_wheels():
    """The offline input: deploy/wheels/ mounted into the torch install, never copied."""
    text = (ROOT / "deploy" / "worker.Dockerfile").read_text()
    run = " ".join(line.strip().rstrip("\\") for line in text.splitlines() if not line.startswith("#"))
    assert re.search(
        r"RUN --mount=type=bind,source=deploy/wheels,target=(\S+) +pip install --find-links \1 \$\{KILN_TORCH_SPEC\}",
        run,
    ), run
    assert "COPY deploy/wheels" not in text
    assert (ROOT / "deploy" / "wheels").is_dir()
    patterns = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if not line.startswith("#")
    ]
    # The wheels stay in the build context.
    assert not any(p.startswith("deploy") or p.endswith(".whl") or p in ("*", "**") for p in patterns)


def test_the_cpu_override_takes_its_torch_spec_from_the_environment(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text((ROOT / ".env.example").read_text() + "KILN_TORCH_SPEC=torch==2.13.0+cpu\n")
    args = render(COMPOSE, CPU_OVERRIDE, env_file=env_file)["services"]["worker-cpu"]["build"]["args"]
    assert args["KILN_TORCH_SPEC"] == "torch==2.13.0+cpu"
    default = render(COMPOSE, CPU_OVERRIDE)["services"]["worker-cpu"]["build"]["args"]["KILN_TORCH_SPEC"]
    assert default.startswith("torch==2.13.0 ") and "download.pytorch.org/whl/cpu" in default
