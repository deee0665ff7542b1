"""Checkpoints record when a verification last finished (``checked_at``), whatever it found.

Workers that share one catalog claim rows to verify under a lease; a row
whose ``checked_at`` is at or after the start of their sweep is done, so each
checkpoint is verified once per sweep even when it stays ``committed`` (only
read errors) or is read again on purpose (a deep sweep).

Revision ID: 0008
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("checked_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("checked_at")
