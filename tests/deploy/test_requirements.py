"""deploy/requirements.py: the requirement lines the api image installs before Kiln's code, the
same that pyproject.toml declares, run as the image runs it (bare Python, in the directory
holding pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "requirements.py"


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-I", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_without_extras_it_prints_the_dependencies_of_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    done = run()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == project["dependencies"]
    assert not any(line.startswith("torch") for line in done.stdout.splitlines())  # the api image


def test_extras_add_their_requirements_once(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = ["a>=1", "b"]\n'
        '[project.optional-dependencies]\ntrain = ["c==2", "b"]\ngpu = ["d"]\n'
    )
    done = run("train, gpu", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["a>=1", "b", "c==2", "d"]


def test_an_unknown_extra_is_refused_with_the_ones_declared(tmp_path):
    done = run("train,nope")
    assert done.returncode == 1
    assert "unknown extra nope: pyproject.toml declares train, gpu, dev" in done.stderr
    assert done.stdout == ""
