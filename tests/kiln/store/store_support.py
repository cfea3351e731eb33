"""Helpers for the job-store tests: fresh migrated databases on SQLite and on
Postgres, and jobs seeded through the store API.

Postgres tests use a database created for the module (`kiln_test_<random>`) and dropped after,
so parallel runs never collide. They carry the `postgres` marker and fail (not skip) when the
server at KILN_TEST_POSTGRES_URL (default 127.0.0.1:5432/test, trust auth) is unreachable.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, delete
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from kiln.store import (
    Base,
    Job,
    claim_job,
    finish_job,
    insert_admitted_job,
    list_events,
    record_checkpoint,
    record_step,
    upgrade_database,
)

POSTGRES_ADMIN_URL = os.environ.get("KILN_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """Create an empty database on the test server; yield its URL; drop it afterwards."""
    name = f"kiln_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def empty_database(backend: str, directory: Path) -> Iterator[str]:
    """The URL of an empty database of the given backend ("sqlite" or "postgres")."""
    if backend == "sqlite":
        yield f"sqlite:///{directory / 'kiln.db'}"
    else:
        with fresh_postgres_database() as url:
            yield url


@contextmanager
def migrated_database(backend: str, directory: Path) -> Iterator[str]:
    """The URL of a database upgraded to the head revision."""
    with empty_database(backend, directory) as url:
        upgrade_database(url)
        yield url


def clear_tables(engine: Engine) -> None:
    """Delete every row (children first) so each test starts from an empty store."""
    with engine.begin() as connection:
        for table in reversed(Base.metadata.sorted_tables):
            connection.execute(delete(table))


def job_fields(**overrides: Any) -> dict[str, Any]:
    """training_jobs columns an admission would write, with plausible values."""
    fields: dict[str, Any] = {
        "adapter_name": f"adapter-{uuid.uuid4().hex[:8]}",
        "effective_seed": "18446744073709551615",
        "optimizer_kind": "muon",
        "learning_rate": 1e-3,
        "lora_rank": 8,
        "lora_alpha": 16.0,
        "epochs": 2,
        "rows_kept": 5,
        "total_steps": 10,
        "loss_route": "kt_tape_flce",
        "backend": "cpu",
        "device": "cpu",
        "request_fingerprint": "sha256:" + "ab" * 32,
    }
    fields.update(overrides)
    return fields


def admission_fields(**overrides: Any) -> dict[str, Any]:
    """prepared_sft_admissions columns for an inline-examples job."""
    fields: dict[str, Any] = {
        "loss_route": "kt_tape_flce",
        "optimizer": {"kind": "muon", "momentum": 0.95, "nesterov": True, "ns_iters": 5, "weight_decay": 0.0},
        "checkpoint_plan": {"segments": 1, "interval": None},
        "memory_estimate_bytes": 123_456_789,
        "memory_breakdown": {"weights": 100_000_000, "lora": 23_456_789},
        "execution_identity_digest": "sha256:" + "cd" * 32,
        "runner_id": "runner-1",
        "ingestion_receipt": {"schema": "kiln.sft-ingestion.v1", "rows_kept": 5},
        "ingestion_receipt_sha256": "sha256:" + "ef" * 32,
        "kept_corpus_sha256": "sha256:" + "01" * 32,
        "effective_config": {"epochs": 2, "lora_rank": 8, "seed": "18446744073709551615"},
        "data_source": "examples",
        "examples": [
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
        ],
        "max_seq_len": 12,
        "max_supervised_tokens": 4,
    }
    fields.update(overrides)
    return fields


def admit(session: Session, **job_overrides: Any) -> Job:
    """Admit one job through the store API."""
    return insert_admitted_job(session, job_fields(**job_overrides), admission_fields())


def run_steps(
    session: Session, job: Job, worker_id: str, losses: list[float], start: int = 1, **step: Any
) -> None:
    """Record one step per loss (global steps start, start+1, ...) for a job the worker holds."""
    for index, loss in enumerate(losses, start=start):
        record_step(
            session,
            job.id,
            worker_id,
            global_step=index,
            epoch=step.get("epoch", 0),
            loss=loss,
            learning_rate=job.learning_rate,
            step_ms=step.get("step_ms", 100.0),
            tokens=step.get("tokens", 50),
            supervised_tokens=step.get("supervised_tokens", 20),
        )


def claim_and_finish(session: Session, job_id: str, state: str, worker_id: str = "w-1", **final: Any) -> Job:
    """Claim a queued job and end it in one go (for seeding history)."""
    assert claim_job(session, job_id, worker_id, 60) is not None
    return finish_job(session, job_id, state, worker_id=worker_id, **final)


def running_job(factory, worker_id: str = "worker-a", lease_seconds: float = 60, **overrides):
    with factory.begin() as session:
        job = admit(session, **overrides)
        return claim_job(session, job.id, worker_id, lease_seconds)


def add_checkpoint(session, job_id: str, step: int, epoch_index: int = 0):
    basename = f"{job_id[:8]}-checkpoint-step-{step:08d}.kiln-checkpoint"
    return record_checkpoint(
        session,
        job_id,
        checkpoint_id=f"sft-step-{step:08d}",
        basename=basename,
        path=f"/storage/adapters/{basename}",
        global_step=step,
        epoch_index=epoch_index,
        cursor=step % 5,
        manifest_sha256="sha256:" + "aa" * 32,
        size_bytes=4096 + step,
        write_ms=12.5,
    )


def event_kinds(factory, job_id: str) -> list[str]:
    with factory() as session:
        events, _ = list_events(session, job_id, limit=1000)
        return [e.kind for e in events]


def race(threads: int, target) -> list[BaseException]:
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait()
            target(index)
        except BaseException as error:  # surfaced by the caller
            errors.append(error)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    return errors
