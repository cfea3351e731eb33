"""Engine set-up: URL mapping to psycopg 3, SQLite pragmas and transactions, Postgres reachable,
and a frozen transaction ended by the server after the idle timeout."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from kiln.store import make_engine, normalize_url
from kiln.store.engine import SQLITE_BUSY_TIMEOUT_MS
from tests.kiln.store.store_support import POSTGRES_ADMIN_URL, fresh_postgres_database


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://kiln:pw@db:5432/kiln", "postgresql+psycopg://kiln:pw@db:5432/kiln"),
        ("postgres://kiln@db/kiln", "postgresql+psycopg://kiln@db/kiln"),
        ("postgresql+psycopg://kiln@db/kiln", "postgresql+psycopg://kiln@db/kiln"),
        ("sqlite:////var/lib/kiln/kiln.db", "sqlite:////var/lib/kiln/kiln.db"),
    ],
)
def test_normalize_url(given, expected):
    assert normalize_url(given) == expected


def test_sqlite_engine_pragmas_and_parent_directory(tmp_path):
    path = tmp_path / "nested" / "dir" / "kiln.db"
    engine = make_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as connection:
            assert connection.execute(text("PRAGMA journal_mode")).scalar_one() == "wal"
            assert connection.execute(text("PRAGMA foreign_keys")).scalar_one() == 1
            assert connection.execute(text("PRAGMA busy_timeout")).scalar_one() == SQLITE_BUSY_TIMEOUT_MS
        assert path.exists()
    finally:
        engine.dispose()


def test_sqlite_transactions_roll_back_ddl_and_rows(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'kiln.db'}")
    try:
        with pytest.raises(RuntimeError), engine.begin() as connection:
            connection.execute(text("CREATE TABLE t (x INTEGER)"))
            connection.execute(text("INSERT INTO t VALUES (1)"))
            raise RuntimeError("abort")
        with engine.connect() as connection:
            tables = connection.execute(text("SELECT name FROM sqlite_master WHERE name = 't'")).all()
        assert tables == []  # BEGIN is ours, so even DDL rolls back
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgres_engine_uses_psycopg3():
    engine = make_engine(POSTGRES_ADMIN_URL)
    try:
        assert engine.dialect.driver == "psycopg"
        with engine.connect() as connection:
            assert connection.execute(text("SELECT 1")).scalar_one() == 1
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_transaction_frozen_past_the_idle_timeout_is_ended_and_frees_its_row_locks():
    """A process frozen between a write and its commit must not hold the row for ever: the
    server ends its session after the timeout, the lock is released, the write is rolled back
    and the frozen side finds its connection gone (OperationalError) when it runs again."""
    with fresh_postgres_database() as url:
        frozen = make_engine(url, idle_in_transaction_timeout_seconds=1.5)
        other = make_engine(url)
        try:
            with other.begin() as connection:
                connection.execute(text("CREATE TABLE lease (id int PRIMARY KEY, owner text)"))
                connection.execute(text("INSERT INTO lease VALUES (1, 'first')"))
            stalled = frozen.connect()
            assert stalled.execute(text("SHOW idle_in_transaction_session_timeout")).scalar_one() == "1500ms"
            stalled.execute(text("UPDATE lease SET owner = 'frozen' WHERE id = 1"))  # row lock held
            started = time.monotonic()
            with other.begin() as connection:
                connection.execute(text("SET LOCAL lock_timeout = '20s'"))  # fail, not hang, if never freed
                connection.execute(text("UPDATE lease SET owner = 'taker' WHERE id = 1"))
            waited = time.monotonic() - started
            assert 1.0 < waited < 10.0
            with pytest.raises(sa_exc.OperationalError) as lost:  # it wakes and commits
                stalled.commit()
            assert lost.value.connection_invalidated
            stalled.close()
            with other.connect() as connection:
                assert connection.execute(text("SELECT owner FROM lease")).scalar_one() == "taker"
            with frozen.connect() as connection:  # the pool hands out a new, working session
                assert connection.execute(text("SELECT owner FROM lease")).scalar_one() == "taker"
        finally:
            frozen.dispose()
            other.dispose()


@pytest.mark.postgres
def test_without_the_idle_timeout_the_server_setting_is_left_alone():
    engine = make_engine(POSTGRES_ADMIN_URL)
    try:
        with engine.connect() as connection:
            assert connection.execute(text("SHOW idle_in_transaction_session_timeout")).scalar_one() == "0"
    finally:
        engine.dispose()
