"""Store fixtures for the tests in this folder: a migrated database per module on each backend
(SQLite and Postgres), emptied before every test, and a database of its own for a test that
races two connections."""

from __future__ import annotations

import pytest

from kiln.store import make_engine, session_factory
from tests.kiln.store.store_support import BACKENDS, clear_tables, migrated_database


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, tmp_path_factory):
    with migrated_database(request.param, tmp_path_factory.mktemp("store")) as url:
        engine = make_engine(url)
        yield engine
        engine.dispose()


@pytest.fixture
def factory(engine):
    clear_tables(engine)
    return session_factory(engine)


@pytest.fixture(params=BACKENDS)
def fresh_factory(request, tmp_path):
    """A session factory on a freshly migrated database that only this test uses."""
    with migrated_database(request.param, tmp_path) as url:
        engine = make_engine(url)
        yield session_factory(engine)
        engine.dispose()
