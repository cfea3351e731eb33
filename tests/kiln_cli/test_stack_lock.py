"""One local stack per storage root (kiln_cli/stack_lock.py): `kiln demo` and `kiln up` refuse a
root whose stack is alive and name the running one's command, pid and address, before building
or binding anything; a dead holder blocks nothing; `kiln worker` still joins a running stack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, select

from kiln.store import Runner, make_engine
from kiln_cli.stack_lock import LOCK_FILE, StackRunning, stack_lock
from tests.kiln_cli.test_up_cmd import up
from tests.ui.conftest import clean_env, free_port, stop_up, wait_for_line
from tests.ui.page_support import wait_for_health

KILN = [sys.executable, "-m", "kiln_cli.main"]


def kiln(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KILN, *args], env=clean_env(**env), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", [["demo", "--preset", "tiny"], ["up", "--preset", "tiny"]])
def test_a_second_stack_on_a_root_is_refused_naming_the_running_one(tmp_path, command):
    root = tmp_path / "root"
    port = free_port()
    with stack_lock(root, "kiln up", "http://127.0.0.1:8420/"):
        refused = kiln(*command, "--root", str(root), *(["--port", str(port)] if command[0] == "up" else []))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert (
        f"a Kiln stack is already running on {root}: `kiln up` (pid {os.getpid()}) at http://127.0.0.1:8420/."
        in " ".join(refused.stderr.split())
    )
    assert "kiln worker" in refused.stderr and "--root DIR" in refused.stderr
    assert not (root / "models").exists() and not (root / "kiln.db").exists()  # nothing built first


def take(root, address: str) -> None:
    with stack_lock(root, "kiln up", address):
        pass


def test_the_lock_is_free_again_once_its_holder_is_gone(tmp_path):
    root = tmp_path / "root"
    with (
        stack_lock(root, "kiln demo", "http://127.0.0.1:1/"),
        pytest.raises(StackRunning, match=r"`kiln demo` \(pid \d+\) at http://127.0.0.1:1/"),
    ):
        take(root, "http://127.0.0.1:2/")
    assert (root / "run" / LOCK_FILE).read_text() == ""  # the holder's line goes with it
    # a holder killed outright: the kernel drops its lock
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from kiln_cli.stack_lock import stack_lock\n"
         f"with stack_lock(Path({str(root)!r}), 'kiln up', 'http://127.0.0.1:3/'):\n"
         "    print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StackRunning, match=rf"\(pid {holder.pid}\) at http://127.0.0.1:3/"):
            take(root, "http://127.0.0.1:4/")
    finally:
        holder.kill()
        holder.wait()
    with stack_lock(root, "kiln up", "http://127.0.0.1:4/"):
        assert "http://127.0.0.1:4/" in (root / "run" / LOCK_FILE).read_text()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_joins_a_running_stack(tmp_path):
    root = tmp_path / "root"
    port = free_port()
    log = tmp_path / "up.log"
    proc = up(root, port, log)
    worker = None
    try:
        wait_for_line(proc, log, "worker ready")
        worker_log = tmp_path / "worker.log"
        model = root / "models" / "kiln-tiny"
        with open(worker_log, "wb") as out:
            worker = subprocess.Popen(
                [*KILN, "worker"],
                env=clean_env(KILN_STORAGE_ROOT=str(root), KILN_MODEL_PATH=str(model), KILN_MODEL_DEVICE="cpu"),
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        engine = make_engine(f"sqlite:///{root}/kiln.db")
        try:
            deadline = time.monotonic() + 240
            runners = 0
            while time.monotonic() < deadline and runners < 2:
                assert worker.poll() is None, worker_log.read_text()[-3000:]
                with engine.connect() as connection:
                    runners = connection.execute(select(func.count()).select_from(Runner)).scalar_one()
                time.sleep(0.5)
        finally:
            engine.dispose()
        assert runners == 2, worker_log.read_text()[-3000:]
        assert "already running" not in worker_log.read_text()
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGINT)
            worker.wait(timeout=120)
        stop_up(proc)


def test_kiln_serve_takes_the_root_as_a_flag(tmp_path):
    root = tmp_path / "served"
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*KILN, "serve", "--root", str(root), "--port", str(port), "--workers", "1", "--upgrade-db"],
            env=clean_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for_health(proc, f"http://127.0.0.1:{port}", log)
        assert (root / "kiln.db").is_file() and (root / "adapters").is_dir()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
