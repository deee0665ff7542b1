"""Checkpoints record the metrics their run wrote (``metrics``: JSON, name -> number).

Read at scan time from the checkpoint's own files (Hugging Face
``trainer_state.json``, Orbax ``_CHECKPOINT_METADATA``, the guide's
``metadata.json``, a Lightning file name) and the job's ``metrics.jsonl``, so
that ``keep_best`` plans from the catalog alone.

Revision ID: retention_0001
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "retention_0001"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("metrics", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("metrics")
