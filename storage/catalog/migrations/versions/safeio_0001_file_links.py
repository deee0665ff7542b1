"""Files record the symlink they are (``link``: the key, inside the scanned root,
of the regular file a link points at), so that a checkpoint whose file links
into another one is known to depend on it, and a link is never taken for the
bytes it points at.

Revision ID: safeio_0001
Revises: retention_0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "safeio_0001"
down_revision: str | None = "retention_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("link", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.drop_column("link")
