"""`kiln up`: the api and a worker in one command, for using Kiln on one machine.

Runs `kiln serve` and `kiln worker` as child processes on the configured settings (kiln.toml,
KILN_* and the flags here; with none, the embedded defaults: SQLite and a SQLite broker under
`storage.root`). A job database with no schema yet (a fresh root) is created; one at an older
revision is refused with the `kiln db upgrade` it needs, as `kiln serve` would. With no
`model.path` configured and no model in `<root>/models/default`, a small random Qwen3.5
checkpoint is built once (`<root>/models/kiln-<preset>`, the one `kiln demo` builds and reuses)
so everything can be tried without real weights. One stack per root: a root another `kiln up` or
`kiln demo` holds is refused with that stack's address (kiln_cli/stack_lock.py); `kiln worker`
on the same settings adds a worker to a running one.

Prints the UI address once the api answers; Ctrl-C (or SIGTERM, SIGHUP) stops the worker (it
checkpoints a running job on the way down) and the api, and exits 128 + the signal number.
If either child exits by itself, the other is stopped and `kiln up` exits 1 with its log tail.
The children are told to stop if `kiln up` itself dies (Linux), so none is left behind.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import click

from kiln.settings import ConfigError, Settings, check_bind_safety
from kiln_cli.config_cmd import load_or_exit
from kiln_cli.demo_cmd import (
    Interrupted,
    _hold_signals,
    _say,
    _signals_raise,
    _spawn,
    _stop,
    ensure_model,
    model_is_complete,
    preset_option,
)
from kiln_cli.service_cmd import (
    check_port_free,
    check_schema,
    database_errors,
    ensure_dirs_or_exit,
    redact_url,
)
from kiln_cli.stack_lock import stack_lock

POLL_S = 0.5
LOG_TAIL = 3000


def register(cli: click.Group) -> None:
    @cli.command("up")
    @click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Path to kiln.toml.")
    @click.option(
        "--root",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Storage root (storage.root): database, broker, datasets, adapters, models, logs.",
    )
    @click.option("--host", default=None, help="Bind address of the api (server.host).")
    @click.option("--port", type=int, default=None, help="TCP port of the api and the UI (server.port).")
    @click.option("--model-path", default=None, help="Qwen3.5 checkpoint directory (model.path).")
    @click.option("--device", default=None, help="cpu, cuda or cuda:N (model.device).")
    @preset_option("Shape of the random model built when no model is configured.")
    def up(
        config_file: str | None,
        root: Path | None,
        host: str | None,
        port: int | None,
        model_path: str | None,
        device: str | None,
        preset: str,
    ) -> None:
        """Run the api and a worker together; open the printed address for the browser UI."""
        flags = {
            "storage.root": str(root) if root is not None else None,
            "server.host": host,
            "server.port": port,
            "model.path": model_path,
            "model.device": device,
        }
        settings = load_or_exit(config_file, flags).settings
        try:
            with _signals_raise():
                code = run_up(settings, config_file, preset)
        except Interrupted as exc:
            _say(f"kiln up: stopped ({exc})", err=True)
            sys.exit(128 + exc.signum)
        sys.exit(code)


def prepare(settings: Settings, preset: str) -> Path:
    """Directories, the job database and the model: everything the children need, or exit 2."""
    try:
        check_bind_safety(settings)
    except ConfigError as exc:
        click.echo(f"kiln up: {exc}", err=True)
        sys.exit(2)
    ensure_dirs_or_exit("up", settings)
    from kiln.store import current_revision, make_engine, upgrade_database

    logging.getLogger("alembic").setLevel(logging.WARNING)  # one line says the database was created

    with database_errors("up", settings):
        engine = make_engine(settings.database_url)
        try:
            revision = current_revision(engine)
        finally:
            engine.dispose()
        if revision is None:
            _say(f"initialising the job database {redact_url(settings.database_url)}")
            upgrade_database(settings.database_url)
        try:
            check_schema(settings)
            check_port_free(settings.server.host, settings.server.port)
        except ConfigError as exc:
            click.echo(f"kiln up: {exc}", err=True)
            sys.exit(2)
    return model_dir(settings, preset)


def model_dir(settings: Settings, preset: str) -> Path:
    """The configured model, or (none configured and none at the default place) a random one."""
    if settings.model.path is not None or model_is_complete(settings.model_path):
        return settings.model_path
    built = settings.storage_root / "models" / f"kiln-{preset}"
    if not model_is_complete(built):
        _say(
            f"no model configured (model.path) and none in {settings.model_path}: using a random one to try Kiln"
        )
    ensure_model(built, preset)
    return built


def ui_address(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else "[::1]" if host == "::" else host
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/"


def run_up(settings: Settings, config_file: str | None, preset: str) -> int:
    address = ui_address(settings.server.host, settings.server.port)
    # One stack per root (kiln_cli/stack_lock.py): before anything is built or bound, so a second
    # `kiln up` or a demo on this root is told where the running one answers.
    with stack_lock(settings.storage_root.resolve(), "kiln up", address):
        return _run_up_locked(settings, config_file, preset, address)


def _run_up_locked(settings: Settings, config_file: str | None, preset: str, address: str) -> int:
    model = prepare(settings, preset)
    logs = settings.storage_root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        {
            "KILN_STORAGE_ROOT": str(settings.storage_root),
            "KILN_SERVER_HOST": settings.server.host,
            "KILN_SERVER_PORT": str(settings.server.port),
            "KILN_MODEL_PATH": str(model),
            "KILN_MODEL_DEVICE": settings.model.device,
            "PYTHONUNBUFFERED": "1",
        }
    )
    config = ["--config", config_file] if config_file else []
    procs: dict[str, subprocess.Popen] = {}
    try:
        _say(f"starting kiln serve ({address}) and kiln worker ({model}); logs in {logs}")
        procs["serve"] = _spawn(["serve", *config], env, logs / "serve.log")
        procs["worker"] = _spawn(["worker", *config], env, logs / "worker.log")
        return supervise(procs, settings, address, logs)
    finally:
        _hold_signals()
        if procs:
            _say("stopping kiln worker and kiln serve ...")
            # The worker first: a running job is checkpointed and released while the api still answers.
            _stop([procs["worker"]] if "worker" in procs else [])
            _stop([p for name, p in procs.items() if name != "worker"])
            _say("stopped")


def supervise(procs: dict[str, subprocess.Popen], settings: Settings, address: str, logs: Path) -> int:
    """Announce the api and the worker as they come up; return 1 when either exits by itself."""
    api_up = runner_up = False
    while True:
        for name, proc in procs.items():
            if proc.poll() is not None:
                tail = (logs / f"{name}.log").read_text(errors="replace")[-LOG_TAIL:]
                _say(f"kiln up: `kiln {name}` exited with {proc.returncode}:\n{tail}", err=True)
                return 1
        if not runner_up:
            health = health_of(address)
            if health is not None and not api_up:
                api_up = True
                _say(f"Kiln UI: {address}")
            if health is not None and health.get("runner"):
                runner_up = True
                runner = health["runner"]
                _say(f"worker ready: {runner['id']} on {runner['device']}; Ctrl-C stops both")
        time.sleep(POLL_S)


def health_of(address: str) -> dict | None:
    try:
        with urllib.request.urlopen(address + "health", timeout=3) as response:  # noqa: S310 (our own api)
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
