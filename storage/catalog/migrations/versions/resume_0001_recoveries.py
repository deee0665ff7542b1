"""Recovery events: every ``ckptier resume`` (and ``ckptier.resume()``) call.

One row per call: the job asked about (a name, not a reference: an attempt
for a name the catalog does not know is an attempt too), when it started and
how long it took, the outcome (``resumed`` or ``failed``), the step chosen
and where it is loaded from, how it was proven (``full`` or ``quick``), the
newer checkpoints passed over with why, and the error of a failed call.
They give the recovery rate: resumes succeeded / attempted per job.

Revision ID: resume_0001
Revises: drill_0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = "resume_0001"
down_revision: str | None = "drill_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "recoveries",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job", sa.String(512), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("checkpoint_id", sa.Integer(), sa.ForeignKey("checkpoints.id", ondelete="SET NULL"), nullable=True),
        sa.Column("verify", sa.String(8), nullable=False),
        sa.Column("source", sa.String(16), nullable=True),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("passed_over", sa.JSON(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_index("ix_recoveries_job_started", "recoveries", ["job", "started_at"])


def downgrade() -> None:
    op.drop_index("ix_recoveries_job_started", table_name="recoveries")
    op.drop_table("recoveries")
