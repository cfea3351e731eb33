"""Job store tables: training_jobs, prepared_sft_admissions, job_events, training_steps,
checkpoints, adapters, runners (docs/ARCHITECTURE.md#job-store).

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Written from autogenerate output and reviewed. The types are spelled here, not imported from
the models, so this revision stays what it was when the models move on:
`TIMESTAMP` matches `kiln.store.models.UtcDateTime` (timestamptz on Postgres) and `JSON_TYPE`
matches `kiln.store.models.JSONType`.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from migrations.curves import create_curve_table, job_foreign_key

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)
JSON_TYPE = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")
QUEUE_SEQ = "training_jobs_queue_seq"


def _is_postgres() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    if _is_postgres():
        # Admission order; SQLite has no sequences and takes max(queue_seq) + 1 under its write lock.
        op.execute(sa.schema.CreateSequence(sa.Sequence(QUEUE_SEQ)))
    _create_runners()
    _create_training_jobs()
    _create_adapters()
    _create_checkpoints()
    _create_job_events()
    _create_prepared_sft_admissions()
    _create_training_steps()


def _create_runners() -> None:
    op.create_table(
        "runners",
        sa.Column("id", sa.String(255), nullable=False),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("backend", sa.String(16), nullable=False),
        sa.Column("device", sa.String(64), nullable=False),
        sa.Column("base_weight_dtype", sa.String(16), nullable=False),
        sa.Column("lora_dtype", sa.String(16), nullable=False),
        sa.Column("loss_route", sa.String(32), nullable=False),
        sa.Column("optimizer_support", JSON_TYPE, nullable=False),
        sa.Column("execution_identity_digest", sa.String(71), nullable=False),
        sa.Column("model_path", sa.String(1024), nullable=False),
        sa.Column("model_config", JSON_TYPE, nullable=False),
        sa.Column("free_memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("total_memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("started_at", TIMESTAMP, nullable=False),
        sa.Column("heartbeat_at", TIMESTAMP, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("current_job_id", sa.String(64), nullable=True),
        sa.CheckConstraint(
            "state IN ('starting', 'ready', 'busy', 'stopped')", name=op.f("ck_runners_state")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runners")),
    )
    op.create_index(op.f("ix_runners_heartbeat_at"), "runners", ["heartbeat_at"])


def _create_training_jobs() -> None:
    op.create_table(
        "training_jobs",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("job_type", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("failure_reason", sa.String(64), nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("submitted_at", TIMESTAMP, nullable=False),
        sa.Column("started_at", TIMESTAMP, nullable=True),
        sa.Column("finished_at", TIMESTAMP, nullable=True),
        sa.Column("published_at", TIMESTAMP, nullable=True),
        sa.Column("deleted_at", TIMESTAMP, nullable=True),
        sa.Column("queue_seq", sa.BigInteger(), nullable=False),
        sa.Column("adapter_name", sa.String(255), nullable=False),
        sa.Column("effective_seed", sa.String(20), nullable=False),
        sa.Column("optimizer_kind", sa.String(32), nullable=False),
        sa.Column("learning_rate", sa.Float(), nullable=False),
        sa.Column("lora_rank", sa.Integer(), nullable=False),
        sa.Column("lora_alpha", sa.Float(), nullable=False),
        sa.Column("epochs", sa.Integer(), nullable=False),
        sa.Column("rows_kept", sa.Integer(), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=False),
        sa.Column("loss_route", sa.String(32), nullable=False),
        sa.Column("backend", sa.String(16), nullable=False),
        sa.Column("device", sa.String(64), nullable=False),
        sa.Column("resume_checkpoint", sa.String(512), nullable=True),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("request_fingerprint", sa.String(71), nullable=False),
        sa.Column("global_step", sa.Integer(), nullable=False),
        sa.Column("current_epoch", sa.Integer(), nullable=True),
        sa.Column("current_loss", sa.Float(), nullable=True),
        sa.Column("final_loss", sa.Float(), nullable=True),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("wall_clock_ms", sa.BigInteger(), nullable=True),
        sa.Column("latest_checkpoint", sa.String(512), nullable=True),
        sa.Column("adapter_path", sa.String(1024), nullable=True),
        sa.Column("receipt", JSON_TYPE, nullable=True),
        sa.Column("worker_id", sa.String(255), nullable=True),
        sa.Column("lease_expires_at", TIMESTAMP, nullable=True),
        sa.Column("heartbeat_at", TIMESTAMP, nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("cancel_requested_at", TIMESTAMP, nullable=True),
        sa.CheckConstraint("job_type IN ('sft')", name=op.f("ck_training_jobs_job_type")),
        sa.CheckConstraint(
            "state IN ('queued', 'running', 'completed', 'failed')", name=op.f("ck_training_jobs_state")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_jobs")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_training_jobs_idempotency_key")),
        sa.UniqueConstraint("queue_seq", name=op.f("uq_training_jobs_queue_seq")),
    )
    op.create_index(op.f("ix_training_jobs_adapter_name"), "training_jobs", ["adapter_name"])
    op.create_index(op.f("ix_training_jobs_failure_reason"), "training_jobs", ["failure_reason"])
    op.create_index(op.f("ix_training_jobs_state"), "training_jobs", ["state"])
    op.create_index("ix_training_jobs_state_queue_seq", "training_jobs", ["state", "queue_seq"])
    op.create_index(op.f("ix_training_jobs_submitted_at"), "training_jobs", ["submitted_at"])


def _create_adapters() -> None:
    op.create_table(
        "adapters",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("safetensors_sha256", sa.String(71), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("base_model_sha256", sa.String(71), nullable=True),
        sa.Column("deleted_at", TIMESTAMP, nullable=True),
        job_foreign_key("adapters", ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_adapters")),
    )
    op.create_index(op.f("ix_adapters_job_id"), "adapters", ["job_id"])


def _create_checkpoints() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("checkpoint_id", sa.String(64), nullable=False),
        sa.Column("basename", sa.String(512), nullable=False),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("global_step", sa.Integer(), nullable=False),
        sa.Column("epoch_index", sa.Integer(), nullable=False),
        sa.Column("cursor", sa.Integer(), nullable=False),
        sa.Column("manifest_sha256", sa.String(71), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("write_ms", sa.Float(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        job_foreign_key("checkpoints", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "checkpoint_id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("basename", name=op.f("uq_checkpoints_basename")),
    )


def _create_job_events() -> None:
    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("level", sa.String(16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", JSON_TYPE, nullable=True),
        sa.CheckConstraint(
            "level IN ('debug', 'info', 'warning', 'error')", name=op.f("ck_job_events_level")
        ),
        job_foreign_key("job_events", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_events")),
    )
    op.create_index("ix_job_events_job_id_id", "job_events", ["job_id", "id"])
    op.create_index(op.f("ix_job_events_kind"), "job_events", ["kind"])


def _create_prepared_sft_admissions() -> None:
    op.create_table(
        "prepared_sft_admissions",
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("loss_route", sa.String(32), nullable=False),
        sa.Column("optimizer", JSON_TYPE, nullable=False),
        sa.Column("checkpoint_plan", JSON_TYPE, nullable=False),
        sa.Column("memory_estimate_bytes", sa.BigInteger(), nullable=False),
        sa.Column("memory_breakdown", JSON_TYPE, nullable=False),
        sa.Column("execution_identity_digest", sa.String(71), nullable=False),
        sa.Column("runner_id", sa.String(255), nullable=False),
        sa.Column("ingestion_receipt", JSON_TYPE, nullable=False),
        sa.Column("ingestion_receipt_sha256", sa.String(71), nullable=False),
        sa.Column("kept_corpus_sha256", sa.String(71), nullable=False),
        sa.Column("effective_config", JSON_TYPE, nullable=False),
        sa.Column("data_source", sa.String(16), nullable=False),
        sa.Column("examples", JSON_TYPE, nullable=True),
        sa.Column("dataset_path", sa.String(1024), nullable=True),
        sa.Column("max_seq_len", sa.Integer(), nullable=False),
        sa.Column("max_supervised_tokens", sa.Integer(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
        sa.CheckConstraint(
            "(data_source = 'examples' AND examples IS NOT NULL AND dataset_path IS NULL)"
            " OR (data_source = 'dataset_path' AND examples IS NULL AND dataset_path IS NOT NULL)",
            name=op.f("ck_prepared_sft_admissions_one_data_transport"),
        ),
        sa.CheckConstraint(
            "data_source IN ('examples', 'dataset_path')", name=op.f("ck_prepared_sft_admissions_data_source")
        ),
        job_foreign_key("prepared_sft_admissions", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_prepared_sft_admissions")),
    )


def _create_training_steps() -> None:
    create_curve_table(
        "training_steps",
        sa.Column("learning_rate", sa.Float(), nullable=False),
        sa.Column("step_ms", sa.Float(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("supervised_tokens", sa.Integer(), nullable=False),
        sa.Column("created_at", TIMESTAMP, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("training_steps")
    op.drop_table("prepared_sft_admissions")
    op.drop_index("ix_job_events_job_id_id", table_name="job_events")
    op.drop_index(op.f("ix_job_events_kind"), table_name="job_events")
    op.drop_table("job_events")
    op.drop_table("checkpoints")
    op.drop_index(op.f("ix_adapters_job_id"), table_name="adapters")
    op.drop_table("adapters")
    for index in ("adapter_name", "failure_reason", "state", "submitted_at"):
        op.drop_index(op.f(f"ix_training_jobs_{index}"), table_name="training_jobs")
    op.drop_index("ix_training_jobs_state_queue_seq", table_name="training_jobs")
    op.drop_table("training_jobs")
    op.drop_index(op.f("ix_runners_heartbeat_at"), table_name="runners")
    op.drop_table("runners")
    if _is_postgres():
        op.execute(sa.schema.DropSequence(sa.Sequence(QUEUE_SEQ)))
