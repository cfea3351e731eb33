"""Alembic migrations on SQLite and Postgres: upgrade head, downgrade base, upgrade again; the
migrated schema equals the models' metadata; the views come and go with their revision; the
programmatic and the by-hand (CLI) entry points both work."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, inspect

from kiln.store import (
    Base,
    current_revision,
    downgrade_database,
    head_revision,
    make_engine,
    upgrade_database,
)
from kiln.store.engine import migrations_dir
from tests.kiln.store.store_support import BACKENDS, empty_database

TABLES = {
    "training_jobs",
    "prepared_sft_admissions",
    "job_events",
    "training_steps",
    "checkpoints",
    "adapters",
    "runners",
    "validation_evaluations",
}
VIEWS = {
    "v_job_history",
    "v_loss_curve",
    "v_failures_by_reason",
    "v_throughput_by_rank_optimizer",
    "v_queue",
    "v_validation_curve",
}
# What revision 0001 created (before 0004 added the validation table).
TABLES_0001 = TABLES - {"validation_evaluations"}


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path):
    with empty_database(request.param, tmp_path) as url:
        yield url


def _schema_diff(engine, metadata: MetaData = Base.metadata) -> list:
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return compare_metadata(context, metadata)


def _objects(engine) -> tuple[set[str], set[str]]:
    inspector = inspect(engine)
    return set(inspector.get_table_names()) - {"alembic_version"}, set(inspector.get_view_names())


def test_upgrade_downgrade_upgrade(url):
    engine = make_engine(url)
    try:
        assert current_revision(engine) is None
        upgrade_database(url)
        assert current_revision(engine) == head_revision() == "0005"
        assert _objects(engine) == (TABLES, VIEWS)

        downgrade_database(url, "0003")
        assert current_revision(engine) == "0003"
        assert _objects(engine) == (TABLES_0001, VIEWS - {"v_validation_curve"})
        columns = {c["name"] for c in inspect(engine).get_columns("prepared_sft_admissions")}
        assert "validation" not in columns

        downgrade_database(url, "0001")
        assert current_revision(engine) == "0001"
        assert _objects(engine) == (TABLES_0001, set())

        downgrade_database(url)
        assert current_revision(engine) is None
        assert _objects(engine) == (set(), set())

        upgrade_database(url)
        assert _objects(engine) == (TABLES, VIEWS)
        assert _schema_diff(engine) == []
    finally:
        engine.dispose()


def test_migrated_schema_equals_the_models(url):
    upgrade_database(url)
    engine = make_engine(url)
    try:
        assert _schema_diff(engine) == []
        # The comparison does see a difference when there is one.
        drifted = MetaData(naming_convention=Base.metadata.naming_convention)
        for table in Base.metadata.sorted_tables:
            table.to_metadata(drifted)
        drifted.tables["training_jobs"].append_column(Column("extra_column", Integer))
        diff = _schema_diff(engine, drifted)
        assert [(d[0], d[3].name) for d in diff] == [("add_column", "extra_column")]
    finally:
        engine.dispose()


def test_constraint_and_index_names_follow_the_convention(url):
    upgrade_database(url)
    engine = make_engine(url)
    try:
        inspector = inspect(engine)
        assert inspector.get_pk_constraint("training_jobs")["name"] in (
            "pk_training_jobs",
            None,
        )  # SQLite: unnamed
        uniques = {u["name"] for u in inspector.get_unique_constraints("training_jobs")}
        assert {"uq_training_jobs_idempotency_key", "uq_training_jobs_queue_seq"} <= uniques
        indexes = {i["name"] for i in inspector.get_indexes("training_jobs")}
        assert {
            "ix_training_jobs_state",
            "ix_training_jobs_submitted_at",
            "ix_training_jobs_adapter_name",
            "ix_training_jobs_failure_reason",
            "ix_training_jobs_state_queue_seq",
        } <= indexes
        fks = {f["name"] for f in inspector.get_foreign_keys("training_steps")}
        assert fks == {"fk_training_steps_job_id_training_jobs"}
        checks = {c["name"] for c in inspector.get_check_constraints("training_jobs")}
        assert {"ck_training_jobs_state", "ck_training_jobs_job_type"} <= checks
    finally:
        engine.dispose()


def test_upgrade_works_from_any_working_directory(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    upgrade_database(url)
    engine = make_engine(url)
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_alembic_by_hand_reads_kiln_database_url(url, tmp_path):
    ini = migrations_dir() / "alembic.ini"
    env = {k: v for k, v in os.environ.items() if k != "KILN_DATABASE_URL"}
    command = [sys.executable, "-m", "alembic", "-c", str(ini)]
    refused = subprocess.run(
        [*command, "upgrade", "head"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert refused.returncode != 0 and "KILN_DATABASE_URL" in refused.stderr

    env["KILN_DATABASE_URL"] = url
    done = subprocess.run(
        [*command, "upgrade", "head"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    shown = subprocess.run([*command, "current"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "0005 (head)" in shown.stdout
    engine = make_engine(url)
    try:
        assert _objects(engine) == (TABLES, VIEWS)
    finally:
        engine.dispose()
