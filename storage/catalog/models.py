"""SQLAlchemy 2 tables of the catalog.

The schema itself is created and changed only by the Alembic migrations in
``migrations/versions``; these classes describe it to the query code and are
checked against the migrated schema by the test suite (no autogenerate drift).

Conventions:

* Every time column is :class:`UTCDateTime`: stored as naive UTC, returned as
  timezone-aware UTC on SQLite and PostgreSQL alike.
* States, formats and tiers are stored as their string values (the enums in
  :mod:`ckptier.storage.model`), not as database enums, so that adding a
  format needs no migration.
* Hashes are text: ``sha256`` as lowercase hex, ``crc64nvme`` as base64.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator[datetime]):
    """A ``DateTime`` that only accepts aware datetimes and returns aware UTC.

    Binding a naive datetime raises ``ValueError``: the catalog cannot know
    which zone it meant. Values are converted to UTC and stored without a
    zone (``TIMESTAMP WITHOUT TIME ZONE`` on PostgreSQL, ISO text on SQLite),
    so both backends store and compare the same thing.
    """

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(
                f"naive datetime {value.isoformat()} given to the catalog; pass an aware UTC "
                "datetime such as datetime.now(timezone.utc)"
            )
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is not None:
            return value.astimezone(UTC)
        return value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON, list[Any]: JSON}


class Job(Base):
    """A training job: a named series of checkpoints."""

    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("name", name="uq_jobs_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(512))
    # URL of the directory holding the job's checkpoints in the hot store;
    # NULL for a job known only from an event.
    hot_url: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Checkpoint(Base):
    """One checkpoint (a step of a job), its lease for fenced operations and any pending delete."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),
        Index("ix_checkpoints_state", "state"),
        Index("ix_checkpoints_location", "location"),
        Index("ix_checkpoints_delete_intent", "delete_intent"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    format: Mapped[str] = mapped_column(String(32))
    location: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))
    state_reason: Mapped[str | None] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(BigInteger)
    file_count: Mapped[int] = mapped_column(Integer)
    saved_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    first_seen: Mapped[datetime] = mapped_column(UTCDateTime())
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime())
    missing_since: Mapped[datetime | None] = mapped_column(UTCDateTime())
    verified_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    recorded_loss: Mapped[float | None] = mapped_column(Float)
    generation: Mapped[int] = mapped_column(BigInteger, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(256))
    lease_expires: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # The lease holder's process: a run finding it gone takes the lease over at once.
    lease_host: Mapped[str | None] = mapped_column(String(256))
    lease_pid: Mapped[int | None] = mapped_column(Integer)
    lease_started: Mapped[str | None] = mapped_column(String(64))  # process start, as leases.process_start gives it
    # Set (fenced by the lease) before any file is deleted; cleared by the tombstone.
    delete_intent: Mapped[str | None] = mapped_column(String(16))  # "checkpoint" / "hot-copy"
    delete_intent_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    delete_intent_files: Mapped[int | None] = mapped_column(Integer)  # files it was to delete


class File(Base):
    """A file of a checkpoint, as listed and as last verified."""

    __tablename__ = "files"
    __table_args__ = (UniqueConstraint("checkpoint_id", "relpath", name="uq_files_checkpoint_relpath"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    relpath: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column(BigInteger)
    mtime: Mapped[float | None] = mapped_column(Float)  # epoch seconds, as the store lists it
    etag: Mapped[str | None] = mapped_column(String(256))
    crc64nvme: Mapped[str | None] = mapped_column(String(32))  # base64
    sha256: Mapped[str | None] = mapped_column(String(64))  # hex, as last computed
    sha256_expected: Mapped[str | None] = mapped_column(String(64))  # hex, from format metadata
    status: Mapped[str | None] = mapped_column(String(16))  # None / ok / corrupt / error / missing
    detail: Mapped[str | None] = mapped_column(Text)
    verified_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Copy(Base):
    """Where a checkpoint's bytes live: one row per (tier, url)."""

    __tablename__ = "copies"
    __table_args__ = (
        UniqueConstraint("checkpoint_id", "tier", "url", name="uq_copies_checkpoint_tier_url"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    tier: Mapped[str] = mapped_column(String(16))
    url: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))  # present / missing / deleted / degraded
    stored_bytes: Mapped[int | None] = mapped_column(BigInteger)
    codec: Mapped[str | None] = mapped_column(String(64))
    manifest_key: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    verified_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    storage_class: Mapped[str | None] = mapped_column(String(32))  # S3 class of an archive copy, as confirmed


class Decision(Base):
    """A retention decision about one checkpoint, with the reasons given."""

    __tablename__ = "decisions"
    __table_args__ = (Index("ix_decisions_checkpoint_at", "checkpoint_id", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    action: Mapped[str] = mapped_column(String(32))
    reasons: Mapped[list[Any]] = mapped_column(JSON)
    policy: Mapped[str] = mapped_column(Text)


class Event(Base):
    """An append-only log line: state changes, tombstones, scan findings."""

    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_at", "at"),
        Index("ix_events_job_at", "job_id", "at"),
        Index("ix_events_checkpoint", "checkpoint_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime())
    kind: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id", ondelete="SET NULL"))
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Drill(Base):
    """One restore drill: what was restored from where, how long it took, the verdict."""

    __tablename__ = "drills"
    __table_args__ = (Index("ix_drills_job_started", "job_id", "started_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id", ondelete="SET NULL"))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    ok: Mapped[bool] = mapped_column(Boolean)
    device: Mapped[str | None] = mapped_column(String(64))
    source_tier: Mapped[str | None] = mapped_column(String(16))
    verdict: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    timings: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    error: Mapped[str | None] = mapped_column(Text)


class Scan(Base):
    """Statistics of a scan that changed the catalog (unchanged rescans leave no row)."""

    __tablename__ = "scans"
    __table_args__ = (Index("ix_scans_url_started", "url", "started_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    url: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    objects: Mapped[int] = mapped_column(Integer)
    checkpoints: Mapped[int] = mapped_column(Integer)
    unrecognised: Mapped[int] = mapped_column(Integer)
    rows_written: Mapped[int] = mapped_column(Integer)


class DirStamp(Base):
    """What a local scan saw of a checkpoint directory's tree, so that an
    unchanged rescan can skip listing it (see :mod:`ckptier.tasks.scan`).

    ``stamp`` digests the directory's mtime, link count and entry count and
    every subdirectory's mtime and link count; ``dirs`` lists those
    subdirectories (relative, one per line), which the next scan stats.
    ``location`` is the checkpoint's hot location when the stamp was taken.
    """

    __tablename__ = "dir_stamps"

    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True)
    location: Mapped[str] = mapped_column(Text)
    stamp: Mapped[str] = mapped_column(String(64))
    dirs: Mapped[str] = mapped_column(Text)
    taken_at: Mapped[datetime] = mapped_column(UTCDateTime())


jobs = cast(Table, Job.__table__)
checkpoints = cast(Table, Checkpoint.__table__)
files = cast(Table, File.__table__)
copies = cast(Table, Copy.__table__)
decisions = cast(Table, Decision.__table__)
events = cast(Table, Event.__table__)
drills = cast(Table, Drill.__table__)
scans = cast(Table, Scan.__table__)
dir_stamps = cast(Table, DirStamp.__table__)
