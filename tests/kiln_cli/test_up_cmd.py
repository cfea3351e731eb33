"""`kiln up` as people run it: a real process starting real `kiln serve` and `kiln worker`.

A fresh root is initialised (job database at the newest revision, a random model built once),
the UI address is printed and answers, Ctrl-C stops both children and exits 130, a second start
reuses what the first made, a child that dies takes the other down with it (exit 1), and a
database at an older revision is refused with the `kiln db upgrade` it needs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kiln.store import current_revision, downgrade_database, head_revision, make_engine, upgrade_database
from tests.kiln_cli.processes import demo_processes
from tests.ui.conftest import clean_env, free_port, stop_up, wait_for_line

KILN = [sys.executable, "-m", "kiln_cli.main"]


def up(root: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*KILN, "up", "--root", str(root), "--port", str(port), "--preset", "tiny", *extra],
            env=clean_env(KILN_SERVER_WORKERS="1"),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def children_of(root: Path):
    """Live `kiln serve` / `kiln worker` processes of this root (`kiln up` itself gets the root as
    a flag, its children in their environment)."""
    return demo_processes(root)


def wait_gone(root: Path, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while children_of(root) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert children_of(root) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fresh_root_comes_up_stops_on_ctrl_c_and_starts_again(tmp_path):
    root = tmp_path / "root"
    port = free_port()
    log = tmp_path / "up.log"
    proc = up(root, port, log)
    try:
        wait_for_line(proc, log, "worker ready")
        text = log.read_text()
        assert f"initialising the job database sqlite:///{root}/kiln.db" in text
        assert (
            "building a random Qwen3.5 checkpoint, preset tiny (hidden 64, 4 layers, full vocabulary), "
            f"in {root}/models/kiln-tiny (once per root)"
        ) in text
        assert f"Kiln UI: http://127.0.0.1:{port}/" in text
        engine = make_engine(f"sqlite:///{root}/kiln.db")
        try:
            assert current_revision(engine) == head_revision()
        finally:
            engine.dispose()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:
            assert page.status == 200 and page.headers.get_content_type() == "text/html"
            assert b'id="sft-form"' in page.read()
        assert {p.cmdline()[3] for p in children_of(root)} >= {"serve", "worker"}
    finally:
        code = stop_up(proc)
    assert code == 128 + signal.SIGINT, log.read_text()[-3000:]
    assert "stopping kiln worker and kiln serve" in log.read_text()
    wait_gone(root, 5)

    # Again in the same root: nothing to initialise or build; a worker that dies stops the api.
    second = tmp_path / "second.log"
    proc = up(root, port, second)
    try:
        wait_for_line(proc, second, "worker ready")
        assert "initialising" not in second.read_text() and "building" not in second.read_text()
        (worker,) = [p for p in children_of(root) if p.cmdline()[3] == "worker"]
        os.killpg(worker.pid, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        stop_up(proc)
    assert proc.returncode == 1
    assert re.search(r"kiln up: `kiln worker` exited with -9", second.read_text())
    wait_gone(root)


def test_an_older_database_is_refused_with_the_upgrade_it_needs(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    url = f"sqlite:///{root}/kiln.db"
    upgrade_database(url)
    downgrade_database(url, "0001")
    log = tmp_path / "up.log"
    proc = up(root, free_port(), log, "--model-path", str(tmp_path / "no-model"))
    assert proc.wait(timeout=120) == 2
    text = log.read_text()
    assert "but this release needs" in text and "run `kiln db upgrade` first" in text
    assert not (root / "logs" / "serve.log").exists()  # nothing was started
    engine = make_engine(url)
    try:
        assert current_revision(engine) == "0001"  # and nothing was migrated behind the operator's back
    finally:
        engine.dispose()
