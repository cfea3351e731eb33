"""Alembic migrations of the Kiln job store (run with `kiln.store.upgrade_database(url)`)."""
