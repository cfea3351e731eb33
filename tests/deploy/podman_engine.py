"""A Docker-API engine for the compose end-to-end test: Debian's podman, rootful, serving the
Docker API on a socket of its own (`podman system service`), with storage of its own that is kept
between runs as the image cache (docs/deployment.md#the-compose-end-to-end-test).

Two settings make Debian's podman 4.3 work here: lower default ulimits (the engine's default
`nofile` is above what this kernel allows a container) and the cgroupfs manager (no systemd). No
systemd also means no timers for health checks: `HealthChecks` runs them, at each container's own
interval, so `depends_on: condition: service_healthy` and `(healthy)` mean what they mean under
Docker.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Debian packages the engine needs (scripts/test installs them as root when they are missing).
ENGINE_PACKAGES = ("podman", "debootstrap", "iptables", "docker-compose")
REQUIRED_TOOLS = {
    "podman": "podman",
    "debootstrap": "debootstrap",
    "iptables-save": "iptables",
    "docker-compose": "docker-compose",
}
CONTAINERS_CONF = """\
[containers]
# The engine's default (the hard limit of the service's own process) is refused by this kernel.
default_ulimits = ["nofile=20000:20000", "nproc=20000:20000"]

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "{run}/tmp"
# Exec sessions (health checks, `compose exec`) keep a conmon this long after they end.
exit_command_delay = 5

[network]
network_config_dir = "{cache}/networks"
"""
STORAGE_CONF = """\
[storage]
driver = "overlay"
graphroot = "{storage}"
runroot = "{run}/storage"
"""


class EngineError(RuntimeError):
    """The engine could not be set up or did not answer."""


class PodmanEngine:
    """`podman system service` on `<run>/podman.sock` with storage under `<cache>/storage`."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.storage = cache / "storage"
        # Fixed per cache: podman refuses a storage whose recorded run directory has moved.
        self.run = Path("/run") / f"kiln-compose-e2e-{hashlib.sha256(str(cache).encode()).hexdigest()[:10]}"
        self.socket = self.run / "podman.sock"
        self.service_log = cache / "podman-service.log"
        self.service: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        """The environment of every podman command (and of docker-compose, which adds DOCKER_HOST)."""
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TERM", "TMPDIR")}
        return {
            **keep,
            "CONTAINERS_CONF": str(self.cache / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(self.cache / "storage.conf"),
        }

    def start(self, timeout_s: float = 60) -> None:
        self.cache.mkdir(parents=True, exist_ok=True)
        self.run.mkdir(parents=True, exist_ok=True)
        (self.cache / "networks").mkdir(exist_ok=True)
        (self.cache / "containers.conf").write_text(CONTAINERS_CONF.format(run=self.run, cache=self.cache))
        (self.cache / "storage.conf").write_text(STORAGE_CONF.format(storage=self.storage, run=self.run))
        self.socket.unlink(missing_ok=True)
        log = open(self.service_log, "wb")  # noqa: SIM115 (closed when the service ends)
        self.service = subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while self.api("GET", "/_ping") != (200, b"OK"):
            if self.service.poll() is not None or time.monotonic() > deadline:
                raise EngineError(
                    f"podman system service did not answer: {self.service_log.read_text()[-2000:]}"
                )
            time.sleep(0.3)
        self.remove_everything()

    def api(self, method: str, path: str) -> tuple[int, bytes]:
        """One Docker API request over the socket: (status, body), (0, b"") when nothing answers."""
        connection = UnixHTTPConnection(str(self.socket))
        try:
            connection.request(method, path)
            response = connection.getresponse()
            return response.status, response.read()
        except OSError:
            return 0, b""
        finally:
            connection.close()

    def podman(
        self, *args: str, timeout: float = 120, check: bool = True, stdin=None, input: bytes | None = None
    ) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["podman", *args], env=self.env(), capture_output=True, timeout=timeout, stdin=stdin, input=input
        )
        if check and done.returncode != 0:
            raise EngineError(
                f"podman {' '.join(args)}: exit {done.returncode}: {done.stderr.decode()[-3000:]}"
            )
        return done

    def remove_everything(self) -> None:
        """No pod, container, volume or network left in this engine's own storage (a run that was
        killed leaves some; the images stay: they are the cache)."""
        self.podman("pod", "rm", "--all", "--force", timeout=120)
        self.podman("rm", "--all", "--force", "--time", "0", timeout=300)
        self.podman("volume", "prune", "--force", timeout=120)
        self.podman("network", "prune", "--force", timeout=120)

    def inventory(self) -> dict[str, list[str]]:
        """Pods, containers, volumes and networks (but podman's default one) in the storage."""
        lines = {
            "pods": self.podman("pod", "ps", "--quiet").stdout,
            "containers": self.podman("ps", "--all", "--quiet").stdout,
            "volumes": self.podman("volume", "ls", "--quiet").stdout,
            "networks": self.podman("network", "ls", "--format", "{{.Name}}").stdout,
        }
        out = {kind: text.decode().split() for kind, text in lines.items()}
        out["networks"] = [n for n in out["networks"] if n != "podman"]
        return out

    def stop(self, timeout_s: float = 30) -> None:
        if self.service is None:
            return
        self.service.terminate()
        try:
            self.service.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.service.kill()
            self.service.wait(timeout=timeout_s)
        self.service = None
        self.socket.unlink(missing_ok=True)
        shutil.rmtree(self.run, ignore_errors=True)

    def image_sizes(self, names: list[str]) -> dict[str, int]:
        """Bytes of each image (its tag as given) that exists."""
        out = {}
        for name in names:
            done = self.podman("image", "inspect", "--format", "{{.Size}}", name, check=False)
            if done.returncode == 0:
                out[name] = int(done.stdout.decode().strip())
        return out


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


# Docker's `start_interval`: while a container's start period lasts and no check has passed yet,
# check this often, so a service is seen healthy seconds after it is, not an interval later.
START_INTERVAL_S = 2.0


@dataclass
class Schedule:
    """When one container's health check runs next (Docker's rules, seconds on the monotonic clock)."""

    interval_s: float
    start_period_s: float
    seen_at: float
    due_at: float = 0.0
    passed: bool = False

    def after_check(self, now: float, passed: bool) -> None:
        self.passed = self.passed or passed
        starting = not self.passed and now < self.seen_at + self.start_period_s
        self.due_at = now + (min(START_INTERVAL_S, self.interval_s) if starting else self.interval_s)


class HealthChecks(threading.Thread):
    """Run the health checks of one compose project's containers on Docker's schedule."""

    def __init__(self, engine: PodmanEngine, project: str, poll_s: float = 1.0) -> None:
        super().__init__(name=f"health-{project}", daemon=True)
        self.engine = engine
        self.project = project
        self.poll_s = poll_s
        self.halt = threading.Event()
        self.schedules: dict[str, Schedule | None] = {}
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.halt.wait(self.poll_s):
            try:
                self.check_due()
            except (subprocess.SubprocessError, EngineError, ValueError) as exc:
                self.failures.append(str(exc))

    def check_due(self) -> None:
        listed = self.engine.podman(
            "ps", "--filter", f"label=com.docker.compose.project={self.project}", "--format", "{{.ID}}", timeout=30
        )  # fmt: skip
        for cid in listed.stdout.decode().split():
            schedule = self.schedule_of(cid)
            now = time.monotonic()
            if schedule is not None and now >= schedule.due_at:
                done = self.engine.podman("healthcheck", "run", cid, timeout=60, check=False)
                schedule.after_check(time.monotonic(), done.returncode == 0)

    def schedule_of(self, cid: str) -> Schedule | None:
        """None for a container without a health check."""
        if cid not in self.schedules:
            done = self.engine.podman("inspect", "--format", "{{json .Config.Healthcheck}}", cid, check=False)
            check = json.loads(done.stdout or b"null") if done.returncode == 0 else None
            if not check or not check.get("Test") or check["Test"][0] == "NONE":
                self.schedules[cid] = None
            else:
                # Docker's defaults: interval 30 s, no start period (durations are nanoseconds).
                interval = (check.get("Interval") or 30e9) / 1e9
                start_period = (check.get("StartPeriod") or 0) / 1e9
                self.schedules[cid] = Schedule(interval, start_period, seen_at=time.monotonic())
        return self.schedules[cid]

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=120)
