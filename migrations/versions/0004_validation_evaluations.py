"""Held-out validation: the pinned validation source and the evaluations of each job.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

- `prepared_sft_admissions.validation` (JSON, NULL without validation): the request's
  `validation` object as admitted, which the worker re-derives at dequeue (docs/validation.md).
- `validation_evaluations`: one row per evaluation of a job's validation rows (global step 0 is
  the baseline), written under the run's claim like `training_steps`.
- `v_validation_curve`: the evaluations with the job's adapter name, for SQL questions
  (deploy/queries.sql).

Plain SQL and batch operations, so SQLite and PostgreSQL take the same revision both ways.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from migrations.curves import create_curve_table, create_curve_view

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TIMESTAMP = sa.DateTime(timezone=True)
JSON_TYPE = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("prepared_sft_admissions") as batch:
        batch.add_column(sa.Column("validation", JSON_TYPE, nullable=True))
    create_curve_table(
        "validation_evaluations",
        sa.Column("token_accuracy", sa.Float(), nullable=False),
        sa.Column("supervised_tokens", sa.Integer(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("evaluated_at", TIMESTAMP, nullable=False),
    )
    columns = ("token_accuracy", "supervised_tokens", "rows", "evaluated_at")
    create_curve_view("v_validation_curve", "validation_evaluations", "v", columns)


def downgrade() -> None:
    op.execute("DROP VIEW v_validation_curve")
    op.drop_table("validation_evaluations")
    with op.batch_alter_table("prepared_sft_admissions") as batch:
        batch.drop_column("validation")
