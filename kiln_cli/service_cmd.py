"""Service commands: `kiln serve` (the api under gunicorn), `kiln health api`, `kiln db upgrade`.

`register(cli)` adds each command through its own `register_*` function so the worker's
commands (`kiln worker`, `kiln health worker`) can be appended here the same way; the `health`
group is created once by `health_group(cli)` and shared.

Torch-free at import (the `kiln` command imports every command module).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

from kiln.redact import redact_url
from kiln.settings import ConfigError, Settings, check_bind_safety
from kiln_cli.config_cmd import load_or_exit

GUNICORN_THREADS = 4
# Admission tokenizes the whole request inside the request; a large dataset_path takes a while.
GUNICORN_TIMEOUT_S = 300
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def register(cli: click.Group) -> None:
    register_serve(cli)
    register_health_api(health_group(cli))
    register_db(cli)


def health_group(cli: click.Group) -> click.Group:
    """The `kiln health` group (created on first use, shared by the api and worker probes)."""
    existing = cli.commands.get("health")
    if isinstance(existing, click.Group):
        return existing

    @cli.group("health")
    def health() -> None:
        """Probe a running service; exit 0 when healthy, 1 otherwise (for container healthchecks)."""

    return health


# ----- kiln serve ---------------------------------------------------------------------------

# `--root` of kiln serve and kiln worker, as kiln up and kiln demo spell it.
root_option = click.option(
    "--root",
    type=click.Path(file_okay=False),
    default=None,
    help="Storage root (storage.root): database, broker, datasets, adapters, models, logs.",
)


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def metrics_dir(settings: Settings) -> Path:
    """A fresh directory for prometheus_client's multiprocess files of this server instance."""
    path = settings.storage_root / "run" / f"prometheus-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def check_schema(settings: Settings) -> None:
    """Refuse to serve a database that is not at the newest migration (run `kiln db upgrade`)."""
    from kiln.store import current_revision, head_revision, make_engine

    engine = make_engine(settings.database_url)
    try:
        current = current_revision(engine)
    finally:
        engine.dispose()
    head = head_revision()
    if current != head:
        raise ConfigError(
            f"the job database is at revision {current or '<empty>'} but this release needs {head}; "
            "run `kiln db upgrade` first (or pass --upgrade-db)"
        )


@contextmanager
def database_errors(command: str, settings: Settings) -> Iterator[None]:
    """A job database that cannot be reached, a URL SQLAlchemy cannot use or an unknown revision:
    one line naming the database and the reason, exit 2 (never a traceback)."""
    from alembic.util import CommandError
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    try:
        yield
    except CommandError as exc:  # Alembic: an unknown or ambiguous revision
        click.echo(f"kiln {command}: job database {redact_url(settings.database_url)}: {exc}", err=True)
        sys.exit(2)
    except (SQLAlchemyError, ArgumentError) as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        click.echo(
            f"kiln {command}: job database {redact_url(settings.database_url)}: {reason}\n"
            "  check database.url (KILN_DATABASE_URL) and that the database server is running",
            err=True,
        )
        sys.exit(2)


def check_port_free(host: str, port: int) -> None:
    """Refuse early, with one line, an address gunicorn would retry five times and then fail on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"{bind_address(host, port)} is already in use (another `kiln serve`?); stop it or pass "
                "--port (server.port)"
            ) from None
        raise ConfigError(
            f"cannot listen on {bind_address(host, port)}: {exc.strerror or exc} (server.host)"
        ) from None


def serve(settings: Settings) -> None:
    """Run the api under gunicorn (gthread workers, one app per worker process)."""
    from gunicorn.app.base import BaseApplication

    class KilnApplication(BaseApplication):
        def __init__(self) -> None:
            self.options = {
                "bind": [bind_address(settings.server.host, settings.server.port)],
                "workers": settings.server.workers,
                # gthread, with gunicorn's own 4xx answers in the api's envelope.
                "worker_class": "kiln_cli.gunicorn_worker.KilnThreadWorker",
                "threads": GUNICORN_THREADS,
                "timeout": GUNICORN_TIMEOUT_S,
                "graceful_timeout": 30,
                "errorlog": "-",
                "child_exit": _child_exit,
            }
            super().__init__()

        def load_config(self) -> None:
            for key, value in self.options.items():
                self.cfg.set(key, value)

        def load(self):
            from api import create_app

            return create_app(settings)

    KilnApplication().run()


def _child_exit(server, worker) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def ensure_dirs_or_exit(command: str, settings: Settings) -> None:
    try:
        settings.ensure_dirs()
    except OSError as exc:
        click.echo(
            f"kiln {command}: cannot create the storage directories under {settings.storage_root}: "
            f"{exc.strerror or exc} (storage.root, KILN_STORAGE_ROOT)",
            err=True,
        )
        sys.exit(2)


def register_serve(cli: click.Group) -> None:
    @cli.command("serve")
    @click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Path to kiln.toml.")
    @root_option
    @click.option("--host", default=None, help="Bind address (server.host).")
    @click.option("--port", type=int, default=None, help="TCP port (server.port).")
    @click.option("--workers", type=int, default=None, help="gunicorn worker processes (server.workers).")
    @click.option(
        "--allow-unauthenticated-remote",
        is_flag=True,
        default=None,
        help="Serve a non-loopback address without api tokens (server.allow_unauthenticated_remote).",
    )
    @click.option("--upgrade-db", is_flag=True, help="Run the database migrations before serving.")
    def serve_command(
        config_file: str | None,
        root: str | None,
        host: str | None,
        port: int | None,
        workers: int | None,
        allow_unauthenticated_remote: bool | None,
        upgrade_db: bool,
    ) -> None:
        """Serve the HTTP api (refuses a non-loopback bind without tokens)."""
        flags = {
            "storage.root": root,
            "server.host": host,
            "server.port": port,
            "server.workers": workers,
            "server.allow_unauthenticated_remote": allow_unauthenticated_remote,
        }
        settings = load_or_exit(config_file, flags).settings
        try:
            check_bind_safety(settings)
            ensure_dirs_or_exit("serve", settings)
            with database_errors("serve", settings):
                if upgrade_db:
                    from kiln.store import upgrade_database

                    upgrade_database(settings.database_url)
                check_schema(settings)
            check_port_free(settings.server.host, settings.server.port)
        except ConfigError as exc:
            click.echo(f"kiln serve: {exc}", err=True)
            sys.exit(2)
        # Before anything imports prometheus_client: its value class is chosen at import time.
        directory, master = metrics_dir(settings), os.getpid()
        os.environ[MULTIPROC_ENV] = str(directory)
        try:
            serve(settings)
        finally:
            # gunicorn's forked workers leave through this frame too; only the master cleans up.
            if os.getpid() == master:
                shutil.rmtree(directory, ignore_errors=True)


# ----- kiln health api ----------------------------------------------------------------------


def probe(url: str, timeout: float) -> tuple[bool, str]:
    """(healthy, one-line description) for a GET of `url`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (operator-given URL)
            return response.status == 200, f"{url}: HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return False, f"{url}: unreachable ({reason})"
    except ValueError as exc:  # not an http(s) URL at all
        return False, f"{url}: not a usable URL ({exc})"


def register_health_api(health: click.Group) -> None:
    @health.command("api")
    @click.option("--url", default="http://127.0.0.1:8420/health", show_default=True, help="Health URL.")
    @click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait.")
    def health_api(url: str, timeout: float) -> None:
        """Exit 0 when GET URL answers 200."""
        healthy, line = probe(url, timeout)
        click.echo(line, err=not healthy)
        sys.exit(0 if healthy else 1)


# ----- kiln db upgrade ----------------------------------------------------------------------


def register_db(cli: click.Group) -> None:
    @cli.group("db")
    def db() -> None:
        """The job database (Alembic migrations)."""

    @db.command("upgrade")
    @click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Path to kiln.toml.")
    @click.option("--revision", default="head", show_default=True, help="Target revision.")
    @click.option(
        "--wait",
        "wait_s",
        type=click.FloatRange(min=0),
        default=0,
        show_default=True,
        help="Seconds to keep retrying a database server that cannot be reached yet (still starting).",
    )
    def upgrade(config_file: str | None, revision: str, wait_s: float) -> None:
        """Create or migrate the job database's schema to REVISION."""
        from kiln.store import current_revision, make_engine, upgrade_database, wait_for_database

        settings = load_or_exit(config_file).settings
        ensure_dirs_or_exit("db upgrade", settings)
        with database_errors("db upgrade", settings):
            wait_for_database(
                settings.database_url,
                wait_s,
                report=lambda line: click.echo(f"kiln db upgrade: {line}", err=True),
            )
            upgrade_database(settings.database_url, revision)
            engine = make_engine(settings.database_url)
            try:
                click.echo(f"job database at revision {current_revision(engine)}")
            finally:
                engine.dispose()
