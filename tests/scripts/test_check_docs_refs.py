"""scripts/check_docs_refs.py: the docs of this repository point at code that exists, and the
checker does catch a reference that does not."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_docs_refs.py"


def run_checker(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "check_docs_refs.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_docs_reference_and_anchor_of_the_repository_resolves():
    proc = run_checker(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""  # one line per problem
    assert proc.stderr.strip().endswith("docs anchors checked; 0 problems"), proc.stderr


def test_a_missing_function_a_missing_file_and_a_missing_anchor_are_each_reported(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "check_docs_refs.py")
    (tmp_path / "kiln").mkdir()
    (tmp_path / "kiln" / "thing.py").write_text("def present():\n    return 1\n", encoding="utf-8")
    (tmp_path / "README.md").write_text("# A project\n", encoding="utf-8")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Real section\n\n"
        "`kiln/thing.py: present` is fine; `kiln/thing.py: absent` is not.\n"
        "`kiln/gone.py` does not exist. See [the section](page.md#no-such-section).\n",
        encoding="utf-8",
    )
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    proc = run_checker(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().endswith("3 problems"), proc.stderr
    problems = proc.stdout.strip().splitlines()
    assert len(problems) == 3, problems
    assert any("kiln/thing.py" in p and "absent" in p for p in problems), problems
    assert any("kiln/gone.py" in p for p in problems), problems
    assert any("no-such-section" in p for p in problems), problems
    assert not any("present" in p for p in problems), problems
