"""Views for people asking SQL questions of job history (docs/ARCHITECTURE.md#job-store; deploy/queries.sql).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

Plain SQL that runs on SQLite and Postgres alike; the one difference, the length of a time
interval in seconds, is branched on the dialect.

- v_job_history: one row per job with the columns people filter on, durations in seconds.
- v_loss_curve: one row per optimizer step (the loss curve), with the job's adapter name.
- v_failures_by_reason: failed jobs per failure_reason, with the last time it happened.
- v_throughput_by_rank_optimizer: step time and tokens per second per (lora_rank, optimizer).
- v_queue: queued jobs with their 1-based FIFO position.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from migrations.curves import create_curve_view

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

VIEWS = ("v_job_history", "v_loss_curve", "v_failures_by_reason", "v_throughput_by_rank_optimizer", "v_queue")


def _seconds_between(start: str, end: str) -> str:
    """SQL for `end - start` in seconds (a float; NULL when either is NULL)."""
    if op.get_bind().dialect.name == "postgresql":
        return f"CAST(EXTRACT(EPOCH FROM ({end} - {start})) AS DOUBLE PRECISION)"
    # SQLite keeps timestamps as UTC text; julianday() reads them as fractional days.
    return f"((julianday({end}) - julianday({start})) * 86400.0)"


def upgrade() -> None:
    _create_v_job_history()
    _create_v_loss_curve()
    _create_v_failures_by_reason()
    _create_v_throughput_by_rank_optimizer()
    _create_v_queue()


def _create_v_job_history() -> None:
    op.execute(
        f"""
        CREATE VIEW v_job_history AS
        SELECT
            j.id AS job_id,
            j.job_type,
            j.state,
            j.failure_reason,
            j.error_code,
            j.error_message,
            j.adapter_name,
            j.effective_seed,
            j.optimizer_kind,
            j.learning_rate,
            j.lora_rank,
            j.lora_alpha,
            j.epochs,
            j.rows_kept,
            j.total_steps,
            j.global_step,
            j.final_loss,
            j.loss_route,
            j.backend,
            j.device,
            j.peak_memory_bytes,
            j.wall_clock_ms,
            j.attempts,
            j.worker_id,
            j.cancel_requested,
            j.submitted_at,
            j.started_at,
            j.finished_at,
            {_seconds_between("j.submitted_at", "j.started_at")} AS queue_wait_seconds,
            {_seconds_between("j.started_at", "j.finished_at")} AS duration_seconds,
            j.deleted_at
        FROM training_jobs j
        """
    )


def _create_v_loss_curve() -> None:
    columns = ("learning_rate", "step_ms", "tokens", "supervised_tokens", "created_at")
    create_curve_view("v_loss_curve", "training_steps", "s", columns)


def _create_v_failures_by_reason() -> None:
    op.execute(
        """
        CREATE VIEW v_failures_by_reason AS
        SELECT
            j.failure_reason,
            COUNT(*) AS jobs,
            MAX(j.finished_at) AS last_seen
        FROM training_jobs j
        WHERE j.state = 'failed'
        GROUP BY j.failure_reason
        """
    )


def _create_v_throughput_by_rank_optimizer() -> None:
    op.execute(
        """
        CREATE VIEW v_throughput_by_rank_optimizer AS
        SELECT
            j.lora_rank,
            j.optimizer_kind,
            COUNT(DISTINCT s.job_id) AS jobs,
            COUNT(*) AS steps,
            AVG(s.step_ms) AS mean_step_ms,
            CAST(SUM(s.tokens) AS DOUBLE PRECISION) * 1000.0 / NULLIF(SUM(s.step_ms), 0) AS tokens_per_second
        FROM training_steps s
        JOIN training_jobs j ON j.id = s.job_id
        GROUP BY j.lora_rank, j.optimizer_kind
        """
    )


def _create_v_queue() -> None:
    op.execute(
        """
        CREATE VIEW v_queue AS
        SELECT
            j.id AS job_id,
            j.adapter_name,
            j.submitted_at,
            ROW_NUMBER() OVER (ORDER BY j.queue_seq) AS position
        FROM training_jobs j
        WHERE j.state = 'queued' AND j.deleted_at IS NULL
        """
    )


def downgrade() -> None:
    for view in reversed(VIEWS):
        op.execute(f"DROP VIEW {view}")
