"""Alembic environment for the Kiln job store.

The database URL comes from the config attribute that `kiln.store.upgrade_database(url)` sets.
Only when Alembic is run by hand (`alembic -c migrations/alembic.ini ...`) does it fall back to
the `KILN_DATABASE_URL` environment variable; this is the one place that reads it.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context

from kiln.store.engine import ALEMBIC_URL_ATTRIBUTE, make_engine, normalize_url
from kiln.store.models import Base

config = context.config
target_metadata = Base.metadata

if config.config_file_name is not None and ALEMBIC_URL_ATTRIBUTE not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _database_url() -> str:
    url = config.attributes.get(ALEMBIC_URL_ATTRIBUTE) or os.environ.get("KILN_DATABASE_URL")
    if not url:
        raise RuntimeError(
            "no database URL: call kiln.store.upgrade_database(url), or set KILN_DATABASE_URL "
            "when running alembic by hand"
        )
    return normalize_url(url)


def _is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def run_migrations_offline() -> None:
    """Emit the SQL instead of running it (`alembic upgrade head --sql`)."""
    url = _database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=_is_sqlite(url),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run every pending revision in one transaction (SQLite DDL is transactional here too)."""
    engine = make_engine(_database_url())
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                # Batch mode (copy-and-rename) only where ALTER is limited.
                render_as_batch=connection.dialect.name == "sqlite",
                # make_engine's SQLite BEGIN hook makes SQLite DDL transactional: a failed
                # upgrade leaves the previous schema, on either database.
                transactional_ddl=True,
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
