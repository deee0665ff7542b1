"""Drills record their outcome (``passed``, ``failed``, ``not judged``) and the stack they ran on.

A drill that could not judge the checkpoint (no model given, a factory that
does not fit, an unsupported variant, no device, a crash in the drill's own
setup) is kept as history but never counts as the checkpoint's most recent
drill: ``outcome`` says which drills judged. Rows written before have none
(NULL) and are read by their ``ok``: passed or failed. ``stack`` holds the
versions the drill ran on (python, torch, CUDA, the format's libraries), so
that a checkpoint that passed under one stack and fails under another is
reported as environment drift.

Revision ID: drill_0001
Revises: safeio_0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "drill_0001"
down_revision: str | None = "safeio_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("drills") as batch:
        batch.add_column(sa.Column("outcome", sa.String(16), nullable=True))
        batch.add_column(sa.Column("stack", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("drills") as batch:
        batch.drop_column("stack")
        batch.drop_column("outcome")
