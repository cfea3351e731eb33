"""The registry images the compose stack starts from, made here from Debian's packages (no image
registry is reachable): a Debian bookworm base made with debootstrap and imported into the
engine, then stand-ins for python:3.11-slim-bookworm, redis:7-bookworm and PostgreSQL built on
it from tests/deploy/images/ (docs/deployment.md#the-compose-end-to-end-test).

Cached in the engine's storage, keyed by their inputs: the base image carries a label with the
digest of the Debian release, the mirror, the package list, the host's CA certificates and the
recipe; the stand-ins are podman builds whose layer cache is keyed by their Containerfiles, the
files they copy and the base image.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.podman_engine import PodmanEngine

IMAGES = Path(__file__).resolve().parent / "images"
RELEASE = "bookworm"
BASE_PACKAGES = ("ca-certificates",)
BASE_IMAGE = f"localhost/kiln-e2e/debian:{RELEASE}"
KEY_LABEL = "org.kiln.e2e.inputs"
# Bump when the recipe below changes in a way its other inputs do not show.
RECIPE = "minbase-ca-v1"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
HOST_CAS = Path("/usr/local/share/ca-certificates")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class StandIn:
    tag: str
    containerfile: str


# The python and redis stand-ins take the official names (majors match: Python 3.11, Redis 7.0)
# so the Dockerfiles and the compose file use them unchanged. Bookworm has PostgreSQL 15, not the
# compose file's 16, so it gets a name of its own, given to compose as KILN_POSTGRES_IMAGE.
PYTHON = StandIn("docker.io/library/python:3.11-slim-bookworm", "python.Containerfile")
REDIS = StandIn("docker.io/library/redis:7-bookworm", "redis.Containerfile")
POSTGRES = StandIn("localhost/kiln-e2e/postgres:15", "postgres.Containerfile")
STAND_INS = (PYTHON, REDIS, POSTGRES)


def debian_mirror() -> str:
    """The mirror this machine's apt uses for Debian (KILN_E2E_DEBIAN_MIRROR overrides it)."""
    if os.environ.get("KILN_E2E_DEBIAN_MIRROR"):
        return os.environ["KILN_E2E_DEBIAN_MIRROR"].rstrip("/")
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        text = path.read_text(errors="replace") if path.is_file() else ""
        # deb822 stanzas (URIs: + Suites:) and one-line entries (deb URI suite components).
        for stanza in re.split(r"\n\s*\n", text):
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            suites = re.search(r"^Suites:\s*(.+)$", stanza, re.M)
            if uris and suites and RELEASE in suites.group(1).split() and "security" not in uris.group(1):
                return uris.group(1).rstrip("/")
        for match in re.finditer(rf"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+{RELEASE}\s", text, re.M):
            return match.group(1).rstrip("/")
    return DEFAULT_MIRROR


def host_ca_files() -> list[Path]:
    """Local CA certificates of this machine (a proxy's CA, say): pip in the images needs them."""
    return sorted(HOST_CAS.rglob("*.crt")) if HOST_CAS.is_dir() else []


def base_key(mirror: str) -> str:
    digest = hashlib.sha256()
    for part in (RECIPE, RELEASE, mirror, " ".join(BASE_PACKAGES)):
        digest.update(part.encode() + b"\0")
    for ca in host_ca_files():
        digest.update(ca.name.encode() + b"\0" + ca.read_bytes())
    return digest.hexdigest()


def base_is_current(engine: PodmanEngine, key: str) -> bool:
    done = engine.podman(
        "image", "inspect", "--format", f'{{{{index .Labels "{KEY_LABEL}"}}}}', BASE_IMAGE, check=False
    )
    return done.returncode == 0 and done.stdout.decode().strip() == key


def ensure_debian_base(engine: PodmanEngine, workdir: Path, timeout_s: float = 900) -> bool:
    """Make BASE_IMAGE unless the one in storage has the same inputs; True when it was made."""
    mirror = debian_mirror()
    key = base_key(mirror)
    if base_is_current(engine, key):
        return False
    rootfs = workdir / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    include = ",".join(BASE_PACKAGES)
    run(["debootstrap", "--variant=minbase", f"--include={include}", RELEASE, str(rootfs), mirror], timeout_s)
    for ca in host_ca_files():
        shutil.copy2(ca, rootfs / "usr/local/share/ca-certificates" / ca.name)
    run(["chroot", str(rootfs), "update-ca-certificates"], 120)
    # The package lists and downloaded packages are debootstrap's: the image needs neither.
    for leftover in ("var/lib/apt/lists", "var/cache/apt/archives"):
        for path in (rootfs / leftover).glob("*"):
            if path.is_file():
                path.unlink()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    try:
        engine.podman(
            "import",
            "--change",
            f"ENV PATH={PATH}",
            "--change",
            "ENV LANG=C.UTF-8",
            "--change",
            f"LABEL {KEY_LABEL}={key}",
            "-",
            BASE_IMAGE,
            stdin=tar.stdout,
            timeout=600,
        )
    finally:
        tar.stdout.close()
        tar.wait(timeout=600)
    shutil.rmtree(rootfs, ignore_errors=True)
    return True


def build_stand_ins(engine: PodmanEngine, timeout_s: float = 900) -> None:
    for image in STAND_INS:
        engine.podman(
            "build",
            "--layers",
            "--pull=never",
            "--file",
            str(IMAGES / image.containerfile),
            "--tag",
            image.tag,
            str(IMAGES),
            timeout=timeout_s,
        )


def run(command: list[str], timeout_s: float) -> None:
    done = subprocess.run(command, capture_output=True, timeout=timeout_s)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).decode(errors="replace")[-4000:]
        raise RuntimeError(f"{' '.join(command)}: exit {done.returncode}\n{output}")
