"""`kiln demo` (what `scripts/demo` runs) used the way people use it: run twice in the same root,
interrupted with Ctrl-C mid-training, killed outright, started over a half-built model.

Each run is a real `kiln demo` process on the tiny preset (one epoch over examples/demo.jsonl):
it starts `kiln serve` and `kiln worker`, submits over HTTP and must end with the receipt summary
and the adapter path. After every run, interrupted or not, no process it started may be left, and
the next run in the same root must finish with a new adapter and run no earlier job.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.kiln_cli.processes import demo_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUN_TIMEOUT_S = 300  # the README's bound for the full demo on this machine
FINISHED = re.compile(r"^demo finished: adapter in (?P<path>\S+)$", re.M)


def demo_command(root: Path, epochs: int = 1) -> list[str]:
    args = ["demo", "--root", str(root), "--preset", "tiny", "--epochs", str(epochs)]
    return [sys.executable, "-m", "kiln_cli.main", *args]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}


def run_demo(root: Path) -> tuple[str, float]:
    t0 = time.monotonic()
    done = subprocess.run(
        demo_command(root), env=clean_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    elapsed = time.monotonic() - t0
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output, elapsed


# Runs that get interrupted train 30 epochs (900 steps), so the job is surely still running when
# the signal lands: the client logs its progress only every few seconds when not on a terminal, and
# a fast machine trains the tiny model at ~60 ms a step (90 steps once finished before the kill).
INTERRUPTED_EPOCHS = 30
INTERRUPTED_STEPS = 30 * INTERRUPTED_EPOCHS


def start_demo(root: Path, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            demo_command(root, INTERRUPTED_EPOCHS),
            env=clean_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for_training(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        if re.search(rf"step [1-9]\d*/{INTERRUPTED_STEPS}\b", log.read_text(errors="replace")):
            return
        assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
        time.sleep(0.3)
    raise AssertionError(f"no training step within {RUN_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")


def assert_nothing_left(root: Path, within_s: float = 0.0) -> None:
    deadline = time.monotonic() + within_s
    while True:
        left = demo_processes(root)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    assert not left, [p.cmdline() for p in left]


def jobs(root: Path) -> list[tuple[str, str, str | None, str]]:
    with sqlite3.connect(root / "kiln.db") as db:
        return db.execute(
            "SELECT adapter_name, state, failure_reason, id FROM training_jobs ORDER BY queue_seq"
        ).fetchall()


def assert_finished_with_receipt(output: str, root: Path) -> str:
    match = FINISHED.search(output)
    assert match, output[-4000:]
    adapter = Path(match["path"])
    assert adapter.parent == root / "adapters"
    assert (adapter / "adapter_model.safetensors").is_file()
    assert (adapter / "train_receipt.json").is_file()
    for line in (
        "receipt:",
        "status             success",
        "steps              30/30",
        f"adapter path  {adapter}",
        f"trained on {root}/models/kiln-tiny: a random tiny checkpoint, so the run shows the mechanics",
    ):
        assert line in output, (line, output[-3000:])
    return adapter.name


def test_twice_in_a_row_and_over_a_half_built_model(tmp_path):
    root = tmp_path / "demo-root"
    half_built = root / "models" / "kiln-tiny"
    half_built.mkdir(parents=True)
    (half_built / "config.json").write_text("{}")  # what an interrupted build can leave

    first, first_s = run_demo(root)
    assert f"{half_built} is incomplete (an interrupted build); rebuilding it" in first
    assert f"initialising the job database {root}/kiln.db" in first
    assert "alembic.runtime.migration" not in first  # no line per migration
    first_name = assert_finished_with_receipt(first, root)
    assert_nothing_left(root)

    second, second_s = run_demo(root)
    assert "building a random" not in second  # the finished model is reused, and says so
    assert f"reusing the random checkpoint in {root}/models/kiln-tiny (built on the first run)" in second
    second_name = assert_finished_with_receipt(second, root)
    assert second_name != first_name
    assert_nothing_left(root)
    assert [(a, s) for a, s, _, _ in jobs(root)] == [(first_name, "completed"), (second_name, "completed")]
    assert first_s < RUN_TIMEOUT_S and second_s < RUN_TIMEOUT_S
    assert not list((root / "run").glob("prometheus-*"))  # each api removed its metrics directory


def test_ctrl_c_cancels_the_job_stops_everything_and_the_next_run_is_clean(tmp_path):
    root = tmp_path / "demo-root"
    log = tmp_path / "interrupted.log"
    proc = start_demo(root, log)
    wait_for_training(proc, log)
    # A second demo in the same root (another terminal) is refused and leaves the first alone.
    second = subprocess.run(demo_command(root), env=clean_env(), capture_output=True, text=True, timeout=60)
    assert second.returncode == 1, second.stdout + second.stderr
    said = " ".join(second.stderr.split())
    assert (
        f"a Kiln stack is already running on {root}: `kiln demo` (pid {proc.pid}) at http://127.0.0.1:"
        in said
    )
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground group
    assert proc.wait(timeout=120) == 130, log.read_text()[-4000:]
    text = log.read_text()
    assert "interrupted (SIGINT): cancelling the demo job" in text
    assert re.search(rf"cancelled job \S+ at step \d+/{INTERRUPTED_STEPS}\b", text), text[-3000:]
    assert "demo interrupted (SIGINT); nothing it started is left running" in text
    assert "Traceback" not in text and "Aborted!" not in text
    assert "keeps going on the server" not in text  # the submitting child never saw the Ctrl-C
    assert_nothing_left(root)
    [(interrupted_name, state, reason, _)] = jobs(root)
    assert (state, reason) == ("failed", "cancelled")

    output, _ = run_demo(root)
    name = assert_finished_with_receipt(output, root)
    assert "left queued by an interrupted demo" not in output
    assert [(a, s) for a, s, _, _ in jobs(root)] == [(interrupted_name, "failed"), (name, "completed")]
    assert_nothing_left(root)


def test_sigterm_and_sigkill_leave_no_process_and_no_job_ahead_of_the_next_run(tmp_path):
    root = tmp_path / "demo-root"
    log = tmp_path / "terminated.log"
    proc = start_demo(root, log)
    wait_for_training(proc, log)
    proc.terminate()
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-4000:]
    assert "demo interrupted (SIGTERM)" in log.read_text()
    assert_nothing_left(root)

    log = tmp_path / "killed.log"
    proc = start_demo(root, log)
    wait_for_training(proc, log)
    proc.kill()  # no chance to clean up: the children are told by the kernel
    proc.wait(timeout=30)
    assert_nothing_left(root, within_s=90)
    killed = [row for row in jobs(root) if row[1] not in ("completed", "failed")]
    assert len(killed) == 1, (
        jobs(root),
        log.read_text()[-3000:],
        (root / "logs" / "worker.log").read_text()[-5000:],
    )

    output, _ = run_demo(root)
    name = assert_finished_with_receipt(output, root)
    assert f"cancelled job {killed[0][3]} ({killed[0][0]}), left " in output
    states = {a: (s, r) for a, s, r, _ in jobs(root)}
    assert states[killed[0][0]] == ("failed", "cancelled")
    assert states[name] == ("completed", None)
    assert_nothing_left(root)


def test_scripts_demo_from_another_directory_resolves_paths_there(tmp_path):
    """`scripts/demo` as the README runs it, but from outside the checkout: --root and --data are
    the caller's relative paths, not the checkout's."""
    repo = Path(__file__).resolve().parents[2]
    rows = (repo / "examples" / "demo.jsonl").read_text(encoding="utf-8").splitlines()[:4]
    (tmp_path / "mine.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    done = subprocess.run(
        [
            str(repo / "scripts" / "demo"),
            "--root",
            "state",
            "--data",
            "mine.jsonl",
            "--preset",
            "tiny",
            "--epochs",
            "1",
        ],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "rows             4 kept, 0 rejected" in output
    match = FINISHED.search(output)
    assert match and Path(match["path"]).parent == tmp_path / "state" / "adapters", output[-2000:]
    assert (Path(match["path"]) / "adapter_model.safetensors").is_file()
    assert_nothing_left(tmp_path / "state")
