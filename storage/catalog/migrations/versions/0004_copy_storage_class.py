"""Copies record their storage class (S3: STANDARD, GLACIER_IR, GLACIER...).

Revision ID: 0004
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("copies") as batch:
        batch.add_column(sa.Column("storage_class", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("copies") as batch:
        batch.drop_column("storage_class")
