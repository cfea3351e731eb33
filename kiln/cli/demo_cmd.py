"""`kiln demo`: the README's main command, end to end on embedded defaults.

Builds a tiny random Qwen3.5 checkpoint (real tokenizer), migrates a SQLite job store, starts
`kiln serve` and `kiln worker` as child processes (SQLite broker, CPU), submits the demo
conversations over HTTP with `kiln train sft` (live progress, receipt summary, adapter path) and
stops everything it started.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import click

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_DATA = REPO_ROOT / "examples" / "demo.jsonl"
START_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _spawn(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kiln.cli.main", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_for_runner(port: int, procs: dict[str, subprocess.Popen], logs: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        health = _health(port)
        if health and health.get("runner"):
            return
        for name, proc in procs.items():
            if proc.poll() is not None:
                tail = (logs / f"{name}.log").read_text(errors="replace")[-2000:]
                raise click.ClickException(f"`kiln {name}` exited with {proc.returncode}:\n{tail}")
        time.sleep(0.5)
    raise click.ClickException(f"the worker did not register within {START_TIMEOUT_S}s; see {logs}")


def register(cli: click.Group) -> None:
    @cli.command("demo")
    @click.option(
        "--root",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path(".kiln-demo"),
        show_default=True,
        help="Storage root for the demo (models, adapters, SQLite files, logs).",
    )
    @click.option(
        "--data",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=DEMO_DATA,
        show_default=True,
        help="Conversations to train on (JSONL).",
    )
    @click.option(
        "--preset",
        type=click.Choice(["tiny", "small"]),
        default="small",
        show_default=True,
        help="Random Qwen3.5 shape to build (small: hidden 256, 8 layers, full vocabulary).",
    )
    @click.option("--epochs", type=int, default=3, show_default=True)
    def demo(root: Path, data: Path, preset: str, epochs: int) -> None:
        """Run api + worker on embedded defaults, train the demo adapter over HTTP, then stop."""
        from kiln.store import upgrade_database
        from kiln_train.tiny import write_tiny_checkpoint

        root = root.resolve()
        logs = root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        model_dir = root / "models" / f"kiln-{preset}"
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        env.update(
            {
                "KILN_STORAGE_ROOT": str(root),
                "KILN_MODEL_PATH": str(model_dir),
                "KILN_MODEL_DEVICE": "cpu",
                "KILN_SERVER_HOST": "127.0.0.1",
                "KILN_SERVER_PORT": str(port),
                "KILN_SERVER_WORKERS": "1",
                "KILN_TRAINING_HEARTBEAT_SECONDS": "2",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if not (model_dir / "config.json").is_file():
            click.echo(f"building a tiny random Qwen3.5 checkpoint ({preset}) in {model_dir} ...")
            write_tiny_checkpoint(model_dir, preset=preset, seed=0)
        upgrade_database(f"sqlite:///{root / 'kiln.db'}")
        click.echo(f"starting kiln serve (127.0.0.1:{port}) and kiln worker; logs in {logs}")
        procs = {
            "serve": _spawn(["serve"], env, logs / "serve.log"),
            "worker": _spawn(["worker"], env, logs / "worker.log"),
        }
        try:
            _wait_for_runner(port, procs, logs)
            name = "demo-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
            args = [
                sys.executable, "-m", "kiln.cli.main", "train", "sft",
                "--url", f"http://127.0.0.1:{port}",
                "--data", str(data),
                "--epochs", str(epochs),
                "--rank", "16",
                "--alpha", "32",
                "--optimizer", "adam_w",
                "--learning-rate", "0.002",
                "--seed", "42",
                "--checkpoint-interval", "30",
                "--output-name", name,
                "--adapter-smoke-test",
            ]  # fmt: skip
            code = subprocess.run(args, env=env).returncode
        finally:
            click.echo("stopping kiln serve and kiln worker ...")
            _stop(list(procs.values()))
        if code != 0:
            raise SystemExit(code)
        click.echo(f"demo finished: adapter in {root / 'adapters' / name}")
