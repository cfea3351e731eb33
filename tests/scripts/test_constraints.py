"""constraints.txt is the environment the suite runs in, and the TRL runner's lock agrees with it.

scripts/bootstrap installs under constraints.txt, so a release on PyPI cannot change what CI
tests; scripts/lock-environment rewrites the file from .venv after a deliberate upgrade.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from packaging.utils import canonicalize_name

from kiln_train.interop.bundle import parse_lock, runner_bytes
from kiln_train.interop.pins import public_version

ROOT = Path(__file__).resolve().parents[2]


def pins(text: str) -> dict[str, str]:
    """`name==version` lines -> canonical name: public version (pip freeze keeps local labels)."""
    return {canonicalize_name(name): public_version(version) for name, version in parse_lock(text).items()}


def constraints() -> dict[str, str]:
    return pins((ROOT / "constraints.txt").read_text(encoding="utf-8"))


def test_the_environment_is_installed_at_the_constrained_versions():
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable", "--exclude", "pip"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    installed = pins(frozen)
    assert installed == constraints(), "regenerate after a deliberate upgrade: scripts/lock-environment"


def test_the_runner_lock_agrees_with_the_constraints():
    lock = parse_lock(runner_bytes("requirements.lock").decode("utf-8"))
    pinned = constraints()
    differ = {
        name: (version, pinned.get(name)) for name, version in lock.items() if pinned.get(name) != version
    }
    assert differ == {}


def test_bootstrap_installs_everything_under_the_constraints():
    script = (ROOT / "scripts" / "bootstrap").read_text(encoding="utf-8")
    # `pip_counted WHAT TOTAL ARGS...` runs `pip install ARGS` with a progress count; every install
    # but pip's own upgrade must carry the constraints.
    installs = [
        line.split()[3:]
        for line in script.splitlines()
        if line.startswith("pip_counted ") and "pip" not in line.split()[3:]
    ]
    assert len(installs) == 2 and all(args[:2] == ["-c", "constraints.txt"] for args in installs), installs
