"""An adopted checkpoint has no measured write time.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

A checkpoint that a lost worker published but did not live to record is adopted by the next
attempt: its row is written afterwards, by someone who did not time the write, so
`checkpoints.write_ms` becomes nullable (NULL: not measured).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.alter_column("write_ms", existing_type=sa.Float(), nullable=True)


def downgrade() -> None:
    op.execute("UPDATE checkpoints SET write_ms = 0 WHERE write_ms IS NULL")
    with op.batch_alter_table("checkpoints") as batch:
        batch.alter_column("write_ms", existing_type=sa.Float(), nullable=False)
