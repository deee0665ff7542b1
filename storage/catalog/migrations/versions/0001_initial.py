"""Initial catalog schema: jobs, checkpoints, files, copies, decisions, events, drills, scans.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(512), nullable=False),
        sa.Column("hot_url", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.UniqueConstraint("name", name="uq_jobs_name"),
    )
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("format", sa.String(32), nullable=False),
        sa.Column("location", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("state_reason", sa.Text(), nullable=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("file_count", sa.Integer(), nullable=False),
        sa.Column("saved_at", sa.DateTime(), nullable=True),
        sa.Column("first_seen", sa.DateTime(), nullable=False),
        sa.Column("last_seen", sa.DateTime(), nullable=False),
        sa.Column("missing_since", sa.DateTime(), nullable=True),
        sa.Column("verified_at", sa.DateTime(), nullable=True),
        sa.Column("recorded_loss", sa.Float(), nullable=True),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("lease_owner", sa.String(256), nullable=True),
        sa.Column("lease_expires", sa.DateTime(), nullable=True),
        sa.UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),
    )
    op.create_index("ix_checkpoints_state", "checkpoints", ["state"])
    op.create_index("ix_checkpoints_location", "checkpoints", ["location"])
    op.create_table(
        "files",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "checkpoint_id",
            sa.Integer(),
            sa.ForeignKey("checkpoints.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("relpath", sa.Text(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("mtime", sa.Float(), nullable=True),
        sa.Column("etag", sa.String(256), nullable=True),
        sa.Column("crc64nvme", sa.String(32), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=True),
        sa.Column("sha256_expected", sa.String(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("verified_at", sa.DateTime(), nullable=True),
        sa.UniqueConstraint("checkpoint_id", "relpath", name="uq_files_checkpoint_relpath"),
    )
    op.create_table(
        "copies",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "checkpoint_id",
            sa.Integer(),
            sa.ForeignKey("checkpoints.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("stored_bytes", sa.BigInteger(), nullable=True),
        sa.Column("codec", sa.String(64), nullable=True),
        sa.Column("manifest_key", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("verified_at", sa.DateTime(), nullable=True),
        sa.UniqueConstraint("checkpoint_id", "tier", "url", name="uq_copies_checkpoint_tier_url"),
    )
    op.create_table(
        "decisions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "checkpoint_id",
            sa.Integer(),
            sa.ForeignKey("checkpoints.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("reasons", sa.JSON(), nullable=False),
        sa.Column("policy", sa.Text(), nullable=False),
    )
    op.create_index("ix_decisions_checkpoint_at", "decisions", ["checkpoint_id", "at"])
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="SET NULL"), nullable=True),
        sa.Column(
            "checkpoint_id",
            sa.Integer(),
            sa.ForeignKey("checkpoints.id", ondelete="SET NULL"),
            nullable=True,
        ),
        sa.Column("data", sa.JSON(), nullable=True),
    )
    op.create_index("ix_events_at", "events", ["at"])
    op.create_index("ix_events_job_at", "events", ["job_id", "at"])
    op.create_index("ix_events_checkpoint", "events", ["checkpoint_id"])
    op.create_table(
        "drills",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column(
            "checkpoint_id",
            sa.Integer(),
            sa.ForeignKey("checkpoints.id", ondelete="SET NULL"),
            nullable=True,
        ),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("device", sa.String(64), nullable=True),
        sa.Column("source_tier", sa.String(16), nullable=True),
        sa.Column("verdict", sa.JSON(), nullable=True),
        sa.Column("timings", sa.JSON(), nullable=True),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_index("ix_drills_job_started", "drills", ["job_id", "started_at"])
    op.create_table(
        "scans",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("objects", sa.Integer(), nullable=False),
        sa.Column("checkpoints", sa.Integer(), nullable=False),
        sa.Column("unrecognised", sa.Integer(), nullable=False),
        sa.Column("rows_written", sa.Integer(), nullable=False),
    )
    op.create_index("ix_scans_url_started", "scans", ["url", "started_at"])


def downgrade() -> None:
    for index, table in [
        ("ix_scans_url_started", "scans"),
        ("ix_drills_job_started", "drills"),
        ("ix_events_checkpoint", "events"),
        ("ix_events_job_at", "events"),
        ("ix_events_at", "events"),
        ("ix_decisions_checkpoint_at", "decisions"),
        ("ix_checkpoints_location", "checkpoints"),
        ("ix_checkpoints_state", "checkpoints"),
    ]:
        op.drop_index(index, table_name=table)
    for table in ["scans", "drills", "events", "decisions", "copies", "files", "checkpoints", "jobs"]:
        op.drop_table(table)
