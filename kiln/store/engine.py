"""Engines, sessions and schema upgrades for the job store (docs/ARCHITECTURE.md#job-store).

Postgres in production (psycopg 3), SQLite as the embedded default. Production creates and
upgrades the schema with Alembic (`upgrade_database`), never with `create_all`, after
`wait_for_database` has seen the server answer (a container's database may still be starting).

Transactions: store functions never commit; the caller owns the transaction, e.g.
`with factory.begin() as session: claim_job(session, ...)`. Keep transactions short (no
tokenization or training inside one): on SQLite a transaction holds the database's write lock.

A process frozen inside a transaction (SIGSTOP, a VM freeze, a swap storm) keeps its row locks
for as long as it is frozen: a worker stopped between recording a step and committing it would
hold its job's row, and the reconciler that must take the job over would wait on that lock for
ever. The api and the worker therefore open Postgres connections with
`idle_in_transaction_timeout_seconds` (the training lease): Postgres ends a session whose
transaction has waited that long for its client, which rolls the transaction back and frees
the locks. The frozen process, once it runs again, finds its connection closed (an
OperationalError, retried on a new connection, where the fence refuses a superseded claim).

SQLite specifics, and why:
- `BEGIN IMMEDIATE` for every transaction: the write lock is taken at BEGIN, so a transaction
  that reads and then writes (cancel, admission, the reconciler) can never be refused with
  SQLITE_BUSY_SNAPSHOT half way; other writers wait up to `busy_timeout` instead.
- WAL journal (readers do not block the writer), `busy_timeout`, and `foreign_keys=ON`.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from kiln.store.errors import DatabaseUnavailable
from kiln.store.models import Base

SQLITE_BUSY_TIMEOUT_MS = 30_000
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"  # Postgres' SQLSTATE for a session it ended that way
ALEMBIC_URL_ATTRIBUTE = "kiln_database_url"
# wait_for_database: one attempt may take this long (a host that drops packets never refuses).
CONNECT_ATTEMPT_TIMEOUT_S = 5
WAIT_REPORT_EVERY_S = 10.0
# libpq's words for a server that answered and said no: waiting would not change the answer.
REFUSALS = (
    "password authentication failed",
    "does not exist",
    "no pg_hba.conf entry",
    "no password supplied",
)


def normalize_url(url: str) -> str:
    """Map `postgres://` and `postgresql://` to the psycopg 3 driver; leave others as given."""
    parsed = make_url(url)
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def make_engine(
    url: str, echo: bool = False, *, idle_in_transaction_timeout_seconds: float | None = None
) -> Engine:
    """An Engine for a SQLite file/memory URL or a Postgres URL, configured as described above.

    `idle_in_transaction_timeout_seconds` (Postgres): the session of a transaction left waiting
    for its client this long is ended by the server; None leaves the server's setting."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        engine = create_engine(url, echo=echo, pool_pre_ping=True)
        if idle_in_transaction_timeout_seconds is not None and parsed.get_backend_name() == "postgresql":
            _end_idle_transactions(engine, idle_in_transaction_timeout_seconds)
        return engine
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, echo=echo, connect_args={"check_same_thread": False})
    _configure_sqlite(engine, in_memory=not parsed.database or parsed.database == ":memory:")
    return engine


def _end_idle_transactions(engine: Engine, seconds: float) -> None:
    milliseconds = max(1, round(seconds * 1000))

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        # A session-level SET on each new connection (not a startup option: connection poolers
        # such as PgBouncer refuse unknown startup parameters).
        with dbapi_connection.cursor() as cursor:
            cursor.execute(f"SET idle_in_transaction_session_timeout = {milliseconds}")
        dbapi_connection.commit()

    @event.listens_for(engine, "handle_error")
    def _session_ended(context):
        # Postgres reports the ended session as SQLSTATE 25P03, which the driver classes as an
        # InternalError; it is a lost connection (retried on a new one), so say so.
        original = context.original_exception
        if getattr(original, "sqlstate", None) == IDLE_IN_TRANSACTION_TIMEOUT:
            return sa_exc.OperationalError(
                context.statement, context.parameters, original, connection_invalidated=True
            )
        return None


def _configure_sqlite(engine: Engine, *, in_memory: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:
        # Take BEGIN away from the sqlite3 driver (its legacy mode skips BEGIN for SELECT and
        # DDL); SQLAlchemy emits BEGIN IMMEDIATE below instead.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        if not in_memory:
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (the api serializes them afterwards)."""
    return sessionmaker(engine, expire_on_commit=False)


def create_all_for_tests(engine: Engine) -> None:
    """Create the tables straight from the models. Tests only: production runs `upgrade_database`."""
    Base.metadata.create_all(engine)


def wait_for_database(
    url: str, timeout_s: float, *, poll_s: float = 1.0, report: Callable[[str], None] | None = None
) -> int:
    """Connect to the database server at `url`, retrying for up to `timeout_s` seconds while it
    cannot be reached; return the number of attempts (docs/deployment.md#startup-order).

    A server that is still starting (connection refused, a host name the container network does
    not resolve yet, "the database system is starting up") is retried every `poll_s`; `report`
    gets one line at the first failure and every ~10 s after. A server that answers with a
    refusal (bad password, unknown database or role) fails at once with its OperationalError.
    Once the time is up, DatabaseUnavailable carries the last reason. SQLite needs no server:
    nothing to wait for."""
    normalized = normalize_url(url)
    if make_url(normalized).get_backend_name() == "sqlite":
        return 0
    engine = create_engine(normalized, poolclass=NullPool, connect_args=_connect_timeout(normalized))
    started = time.monotonic()
    attempts, reported = 0, None
    try:
        while True:
            attempts += 1
            try:
                with engine.connect():
                    return attempts
            except sa_exc.OperationalError as exc:
                reason = _first_line(exc)
                if timeout_s <= 0 or any(words in reason for words in REFUSALS):
                    raise
                waited = time.monotonic() - started
                left = timeout_s - waited
                if left <= 0:
                    raise DatabaseUnavailable(reason, waited, attempts) from exc
                if report is not None and (reported is None or waited - reported >= WAIT_REPORT_EVERY_S):
                    reported = waited
                    report(f"waiting for the job database ({reason}); {left:.0f} s left")
            time.sleep(min(poll_s, left))
    finally:
        engine.dispose()


def _connect_timeout(url: str) -> dict:
    if make_url(url).get_backend_name() == "postgresql":
        return {"connect_timeout": CONNECT_ATTEMPT_TIMEOUT_S}
    return {}


def _first_line(exc: sa_exc.OperationalError) -> str:
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def migrations_dir() -> Path:
    """The Alembic script directory (the `migrations` package), from any cwd or installation."""
    spec = importlib.util.find_spec("migrations")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the 'migrations' package is not importable; install kiln")
    return Path(next(iter(spec.submodule_search_locations)))


def alembic_config(url: str) -> Config:
    """An Alembic Config built in code: script location from the package, URL as an attribute."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes[ALEMBIC_URL_ATTRIBUTE] = normalize_url(url)
    return config


def upgrade_database(url: str, revision: str = "head") -> None:
    """Run `alembic upgrade <revision>` on the database at `url` (the production schema path)."""
    command.upgrade(alembic_config(url), revision)


def downgrade_database(url: str, revision: str = "base") -> None:
    """Run `alembic downgrade <revision>` on the database at `url`."""
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str:
    """The newest revision the installed migrations know."""
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    if head is None:
        raise RuntimeError("no Alembic revisions found")
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (None when it was never migrated)."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
