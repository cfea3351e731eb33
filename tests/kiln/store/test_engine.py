"""Engine set-up: URL mapping to psycopg 3, SQLite pragmas and transactions, Postgres reachable."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from kiln.store import make_engine, normalize_url
from kiln.store.engine import SQLITE_BUSY_TIMEOUT_MS
from tests.kiln.store.store_support import POSTGRES_ADMIN_URL


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
