"""One compose project of the end-to-end test: the repository's docker-compose.yml plus
deploy/compose.cpu.yml, run by docker-compose against the podman engine's Docker API, from a
build context that is a copy of the working tree (what git would commit, plus the torch CPU wheel
in deploy/wheels/), so the checkout itself is never written to.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.deploy.podman_engine import PodmanEngine

ROOT = Path(__file__).resolve().parents[2]
FILES = ("docker-compose.yml", "deploy/compose.cpu.yml")
TORCH_CPU = "torch==2.13.0+cpu"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def copy_working_tree(dest: Path) -> None:
    """The files git tracks or would track (not ignored), with their times (the build cache
    compares contents), into `dest`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    )
    shutil.rmtree(dest, ignore_errors=True)
    for name in listed.stdout.decode().split("\0"):
        source = ROOT / name
        if name and source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def fetch_cpu_torch_wheel(wheels: Path, timeout_s: float = 900) -> Path:
    """torch 2.13.0's CPU wheel, as this machine's pip resolves it (a local file where pip's
    find-links offers one, else the PyTorch CPU index), kept in `wheels` between runs."""
    found = sorted(wheels.glob("torch-2.13.0+cpu-*.whl"))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(wheels), TORCH_CPU]
    errors = []
    for extra in ([], ["--index-url", PYTORCH_CPU_INDEX]):
        done = subprocess.run([*pip, *extra], capture_output=True, text=True, timeout=timeout_s)
        if done.returncode == 0:
            return sorted(wheels.glob("torch-2.13.0+cpu-*.whl"))[0]
        errors.append(done.stdout[-1500:] + done.stderr[-1500:])
    raise RuntimeError(f"pip download {TORCH_CPU} failed:\n" + "\n".join(errors))


def link_or_copy(source: Path, target: Path) -> None:
    target.unlink(missing_ok=True)
    try:
        target.hardlink_to(source)
    except OSError:
        shutil.copy2(source, target)


class ComposeProject:
    """docker-compose for one project name, env file and context."""

    def __init__(self, engine: PodmanEngine, context: Path, name: str, settings: dict[str, str]) -> None:
        self.engine = engine
        self.context = context
        self.name = name
        self.env_file = context / ".env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        self.settings = settings

    def command(self, *args: str) -> list[str]:
        files = [arg for f in FILES for arg in ("-f", str(self.context / f))]
        return [
            "docker-compose",
            "--project-name",
            self.name,
            "--env-file",
            str(self.env_file),
            *files,
            *args,
        ]

    def env(self) -> dict[str, str]:
        # docker-compose 1.29 builds through the engine's API (no BuildKit client, no docker CLI).
        return {
            **self.engine.env(),
            "DOCKER_HOST": f"unix://{self.engine.socket}",
            "COMPOSE_DOCKER_CLI_BUILD": "0",
            "DOCKER_BUILDKIT": "0",
        }

    def run(self, *args: str, timeout: float, check: bool = True, input: str | None = None):
        done = subprocess.run(
            self.command(*args),
            cwd=self.context,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"docker-compose {' '.join(args)}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            self.command(*args),
            cwd=self.context,
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def containers(self) -> list[dict]:
        """`podman inspect` of every container of the project (running or not)."""
        listed = self.engine.podman(
            "ps", "--all", "--filter", f"label=com.docker.compose.project={self.name}", "--format", "{{.ID}}"
        )
        ids = listed.stdout.decode().split()
        return json.loads(self.engine.podman("inspect", *ids).stdout) if ids else []

    def container(self, service: str) -> dict:
        for info in self.containers():
            if info["Config"]["Labels"].get("com.docker.compose.service") == service:
                return info
        raise AssertionError(f"no container for service {service} in project {self.name}")

    def health(self, service: str) -> str:
        """'healthy', 'starting', 'unhealthy', or the container's state when it has no check."""
        state = self.container(service)["State"]
        health = state.get("Health") or state.get("Healthcheck") or {}
        return health.get("Status") or state["Status"]

    def wait_healthy(self, services: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            status = {name: self.health(name) for name in services}
            if all(value == "healthy" for value in status.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy after {timeout_s:.0f} s: {status}")
            time.sleep(2)

    def logs(self, tail: int = 150) -> str:
        done = self.run("logs", "--no-color", f"--tail={tail}", timeout=120, check=False)
        return done.stdout + done.stderr


class Timings:
    """Seconds per stage of one run, in order."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.stages[name] = round(time.monotonic() - started, 1)
