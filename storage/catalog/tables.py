"""SQLAlchemy 2 tables of the catalog.

The schema itself is created and changed only by the Alembic migrations in
``migrations/versions``; these tables describe it to the query code and are
checked against the migrated schema by the test suite (no autogenerate drift).
They are SQLAlchemy Core tables, not ORM classes: the catalog's queries are
Core statements, and not importing ``sqlalchemy.orm`` (about 0.15 s) keeps
``ckptier latest`` close to the cost of ``import sqlalchemy``.

Conventions:

* Every time column is :class:`UTCDateTime`: stored as naive UTC, returned as
  timezone-aware UTC on SQLite and PostgreSQL alike.
* States, formats and tiers are stored as their string values (the enums in
  :mod:`ckptier.storage.records`), not as database enums, so that adding a
  format needs no migration.
* Hashes are text: ``sha256`` as lowercase hex, ``crc64nvme`` as base64.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.types import TypeDecorator, TypeEngine


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

    def result_processor(self, dialect: Dialect, coltype: object) -> Callable[[Any], datetime | None]:
        """The driver's value to an aware UTC datetime in one call (a listing of 100,000
        checkpoints converts 700,000 of them; the default chain costs twice as much)."""
        parse = self.impl_instance.dialect_impl(dialect).result_processor(dialect, coltype)

        def process(value: Any) -> datetime | None:
            if value is None:
                return None
            if parse is not None:
                value = parse(value)
            moment: datetime = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
            return moment

        if dialect.name != "sqlite":
            return process

        def process_text(value: Any) -> datetime | None:
            # SQLite keeps naive UTC as ISO text: read it as UTC in one C call, about a fifth of
            # parsing and then replacing the zone; anything else (an offset, not text) goes the long way.
            if value is None:
                return None
            try:
                return datetime.fromisoformat(value + "+00:00")
            except (TypeError, ValueError):
                return process(value)

        return process_text


metadata = MetaData()


class Base:
    """What Alembic's ``env.py`` and the schema test compare against: ``Base.metadata``."""

    metadata = metadata


def _id() -> Column[int]:
    return Column("id", Integer, primary_key=True)


_Type = TypeEngine[Any] | type[TypeEngine[Any]]


def _required(name: str, type_: _Type) -> Column[Any]:
    return Column(name, type_, nullable=False)


def _optional(name: str, type_: _Type) -> Column[Any]:
    return Column(name, type_, nullable=True)


#: A training job: a named series of checkpoints. ``hot_url`` is the URL of the
#: directory holding the job's checkpoints in the hot store; NULL for a job
#: known only from an event.
jobs = Table(
    "jobs", metadata,
    _id(),
    _required("name", String(512)),
    _optional("hot_url", Text),
    _required("created_at", UTCDateTime()),
    UniqueConstraint("name", name="uq_jobs_name"),
)

#: One checkpoint (a step of a job), its lease for fenced operations and any pending delete.
checkpoints = Table(
    "checkpoints", metadata,
    _id(),
    Column("job_id", ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    _required("step", BigInteger),
    _required("format", String(32)),
    _required("location", Text),
    _required("state", String(16)),
    _optional("state_reason", Text),
    _required("bytes", BigInteger),
    _required("file_count", Integer),
    _optional("saved_at", UTCDateTime()),
    _required("first_seen", UTCDateTime()),
    _required("last_seen", UTCDateTime()),
    _optional("missing_since", UTCDateTime()),
    _optional("verified_at", UTCDateTime()),
    # When a verification last finished, whatever it found (workers sharing the catalog skip rows
    # checked since their sweep began).
    _optional("checked_at", UTCDateTime()),
    _optional("recorded_loss", Float),
    # What the run recorded about the checkpoint: JSON {name: number}, sorted by name (keep_best).
    _optional("metrics", Text),
    Column("generation", BigInteger, nullable=False, default=0),
    _optional("lease_owner", String(256)),
    _optional("lease_expires", UTCDateTime()),
    # The lease holder's process: a run finding it gone takes the lease over at once.
    _optional("lease_host", String(256)),
    _optional("lease_pid", Integer),
    _optional("lease_started", String(64)),  # process start, as leases.process_start gives it
    # Set (fenced by the lease) before any file is deleted; cleared by the tombstone.
    _optional("delete_intent", String(16)),  # "checkpoint" / "hot-copy"
    _optional("delete_intent_at", UTCDateTime()),
    _optional("delete_intent_files", Integer),  # files it was to delete
    UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),
    Index("ix_checkpoints_state", "state"),
    Index("ix_checkpoints_location", "location"),
    Index("ix_checkpoints_delete_intent", "delete_intent"),
)

#: A file of a checkpoint, as listed and as last verified. ``mtime`` is epoch
#: seconds as the store lists it; ``crc64nvme`` base64; ``sha256`` hex as last
#: computed, ``sha256_expected`` hex from the format's metadata; ``status``
#: None / ok / corrupt / error / missing; ``link`` the key (inside the scanned
#: root) of the regular file a symlink points at, for a file that is a symlink.
files = Table(
    "files", metadata,
    _id(),
    Column("checkpoint_id", ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False),
    _required("relpath", Text),
    _required("size", BigInteger),
    _optional("mtime", Float),
    _optional("etag", String(256)),
    _optional("crc64nvme", String(32)),
    _optional("sha256", String(64)),
    _optional("sha256_expected", String(64)),
    _optional("status", String(16)),
    _optional("detail", Text),
    _optional("verified_at", UTCDateTime()),
    _optional("link", Text),
    UniqueConstraint("checkpoint_id", "relpath", name="uq_files_checkpoint_relpath"),
)

#: Where a checkpoint's bytes live: one row per (tier, url); ``state`` is
#: present / missing / deleted / degraded.
copies = Table(
    "copies", metadata,
    _id(),
    Column("checkpoint_id", ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False),
    _required("tier", String(16)),
    _required("url", Text),
    _required("state", String(16)),
    _optional("stored_bytes", BigInteger),
    _optional("codec", String(64)),
    _optional("manifest_key", Text),
    _required("created_at", UTCDateTime()),
    _optional("verified_at", UTCDateTime()),
    _optional("storage_class", String(32)),  # S3 class of an archive copy, as confirmed
    UniqueConstraint("checkpoint_id", "tier", "url", name="uq_copies_checkpoint_tier_url"),
)

#: A retention decision about one checkpoint, with the reasons given.
decisions = Table(
    "decisions", metadata,
    _id(),
    Column("checkpoint_id", ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False),
    _required("at", UTCDateTime()),
    _required("action", String(32)),
    _required("reasons", JSON),
    _required("policy", Text),
    Index("ix_decisions_checkpoint_at", "checkpoint_id", "at"),
)

#: An append-only log line: state changes, tombstones, scan findings.
events = Table(
    "events", metadata,
    _id(),
    _required("at", UTCDateTime()),
    _required("kind", String(64)),
    _required("message", Text),
    Column("job_id", ForeignKey("jobs.id", ondelete="SET NULL"), nullable=True),
    Column("checkpoint_id", ForeignKey("checkpoints.id", ondelete="SET NULL"), nullable=True),
    _optional("data", JSON),
    Index("ix_events_at", "at"),
    Index("ix_events_job_at", "job_id", "at"),
    Index("ix_events_checkpoint", "checkpoint_id"),
)

#: One restore drill: what was restored from where, how long it took, the verdict.
drills = Table(
    "drills", metadata,
    _id(),
    Column("job_id", ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    Column("checkpoint_id", ForeignKey("checkpoints.id", ondelete="SET NULL"), nullable=True),
    _required("started_at", UTCDateTime()),
    _optional("finished_at", UTCDateTime()),
    _required("ok", Boolean),
    _optional("device", String(64)),
    _optional("source_tier", String(16)),
    _optional("verdict", JSON),
    _optional("timings", JSON),
    _optional("peak_memory_bytes", BigInteger),
    _optional("error", Text),
    # passed, failed or "not judged" (the drill could not judge: never the checkpoint's most recent drill);
    # NULL on rows written before: read by ok.
    _optional("outcome", String(16)),
    _optional("stack", JSON),  # versions the drill ran on: python, torch, cuda, the format's libraries
    Index("ix_drills_job_started", "job_id", "started_at"),
)

#: Statistics of a scan that changed the catalog (unchanged rescans leave no row).
scans = Table(
    "scans", metadata,
    _id(),
    _required("url", Text),
    _required("started_at", UTCDateTime()),
    _optional("finished_at", UTCDateTime()),
    _required("objects", Integer),
    _required("checkpoints", Integer),
    _required("unrecognised", Integer),
    _required("rows_written", Integer),
    Index("ix_scans_url_started", "url", "started_at"),
)

#: What a local scan saw of a checkpoint directory's tree, so that an
#: unchanged rescan can skip listing it (see :mod:`ckptier.tasks.scan`):
#: ``stamp`` digests the directory's mtime, link count and entry count and
#: every subdirectory's mtime and link count; ``dirs`` lists those
#: subdirectories (relative, one per line), which the next scan stats;
#: ``location`` is the checkpoint's hot location when the stamp was taken.
dir_stamps = Table(
    "dir_stamps", metadata,
    Column("checkpoint_id", ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True),
    _required("location", Text),
    _required("stamp", String(64)),
    _required("dirs", Text),
    _required("taken_at", UTCDateTime()),
)

#: One ``resume`` call (a recovery event): the ``job`` asked about (a name, so
#: that an attempt for a job the catalog does not know counts too), when and
#: how long, ``outcome`` (resumed / failed), the ``step`` and checkpoint chosen,
#: how it was proven (``verify``: full / quick), where it is loaded from
#: (``source``: hot / archive / fetched, ``path``), the newer checkpoints
#: ``passed_over`` ([{"step", "reason"}], newest first) and a failed call's ``error``.
recoveries = Table(
    "recoveries", metadata,
    _id(),
    _required("job", String(512)),
    _required("started_at", UTCDateTime()),
    _required("seconds", Float),
    _required("outcome", String(16)),
    _optional("step", BigInteger),
    Column("checkpoint_id", ForeignKey("checkpoints.id", ondelete="SET NULL"), nullable=True),
    _required("verify", String(8)),
    _optional("source", String(16)),
    _optional("path", Text),
    _required("passed_over", JSON),
    _optional("error", Text),
    Index("ix_recoveries_job_started", "job", "started_at"),
)
