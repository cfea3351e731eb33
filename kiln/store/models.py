"""The job store's tables: SQLAlchemy 2 typed models shared by the api and the worker.

docs/ARCHITECTURE.md#job-store: the row is the truth, the queue message only carries the job id,
and what people filter on is a column, not a JSON blob. The naming convention is on the metadata
from the first migration on, so every constraint and index has a deterministic name on SQLite and
Postgres.

Types:
- timestamps are timezone-aware UTC in Python (`UtcDateTime`): `timestamptz` on Postgres,
  naive-UTC text on SQLite (SQLite has no zone), always returned with `tzinfo=UTC`;
- JSON payloads are `JSON` (SQLite) / `JSONB` (Postgres), with Python `None` stored as SQL NULL;
- `effective_seed` is the u64 seed as a decimal string (docs/ARCHITECTURE.md#job-states): a u64 does not fit
  a signed BIGINT, and the wire format is already a decimal string.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Sequence,
    String,
    Text,
    TypeDecorator,
    false,
    func,
    select,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from kiln.store import states

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JSONType = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every dialect; naive datetimes are refused."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the job store keeps timezone-aware UTC times")
        value = value.astimezone(UTC)
        # SQLite stores text without a zone: keep everything in UTC so text order is time order.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    """This process's clock: an aware UTC datetime (local durations; rows are stamped with
    `store_now`)."""
    return datetime.now(UTC)


def store_now(session: Any) -> datetime:
    """The job store's clock, an aware UTC datetime, for every timestamp written to or compared
    with a row. On PostgreSQL it is the server's `clock_timestamp()`: the api, the workers and
    their reconcilers may run on different hosts, and one clock means a host whose clock is off
    can neither expire a live worker's lease (running its job twice) nor keep a dead one's alive,
    and durations between rows stamped by different hosts stay true. On SQLite (embedded: one
    host) it is this process's clock."""
    if session.get_bind().dialect.name == "postgresql":
        return session.execute(select(func.clock_timestamp())).scalar_one().astimezone(UTC)
    return utcnow()


def _in(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UtcDateTime(), dict[str, Any]: JSONType, list[Any]: JSONType}


# Postgres hands out admission order from this sequence; SQLite has no sequences, and the
# admission transaction there (one writer at a time, see engine.py) takes max(queue_seq) + 1.
QUEUE_SEQ = Sequence("training_jobs_queue_seq", metadata=Base.metadata)


class Job(Base):
    """One training job (`training_jobs`): its state, its plan summary and its progress."""

    __tablename__ = "training_jobs"
    __table_args__ = (
        CheckConstraint(f"state IN ({_in(states.JOB_STATES)})", name="state"),
        CheckConstraint(f"job_type IN ('{states.JOB_TYPE_SFT}')", name="job_type"),
        Index("ix_training_jobs_state_queue_seq", "state", "queue_seq"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_type: Mapped[str] = mapped_column(String(16), default=states.JOB_TYPE_SFT)
    state: Mapped[str] = mapped_column(String(16), index=True)
    failure_reason: Mapped[str | None] = mapped_column(String(64), index=True)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)

    submitted_at: Mapped[datetime] = mapped_column(index=True)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    published_at: Mapped[datetime | None]
    deleted_at: Mapped[datetime | None]
    queue_seq: Mapped[int] = mapped_column(BigInteger, QUEUE_SEQ, unique=True)

    # The admitted plan, flattened for people's queries (docs/ARCHITECTURE.md#job-store).
    adapter_name: Mapped[str] = mapped_column(String(255), index=True)
    effective_seed: Mapped[str] = mapped_column(String(20))
    optimizer_kind: Mapped[str] = mapped_column(String(32))
    learning_rate: Mapped[float] = mapped_column(Float)
    lora_rank: Mapped[int] = mapped_column(Integer)
    lora_alpha: Mapped[float] = mapped_column(Float)
    epochs: Mapped[int] = mapped_column(Integer)
    rows_kept: Mapped[int] = mapped_column(Integer)
    total_steps: Mapped[int] = mapped_column(Integer)
    loss_route: Mapped[str] = mapped_column(String(32))
    backend: Mapped[str] = mapped_column(String(16))
    device: Mapped[str] = mapped_column(String(64))
    resume_checkpoint: Mapped[str | None] = mapped_column(String(512))
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    request_fingerprint: Mapped[str] = mapped_column(String(71))

    # Progress, written as it happens.
    global_step: Mapped[int] = mapped_column(Integer, default=0)
    current_epoch: Mapped[int | None] = mapped_column(Integer)
    current_loss: Mapped[float | None] = mapped_column(Float)
    final_loss: Mapped[float | None] = mapped_column(Float)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    wall_clock_ms: Mapped[int | None] = mapped_column(BigInteger)
    latest_checkpoint: Mapped[str | None] = mapped_column(String(512))
    adapter_path: Mapped[str | None] = mapped_column(String(1024))
    receipt: Mapped[dict[str, Any] | None]

    # Ownership: the lease a worker holds while running, and the cooperative cancel flag.
    worker_id: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    cancel_requested_at: Mapped[datetime | None]

    admission: Mapped[Admission] = relationship(back_populates="job", uselist=False)

    @property
    def is_terminal(self) -> bool:
        return self.state in states.TERMINAL_STATES

    @property
    def progress(self) -> float:
        """global_step / total_steps in [0, 1]; 1.0 once completed (docs/ARCHITECTURE.md#job-states)."""
        if self.state == states.COMPLETED:
            return 1.0
        if self.total_steps <= 0:
            return 0.0
        return min(1.0, self.global_step / self.total_steps)


class Admission(Base):
    """The pinned plan of one job (`prepared_sft_admissions`, docs/ARCHITECTURE.md#pinning).

    The worker re-verifies every pinned fact at dequeue and fails the job on drift. The data
    travels either as the materialised normalised `examples` or as a server-local
    `dataset_path` whose re-ingestion must reproduce `kept_corpus_sha256` and
    `ingestion_receipt_sha256`.
    """

    __tablename__ = "prepared_sft_admissions"
    __table_args__ = (
        CheckConstraint(f"data_source IN ({_in(states.DATA_SOURCES)})", name="data_source"),
        CheckConstraint(
            f"(data_source = '{states.SOURCE_EXAMPLES}' AND examples IS NOT NULL AND dataset_path IS NULL)"
            f" OR (data_source = '{states.SOURCE_DATASET_PATH}' AND examples IS NULL"
            " AND dataset_path IS NOT NULL)",
            name="one_data_transport",
        ),
    )

    job_id: Mapped[str] = mapped_column(ForeignKey("training_jobs.id", ondelete="CASCADE"), primary_key=True)
    loss_route: Mapped[str] = mapped_column(String(32))
    optimizer: Mapped[dict[str, Any]]
    checkpoint_plan: Mapped[dict[str, Any]]
    memory_estimate_bytes: Mapped[int] = mapped_column(BigInteger)
    memory_breakdown: Mapped[dict[str, Any]]
    execution_identity_digest: Mapped[str] = mapped_column(String(71))
    runner_id: Mapped[str] = mapped_column(String(255))
    ingestion_receipt: Mapped[dict[str, Any]]
    ingestion_receipt_sha256: Mapped[str] = mapped_column(String(71))
    kept_corpus_sha256: Mapped[str] = mapped_column(String(71))
    effective_config: Mapped[dict[str, Any]]
    data_source: Mapped[str] = mapped_column(String(16))
    examples: Mapped[list[Any] | None]
    dataset_path: Mapped[str | None] = mapped_column(String(1024))
    max_seq_len: Mapped[int] = mapped_column(Integer)
    max_supervised_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime]
    # The request's `validation` object as admitted (docs/validation.md); NULL without validation.
    validation: Mapped[dict[str, Any] | None]
    # The request's `config` as sent (the fields the client set); NULL for older admissions.
    requested_config: Mapped[dict[str, Any] | None]

    job: Mapped[Job] = relationship(back_populates="admission")


class JobEvent(Base):
    """One line of a job's history (`job_events`); the autoincrement id is the page cursor."""

    __tablename__ = "job_events"
    __table_args__ = (
        CheckConstraint(f"level IN ({_in(states.EVENT_LEVELS)})", name="level"),
        Index("ix_job_events_job_id_id", "job_id", "id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("training_jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime]
    kind: Mapped[str] = mapped_column(String(32), index=True)
    level: Mapped[str] = mapped_column(String(16), default=states.LEVEL_INFO)
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any] | None]


class _CurvePoint:
    """The leading columns of a curve's row: one point per (job, global step), deleted with the job.
    `sort_order` keeps them first in the table, where the migrations put them."""

    job_id: Mapped[str] = mapped_column(
        ForeignKey("training_jobs.id", ondelete="CASCADE"), primary_key=True, sort_order=-1
    )
    global_step: Mapped[int] = mapped_column(Integer, primary_key=True, sort_order=-1)
    epoch: Mapped[int] = mapped_column(Integer, sort_order=-1)
    loss: Mapped[float] = mapped_column(Float, sort_order=-1)


class TrainingStep(_CurvePoint, Base):
    """One optimizer step of one job (`training_steps`): the loss curve."""

    __tablename__ = "training_steps"

    learning_rate: Mapped[float] = mapped_column(Float)
    step_ms: Mapped[float] = mapped_column(Float)
    tokens: Mapped[int] = mapped_column(Integer)
    supervised_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime]


class ValidationEvaluation(_CurvePoint, Base):
    """One evaluation of a job's held-out validation rows (`validation_evaluations`): the
    validation curve. Global step 0 is the baseline, evaluated before the first update."""

    __tablename__ = "validation_evaluations"

    token_accuracy: Mapped[float] = mapped_column(Float)
    supervised_tokens: Mapped[int] = mapped_column(Integer)
    rows: Mapped[int] = mapped_column(Integer)
    evaluated_at: Mapped[datetime]


class Checkpoint(Base):
    """One published exact checkpoint (`checkpoints`, docs/checkpoints.md)."""

    __tablename__ = "checkpoints"

    job_id: Mapped[str] = mapped_column(ForeignKey("training_jobs.id", ondelete="CASCADE"), primary_key=True)
    checkpoint_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    basename: Mapped[str] = mapped_column(String(512), unique=True)
    path: Mapped[str] = mapped_column(String(1024))
    global_step: Mapped[int] = mapped_column(Integer)
    epoch_index: Mapped[int] = mapped_column(Integer)
    cursor: Mapped[int] = mapped_column(Integer)
    manifest_sha256: Mapped[str] = mapped_column(String(71))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    write_ms: Mapped[float | None] = mapped_column(Float)  # None: adopted, not timed
    created_at: Mapped[datetime]


class Adapter(Base):
    """One published PEFT adapter (`adapters`, docs/artifacts.md#peft-adapter); soft-deleted by name."""

    __tablename__ = "adapters"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    job_id: Mapped[str | None] = mapped_column(
        ForeignKey("training_jobs.id", ondelete="SET NULL"), index=True
    )
    path: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[datetime]
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    safetensors_sha256: Mapped[str] = mapped_column(String(71))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    base_model_sha256: Mapped[str | None] = mapped_column(String(71))
    deleted_at: Mapped[datetime | None]


class Runner(Base):
    """A resident worker's identity and heartbeat (`runners`, docs/ARCHITECTURE.md#processes)."""

    __tablename__ = "runners"
    __table_args__ = (CheckConstraint(f"state IN ({_in(states.RUNNER_STATES)})", name="state"),)

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    backend: Mapped[str] = mapped_column(String(16))
    device: Mapped[str] = mapped_column(String(64))
    base_weight_dtype: Mapped[str] = mapped_column(String(16))
    lora_dtype: Mapped[str] = mapped_column(String(16))
    loss_route: Mapped[str] = mapped_column(String(32))
    optimizer_support: Mapped[dict[str, Any]]
    execution_identity_digest: Mapped[str] = mapped_column(String(71))
    model_path: Mapped[str] = mapped_column(String(1024))
    model_config: Mapped[dict[str, Any]]
    free_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    total_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    started_at: Mapped[datetime]
    heartbeat_at: Mapped[datetime] = mapped_column(index=True)
    state: Mapped[str] = mapped_column(String(16))
    current_job_id: Mapped[str | None] = mapped_column(String(64))
