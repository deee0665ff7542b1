"""Lease holders (host, pid, process start) and delete intents on checkpoints.

A lease records which process holds it, so that a run finding the holder's
process gone (same host, pid no longer running, or running a process started
at another time) can take the lease over at once instead of waiting for it
to expire. A delete intent is written, fenced by the lease, before any file
of a checkpoint is deleted, so that a run killed half-way through a delete
leaves a record a rescan or the next apply resolves.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("lease_host", sa.String(256), nullable=True))
        batch.add_column(sa.Column("lease_pid", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("lease_started", sa.String(64), nullable=True))
        batch.add_column(sa.Column("delete_intent", sa.String(16), nullable=True))
        batch.add_column(sa.Column("delete_intent_at", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("delete_intent_files", sa.Integer(), nullable=True))
    op.create_index("ix_checkpoints_delete_intent", "checkpoints", ["delete_intent"])


def downgrade() -> None:
    op.drop_index("ix_checkpoints_delete_intent", table_name="checkpoints")
    with op.batch_alter_table("checkpoints") as batch:
        for column in ("delete_intent_files", "delete_intent_at", "delete_intent", "lease_started", "lease_pid", "lease_host"):
            batch.drop_column(column)
