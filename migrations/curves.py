"""What revisions share: the foreign key of a job's rows, a curve table (one row per job and
global step, deleted with its job: `training_steps` in 0001, `validation_evaluations` in 0004), and
a curve's people view with the job's adapter name (`v_loss_curve` in 0002, `v_validation_curve` in
0004).

Revisions that are already applied call these, so what they create must never change; a new
shape belongs in a new function. Like the revisions, nothing here imports the models.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


def job_foreign_key(table: str, *, ondelete: str) -> sa.ForeignKeyConstraint:
    """`<table>.job_id` references `training_jobs.id`."""
    return sa.ForeignKeyConstraint(
        ["job_id"],
        ["training_jobs.id"],
        name=op.f(f"fk_{table}_job_id_training_jobs"),
        ondelete=ondelete,
    )


def create_curve_table(table: str, *columns: sa.Column) -> None:
    """`table`: job_id, global_step, epoch, loss, then `columns`; keyed by (job_id, global_step)."""
    op.create_table(
        table,
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("global_step", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=False),
        *columns,
        job_foreign_key(table, ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "global_step", name=op.f(f"pk_{table}")),
    )


def create_curve_view(view: str, table: str, alias: str, columns: tuple[str, ...]) -> None:
    """`view`: every row of curve `table` (`alias`) with its job's adapter name after the job id."""
    names = [f"{alias}.{c}" for c in ("job_id", "global_step", "epoch", "loss", *columns)]
    names.insert(1, "j.adapter_name")
    select = ",\n".join(f"            {name}" for name in names)
    # One statement text on both databases; SQLite keeps it verbatim in sqlite_master.
    op.execute(
        f"""
        CREATE VIEW {view} AS
        SELECT
{select}
        FROM {table} {alias}
        JOIN training_jobs j ON j.id = {alias}.job_id
        """
    )
