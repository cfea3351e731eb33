"""`scripts/bootstrap` says what it does: an up-to-date `.venv` is reused with one line saying so;
a stale stamp starts the numbered stages, the first of them named before any install begins."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def project(tmp_path: Path) -> Path:
    """A copy of what bootstrap reads, with a real (empty) virtual environment."""
    (tmp_path / "scripts").mkdir()
    shutil.copy2(REPO / "scripts" / "bootstrap", tmp_path / "scripts" / "bootstrap")
    for name in ("pyproject.toml", "constraints.txt"):
        shutil.copy2(REPO / name, tmp_path / name)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / ".venv")], check=True)
    return tmp_path


def test_an_up_to_date_venv_is_reused_with_one_line(tmp_path):
    root = project(tmp_path)
    digest = hashlib.sha256((root / "pyproject.toml").read_bytes() + (root / "constraints.txt").read_bytes())
    (root / ".venv" / ".kiln-bootstrap").write_text(digest.hexdigest() + "\n")
    done = subprocess.run([root / "scripts" / "bootstrap"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "kiln setup: reusing .venv (up to date with pyproject.toml and constraints.txt)\n"
    assert done.stderr == ""


def test_a_stale_venv_is_refreshed_stage_by_stage(tmp_path):
    root = project(tmp_path)
    (root / ".venv" / ".kiln-bootstrap").write_text("an older environment\n")
    # the venv has no pip, so the first install stage fails: what matters is what was said first
    done = subprocess.run([root / "scripts" / "bootstrap"], capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert (
        lines[0]
        == "kiln setup: 1/4 .venv exists; refreshing what changed in pyproject.toml or constraints.txt"
    )
    assert lines[1] == "kiln setup: 2/4 upgrading pip"
    assert done.returncode != 0
    assert "kiln setup: installing pip failed (pip exited with 1); the lines above say why" in done.stdout
    assert "No module named pip" in done.stderr
