"""The request's `config` as sent, beside the effective config the admission pinned.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05

- `prepared_sft_admissions.requested_config` (JSON, NULL for jobs admitted before it existed):
  the fields of the request's `config` that the client set, as it set them. The worker hands it
  to the run, which records it in the receipt as `requested_config` next to `config` (the
  effective config), so "asked vs ran" can be read from the artifacts (docs/artifacts.md).

Plain batch operations, so SQLite and PostgreSQL take the same revision both ways.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON_TYPE = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("prepared_sft_admissions") as batch:
        batch.add_column(sa.Column("requested_config", JSON_TYPE, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("prepared_sft_admissions") as batch:
        batch.drop_column("requested_config")
