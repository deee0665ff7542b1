"""Directory stamps: what a local scan saw of each checkpoint directory's tree,
so that an unchanged rescan can skip listing it.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "dir_stamps",
        sa.Column("checkpoint_id", sa.Integer(), sa.ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("location", sa.Text(), nullable=False),
        sa.Column("stamp", sa.String(64), nullable=False),
        sa.Column("dirs", sa.Text(), nullable=False),
        sa.Column("taken_at", sa.DateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("dir_stamps")
