"""The catalog: what ckptier knows about every checkpoint, and the only way to change it.

``Catalog`` returns the plain domain types of :mod:`ckptier.storage.model`
(never ORM objects) and takes the current time as ``now`` (an aware UTC
datetime) wherever it writes a time; it never reads the clock.

Concurrency: every write is one transaction (``BEGIN IMMEDIATE`` on SQLite).
Leases (:meth:`Catalog.claim`) and fenced deletion (:meth:`Catalog.mark_deleted`)
are single conditional ``UPDATE`` statements, so two runs racing for the same
checkpoint see exactly one winner on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    and_,
    bindparam,
    delete,
    func,
    insert,
    or_,
    select,
    text,
    true,
    update,
)

from ..errors import CkptierError
from ..model import (
    FileCheck,
    CheckpointRecord,
    CopyRecord,
    FileRecord,
    Format,
    Found,
    Recognition,
    State,
    Tier,
)
from . import db
from .models import checkpoints as ck
from .models import copies as cp
from .models import decisions as dec
from .models import drills as dr
from .models import events as ev
from .models import files as fl
from .models import jobs as jb
from .models import scans as sc

COPY_STATES = ("present", "missing", "deleted", "degraded")
FILE_STATUSES = ("ok", "corrupt", "missing", "error")
#: How many file names a state reason or event message lists before "+N more".
_NAMES_SHOWN = 3
#: First key of the PostgreSQL advisory locks that serialise scans of one job.
_SCAN_LOCK_CLASS = 0x636B73  # "cks"
# Stored values to enum members by dictionary: ``Enum(value)`` costs ~1 µs a call,
# a noticeable part of listing 100,000 checkpoints.
_FORMATS = {f.value: f for f in Format}
_STATES = {s.value: s for s in State}
_TIERS = {t.value: t for t in Tier}


class UnknownCheckpoint(CkptierError, LookupError):
    """A checkpoint id (or copy) that the catalog does not hold."""


@dataclass(frozen=True)
class ScanSummary:
    """What :meth:`Catalog.record_scan` found and changed.

    ``rows_written`` counts rows of jobs, checkpoints, files and copies that
    were inserted, updated or deleted (0 on an unchanged rescan). ``new``,
    ``changed``, ``committed``, ``vanished``, ``reappeared`` and
    ``resurrected`` count checkpoints.
    """

    store_url: str
    scope_prefix: str
    objects: int
    checkpoints: int
    unrecognised: int
    jobs: tuple[str, ...]
    rows_written: int
    new: int = 0
    changed: int = 0
    committed: int = 0
    vanished: int = 0
    reappeared: int = 0
    resurrected: int = 0


@dataclass(frozen=True)
class EventRecord:
    """One line of the catalog's event log (newest first when listed)."""

    id: int
    at: datetime
    kind: str
    message: str
    job: str | None
    checkpoint_id: int | None
    data: Mapping[str, Any] | None


@dataclass(frozen=True)
class DrillRecord:
    """One restore drill. ``timings`` maps phase name to seconds;
    ``peak_memory_bytes`` is the drill process's peak; ``id`` is set on
    records read back from the catalog."""

    job: str
    step: int | None
    checkpoint_id: int | None
    started_at: datetime
    finished_at: datetime | None
    ok: bool
    device: str | None
    source_tier: str | None
    verdict: Mapping[str, Any] = field(default_factory=dict)
    timings: Mapping[str, float] = field(default_factory=dict)
    peak_memory_bytes: int | None = None
    error: str | None = None
    id: int | None = None


def _aware(now: datetime, name: str = "now") -> datetime:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(
            f"{name}={now.isoformat()} is naive; pass an aware UTC datetime such as "
            "datetime.now(timezone.utc)"
        )
    return now.astimezone(UTC)


def _epoch(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_NAMES_SHOWN])
    more = len(items) - _NAMES_SHOWN
    return f"{shown} (+{more} more)" if more > 0 else shown


def _parent(prefix: str) -> str:
    prefix = prefix.strip("/")
    return prefix.rsplit("/", 1)[0] if "/" in prefix else ""


def _join_url(base: str, key: str) -> str:
    key = key.strip("/")
    return f"{base}/{key}" if key else base


@dataclass
class _Tally:
    """The counters of :class:`ScanSummary`, accumulated while a scan runs."""

    rows_written: int = 0
    new: int = 0
    changed: int = 0
    committed: int = 0
    vanished: int = 0
    reappeared: int = 0
    resurrected: int = 0


# Column order of the per-job file load in record_scan (tuples, for speed).
_F_ID, _F_CK, _F_REL, _F_SIZE, _F_MTIME, _F_ETAG, _F_EXP, _F_STATUS, _F_CRC = range(9)


class Catalog:
    """The catalog of jobs, checkpoints, files, copies, decisions, events and drills.

    Open with :meth:`Catalog.open`; safe to share between threads.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._closed = False
        self._lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------------------

    @classmethod
    def open(cls, url: str | None = None, *, create: bool = True) -> Catalog:
        """Open (creating if needed) the catalog at ``url`` and migrate it to
        the newest schema; ``None`` means :func:`db.resolve_catalog_url`
        without a config file. With ``create=False`` (read-only commands) a
        catalog that does not exist raises :class:`db.CatalogMissing` and
        nothing is created. Raises :class:`~ckptier.storage.errors.ConfigError`
        (one line) when it cannot."""
        return cls(db.open_engine(url if url is not None else db.resolve_catalog_url(None).url, create=create))

    def close(self) -> None:
        """Release the database connections. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._engine.dispose()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        """The database URL with its password masked."""
        return db.mask_url(self._engine.url)

    @property
    def dialect(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self._engine.dialect.name

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with db.read_transaction(self._engine) as conn:
            yield conn

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with self._engine.begin() as conn:
            yield conn

    # -- scanning ------------------------------------------------------------------

    def record_scan(
        self,
        store_url: str,
        recognition: Recognition,
        *,
        now: datetime,
        scope_prefix: str = "",
    ) -> ScanSummary:
        """Bring the catalog in line with one listing of ``store_url`` (under
        ``scope_prefix``, a raw key prefix as given to ``Store.list``).

        * New checkpoints are inserted (``incomplete`` or ``committed`` as the
          recognition says) with their files and a ``hot`` copy at
          ``location = store_url + "/" + prefix``.
        * Changes only are written: an unchanged rescan writes nothing at all
          (no ``last_seen`` bump, no scans row, no event), so ``last_seen`` is
          the time of the last scan that changed the row.
        * ``incomplete`` becomes ``committed`` when commit evidence appears, and
          a ``committed``/``verified`` one loses its evidence → ``incomplete``.
          Files that changed (size, mtime, etag, expected hash, or the set of
          files) send a ``verified`` checkpoint back to ``committed`` and
          forget the changed files' verification; ``corrupt`` stays corrupt
          (evidence) but its files are updated. A file that disappears from a
          complete checkpoint keeps its row with status ``missing`` (so a
          re-verification reports it); in an ``incomplete`` one its row goes.
        * A checkpoint of this store and scope missing from the listing gets
          ``missing_since = now`` (state kept) and its hot copy ``missing``;
          when it reappears both are undone. A ``deleted`` tombstone that
          reappears is revived to the state its files imply, with an event.
        * Each job is one transaction: an error leaves earlier jobs written
          and the failing job untouched, and propagates.
        * When anything changed, one ``scans`` row records the statistics
          (bookkeeping rows, events and scans are not counted in
          ``rows_written``).
        """
        now = _aware(now)
        base = store_url.rstrip("/")
        scope = base + "/" + scope_prefix.lstrip("/")
        by_job: dict[str, dict[int, Found]] = {}
        for found in recognition.checkpoints:
            steps = by_job.setdefault(found.job, {})
            # One row per (job, step): a committed find beats an uncommitted one.
            if found.step not in steps or (found.committed and not steps[found.step].committed):
                steps[found.step] = found

        with self._read() as conn:
            stale_jobs = conn.execute(
                select(jb.c.name)
                .join(ck, ck.c.job_id == jb.c.id)
                .where(
                    ck.c.location.startswith(scope, autoescape=True),
                    ck.c.state != State.DELETED.value,
                    ck.c.missing_since.is_(None),
                )
                .distinct()
            ).scalars()
            affected = sorted(set(by_job) | set(stale_jobs))

        tally = _Tally()
        for name in affected:
            with self._write() as conn:
                self._scan_job(conn, name, by_job.get(name, {}), base, scope, now, tally)

        summary = ScanSummary(
            store_url=store_url,
            scope_prefix=scope_prefix,
            objects=recognition.objects,
            checkpoints=len(recognition.checkpoints),
            unrecognised=len(recognition.unrecognised),
            jobs=tuple(sorted(by_job)),
            **asdict(tally),
        )
        if tally.rows_written:
            with self._write() as conn:
                conn.execute(
                    insert(sc).values(
                        url=_join_url(base, scope_prefix),
                        started_at=now,
                        finished_at=now,
                        objects=summary.objects,
                        checkpoints=summary.checkpoints,
                        unrecognised=summary.unrecognised,
                        rows_written=summary.rows_written,
                    )
                )
        return summary

    def _ensure_job(self, conn: Connection, name: str, hot_url: str | None, now: datetime) -> tuple[int, bool]:
        """(job id, whether it was inserted now). Safe against a concurrent insert."""
        job_id = conn.execute(select(jb.c.id).where(jb.c.name == name)).scalar()
        if job_id is not None:
            return int(job_id), False
        stmt = self._insert(jb).values(name=name, hot_url=hot_url, created_at=now)
        conn.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))
        return int(conn.execute(select(jb.c.id).where(jb.c.name == name)).scalar_one()), True

    def _insert(self, table: Any) -> Any:
        # The dialect's own INSERT (for ON CONFLICT), imported when a write needs it:
        # read-only commands never load the PostgreSQL dialect for a SQLite catalog.
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            return pg_insert(table)
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(table)

    def _scan_job(
        self,
        conn: Connection,
        name: str,
        found_by_step: Mapping[int, Found],
        base: str,
        scope: str,
        now: datetime,
        tally: _Tally,
    ) -> None:
        if self.dialect == "postgresql":
            # Two scans of the same job queue here instead of racing on inserts;
            # SQLite's BEGIN IMMEDIATE already serialises writers.
            conn.execute(
                text("SELECT pg_advisory_xact_lock(:cls, hashtext(:name))"),
                {"cls": _SCAN_LOCK_CLASS, "name": name},
            )
        hot_url = None
        if found_by_step:
            first = found_by_step[min(found_by_step)]
            hot_url = _join_url(base, _parent(first.prefix))
        job_id, inserted = self._ensure_job(conn, name, hot_url, now)
        tally.rows_written += int(inserted)

        existing = {
            int(r.step): r
            for r in conn.execute(
                select(
                    ck.c.id,
                    ck.c.step,
                    ck.c.format,
                    ck.c.location,
                    ck.c.state,
                    ck.c.state_reason,
                    ck.c.bytes,
                    ck.c.file_count,
                    ck.c.saved_at,
                    ck.c.first_seen,
                    ck.c.last_seen,
                    ck.c.missing_since,
                    ck.c.verified_at,
                    ck.c.recorded_loss,
                ).where(ck.c.job_id == job_id)
            )
        }
        files_by_ck: dict[int, dict[str, tuple[Any, ...]]] = {}
        for frow in _plain_rows(
            conn,
            select(
                fl.c.id,
                fl.c.checkpoint_id,
                fl.c.relpath,
                fl.c.size,
                fl.c.mtime,
                fl.c.etag,
                fl.c.sha256_expected,
                fl.c.status,
                fl.c.crc64nvme,
            )
            .join(ck, ck.c.id == fl.c.checkpoint_id)
            .where(ck.c.job_id == job_id),
        ):
            files_by_ck.setdefault(frow[_F_CK], {})[frow[_F_REL]] = frow
        hot_copies: dict[tuple[int, str], tuple[int, str, int | None]] = {}
        for c_id, c_ck, c_url, c_state, c_bytes in conn.execute(
            select(cp.c.id, cp.c.checkpoint_id, cp.c.url, cp.c.state, cp.c.stored_bytes)
            .join(ck, ck.c.id == cp.c.checkpoint_id)
            .where(ck.c.job_id == job_id, cp.c.tier == Tier.HOT.value)
        ):
            hot_copies[(c_ck, c_url)] = (c_id, c_state, c_bytes)

        new_ck: list[dict[str, Any]] = []
        new_found: list[Found] = []
        ck_updates: list[dict[str, Any]] = []
        file_inserts: list[tuple[Any, ...]] = []
        file_updates: list[dict[str, Any]] = []
        file_deletes: list[int] = []
        copy_inserts: list[dict[str, Any]] = []
        copy_updates: list[dict[str, Any]] = []
        events: list[dict[str, Any]] = []

        def event(kind: str, message: str, checkpoint_id: int | None, **data: Any) -> None:
            events.append(
                {"at": now, "kind": kind, "message": message, "job_id": job_id,
                 "checkpoint_id": checkpoint_id, "data": data or None}
            )

        for step, found in sorted(found_by_step.items()):
            location = _join_url(base, found.prefix)
            old = existing.get(step)
            if old is None:
                new_found.append(found)
                new_ck.append(
                    {
                        "job_id": job_id,
                        "step": step,
                        "format": found.format.value,
                        "location": location,
                        "state": (State.COMMITTED if found.committed else State.INCOMPLETE).value,
                        "state_reason": found.reason,
                        "bytes": found.bytes,
                        "file_count": len(found.files),
                        "saved_at": _epoch(found.saved_at),
                        "first_seen": now,
                        "last_seen": now,
                        "missing_since": None,
                        "verified_at": None,
                        "recorded_loss": found.recorded_loss,
                        "generation": 0,
                    }
                )
                continue

            cid = int(old.id)
            old_state = State(old.state)
            old_files = files_by_ck.get(cid, {})
            expected = found.expected_sha256
            changed_names: list[str] = []
            listed: set[str] = set()
            for ref in found.files:
                listed.add(ref.relpath)
                exp = expected.get(ref.relpath)
                row = old_files.get(ref.relpath)
                if row is None:
                    changed_names.append(ref.relpath)
                    file_inserts.append(self._file_row(cid, ref.relpath, ref.size, ref.mtime, ref.etag, exp))
                    continue
                same_bytes = row[_F_SIZE] == ref.size and row[_F_MTIME] == ref.mtime and row[_F_ETAG] == ref.etag
                if same_bytes and row[_F_EXP] == exp and row[_F_STATUS] != "missing":
                    continue
                changed_names.append(ref.relpath)
                # A committed checkpoint's files never change legitimately: keep the
                # verified crc64nvme as the baseline, so re-verification catches a
                # replaced object even when the format records no hash of its own.
                file_updates.append(
                    {"_id": row[_F_ID], "size": ref.size, "mtime": ref.mtime, "etag": ref.etag,
                     "sha256_expected": exp, "crc64nvme": row[_F_CRC], "sha256": None, "status": None,
                     "detail": None, "verified_at": None}
                )
            gone = [rel for rel in old_files if rel not in listed]

            # The state the listing implies.
            if old_state == State.DELETED:
                new_state = State.COMMITTED if found.committed else State.INCOMPLETE
            elif not found.committed:
                new_state = State.INCOMPLETE
            elif old_state == State.INCOMPLETE:
                new_state = State.COMMITTED
            elif old_state == State.VERIFIED and (changed_names or gone):
                new_state = State.COMMITTED
            else:
                new_state = old_state

            for rel in gone:
                row = old_files[rel]
                if new_state == State.INCOMPLETE:
                    file_deletes.append(row[_F_ID])
                elif row[_F_STATUS] != "missing":
                    file_updates.append(
                        {"_id": row[_F_ID], "size": row[_F_SIZE], "mtime": row[_F_MTIME],
                         "etag": row[_F_ETAG], "sha256_expected": row[_F_EXP], "crc64nvme": None,
                         "sha256": None, "status": "missing",
                         "detail": f"no longer listed by the scan at {now.isoformat()}",
                         "verified_at": None}
                    )
            files_changed = bool(changed_names) or any(
                old_files[rel][_F_STATUS] != "missing" or new_state == State.INCOMPLETE for rel in gone
            )

            reason = old.state_reason
            verified_at = old.verified_at
            if old_state == State.DELETED:
                reason = found.reason
                verified_at = None
                tally.resurrected += 1
                event("resurrected", f"{name} step {step}: deleted checkpoint reappeared at {location}; "
                      f"now {new_state.value} ({found.reason})", cid, state=new_state.value)
            elif new_state != old_state:
                reason = found.reason
                if new_state == State.COMMITTED and old_state == State.INCOMPLETE:
                    tally.committed += 1
                    event("committed", f"{name} step {step}: committed ({found.reason})", cid)
                elif new_state == State.COMMITTED:
                    names = sorted(set(changed_names) | set(gone))
                    reason = f"files changed since verification: {_names(names)}"
                    verified_at = None
                    event("changed", f"{name} step {step}: {reason}; needs re-verification", cid,
                          files=names[:100])
                else:  # lost its commit evidence
                    verified_at = None
                    event("uncommitted", f"{name} step {step}: commit evidence gone ({found.reason})", cid)
            elif files_changed and old_state in (State.COMMITTED, State.CORRUPT):
                names = sorted(set(changed_names) | set(gone))
                event("changed", f"{name} step {step}: files changed: {_names(names)}", cid,
                      files=names[:100])
            if files_changed:
                tally.changed += 1

            missing_since = old.missing_since
            if missing_since is not None:
                missing_since = None
                tally.reappeared += 1
                if old_state != State.DELETED:
                    event("reappeared", f"{name} step {step}: listed again at {location}", cid)

            values = {
                "format": found.format.value,
                "location": location,
                "state": new_state.value,
                "state_reason": reason,
                "bytes": found.bytes,
                "file_count": len(found.files),
                "saved_at": _epoch(found.saved_at),
                "missing_since": missing_since,
                "verified_at": verified_at,
                "recorded_loss": found.recorded_loss,
            }
            if any(getattr(old, k) != v for k, v in values.items()):
                ck_updates.append({"_id": cid, "last_seen": now, **values})

            hot = hot_copies.get((cid, location))
            if hot is None:
                copy_inserts.append(self._hot_copy_row(cid, location, found.bytes, now))
            elif hot[1] != "present" or hot[2] != found.bytes:
                copy_updates.append({"_id": hot[0], "state": "present", "stored_bytes": found.bytes})

        # Vanished: cataloged under this store and scope, not listed now.
        for step, old in existing.items():
            if (
                step in found_by_step
                or old.state == State.DELETED.value
                or old.missing_since is not None
                or not old.location.startswith(scope)
            ):
                continue
            cid = int(old.id)
            hot = hot_copies.get((cid, old.location))
            if hot is not None and hot[1] == "deleted":
                continue  # ckptier removed this hot copy on purpose (an archive copy remains)
            ck_updates.append(
                {"_id": cid, "last_seen": old.last_seen,
                 **{k: getattr(old, k) for k in (
                     "format", "location", "state", "state_reason", "bytes", "file_count",
                     "saved_at", "verified_at", "recorded_loss")},
                 "missing_since": now}
            )
            if hot is not None and hot[1] == "present":
                copy_updates.append({"_id": hot[0], "state": "missing", "stored_bytes": hot[2]})
            tally.vanished += 1
            event("vanished", f"{name} step {step}: no longer listed at {old.location}", cid,
                  state=old.state)

        # Write.
        if new_ck:
            ids = conn.execute(
                insert(ck).returning(ck.c.id, sort_by_parameter_order=True), new_ck
            ).scalars().all()
            for cid, found in zip(ids, new_found, strict=True):
                hashes = found.expected_sha256
                file_inserts.extend(
                    self._file_row(cid, r.relpath, r.size, r.mtime, r.etag, hashes.get(r.relpath))
                    for r in found.files
                )
                copy_inserts.append(self._hot_copy_row(cid, _join_url(base, found.prefix), found.bytes, now))
            tally.new += len(new_ck)
            tally.rows_written += len(new_ck)
            event("discovered", f"{name}: {len(new_ck)} new checkpoint(s), steps "
                  f"{_names([str(f.step) for f in new_found])}", None,
                  steps=[f.step for f in new_found][:1000])
        if ck_updates:
            tally.rows_written += _bulk_update(conn, ck, ck_updates)
        if file_deletes:
            conn.execute(delete(fl).where(fl.c.id.in_(file_deletes)))
            tally.rows_written += len(file_deletes)
        if file_updates:
            tally.rows_written += _bulk_update(conn, fl, file_updates)
        if file_inserts:
            tally.rows_written += _insert_files(conn, file_inserts)
        if copy_updates:
            tally.rows_written += _bulk_update(conn, cp, copy_updates)
        if copy_inserts:
            conn.execute(insert(cp), copy_inserts)
            tally.rows_written += len(copy_inserts)
        if events:
            conn.execute(insert(ev), events)

    @staticmethod
    def _file_row(
        cid: int, relpath: str, size: int, mtime: float | None, etag: str | None, exp: str | None
    ) -> tuple[Any, ...]:
        """A new file row in the column order of :data:`_FILE_INSERT_COLUMNS`."""
        return (cid, relpath, size, mtime, etag, exp)

    @staticmethod
    def _hot_copy_row(cid: int, url: str, size: int, now: datetime) -> dict[str, Any]:
        return {
            "checkpoint_id": cid, "tier": Tier.HOT.value, "url": url, "state": "present",
            "stored_bytes": size, "codec": None, "manifest_key": None, "created_at": now,
            "verified_at": None,
        }

    # -- queries -------------------------------------------------------------------

    def checkpoints(
        self,
        *,
        job: str | None = None,
        states: Iterable[State] | None = None,
        include_deleted: bool = False,
        with_files: bool = True,
    ) -> list[CheckpointRecord]:
        """Checkpoints ordered by job name, then step (ascending).

        ``states`` selects exactly those states (``deleted`` included if
        listed); without it every state but ``deleted`` is returned, unless
        ``include_deleted``. Copies are always included; files only with
        ``with_files``.
        """
        conds: list[ColumnElement[bool]] = []
        if job is not None:
            conds.append(jb.c.name == job)
        if states is not None:
            conds.append(ck.c.state.in_([State(s).value for s in states]))
        elif not include_deleted:
            conds.append(ck.c.state != State.DELETED.value)
        with self._read() as conn:
            return self._load(conn, conds, with_files=with_files)

    def get(self, job: str, step: int) -> CheckpointRecord | None:
        """The checkpoint ``step`` of ``job`` (any state, tombstones included), or None."""
        with self._read() as conn:
            rows = self._load(conn, [jb.c.name == job, ck.c.step == step], with_files=True)
        return rows[0] if rows else None

    def get_by_id(self, checkpoint_id: int) -> CheckpointRecord | None:
        """The checkpoint with this id (any state), or None."""
        with self._read() as conn:
            rows = self._load(conn, [ck.c.id == checkpoint_id], with_files=True)
        return rows[0] if rows else None

    def latest(self, job: str) -> CheckpointRecord | None:
        """The highest-step ``verified`` checkpoint of ``job`` that still has a
        ``present`` copy in some tier (safe to resume from), or None."""
        has_copy = (
            select(cp.c.id)
            .where(cp.c.checkpoint_id == ck.c.id, cp.c.state == "present")
            .exists()
        )
        with self._read() as conn:
            cid = conn.execute(
                select(ck.c.id)
                .join(jb, jb.c.id == ck.c.job_id)
                .where(jb.c.name == job, ck.c.state == State.VERIFIED.value, has_copy)
                .order_by(ck.c.step.desc())
                .limit(1)
            ).scalar()
            if cid is None:
                return None
            return self._load(conn, [ck.c.id == cid], with_files=True)[0]

    def file_counts(self, *, job: str | None = None) -> dict[int, int]:
        """How many files the catalog lists for each checkpoint (by id) of ``job``, or
        of every job: what a listing shows without loading every file row."""
        stmt = select(fl.c.checkpoint_id, func.count()).group_by(fl.c.checkpoint_id)
        if job is not None:
            stmt = stmt.join(ck, ck.c.id == fl.c.checkpoint_id).join(jb, jb.c.id == ck.c.job_id).where(jb.c.name == job)
        with self._read() as conn:
            return {int(cid): int(n) for cid, n in conn.execute(stmt).tuples()}

    def jobs(self) -> list[str]:
        """Names of all jobs, sorted."""
        with self._read() as conn:
            return list(conn.execute(select(jb.c.name).order_by(jb.c.name)).scalars())

    def _load(
        self, conn: Connection, conds: Sequence[ColumnElement[bool]], *, with_files: bool
    ) -> list[CheckpointRecord]:
        where = and_(true(), *conds)
        base = select(ck.c.id).join(jb, jb.c.id == ck.c.job_id).where(where)
        # Columns named and rows unpacked as tuples: attribute access on 100,000
        # rows costs more than the query itself.
        rows = conn.execute(
            select(ck.c.id, jb.c.name, ck.c.step, ck.c.format, ck.c.state, ck.c.location, ck.c.bytes,
                   ck.c.saved_at, ck.c.first_seen, ck.c.last_seen, ck.c.missing_since, ck.c.verified_at,
                   ck.c.state_reason, ck.c.recorded_loss, ck.c.generation)
            .join(jb, jb.c.id == ck.c.job_id)
            .where(where)
            .order_by(jb.c.name, ck.c.step)
        ).tuples().all()
        if not rows:
            return []
        ids = base.scalar_subquery() if len(rows) > 500 else [r[0] for r in rows]
        files: dict[int, list[FileRecord]] = {}
        if with_files:
            cols = (fl.c.relpath, fl.c.size, fl.c.mtime, fl.c.etag, fl.c.crc64nvme,
                    fl.c.sha256_expected, fl.c.status, fl.c.detail)
            for cid, rel, size, mtime, etag, crc, exp, status, detail in conn.execute(
                select(fl.c.checkpoint_id, *cols)
                .where(fl.c.checkpoint_id.in_(ids))
                .order_by(fl.c.checkpoint_id, fl.c.relpath)
            ).all():
                files.setdefault(cid, []).append(
                    FileRecord(relpath=rel, size=size, mtime=mtime, etag=etag, crc64nvme=crc,
                               sha256_expected=exp, status=status, detail=detail)
                )
        copies: dict[int, list[CopyRecord]] = {}
        for ccid, tier, url, cstate, stored, cverified, codec in conn.execute(
            select(cp.c.checkpoint_id, cp.c.tier, cp.c.url, cp.c.state, cp.c.stored_bytes, cp.c.verified_at,
                   cp.c.codec)
            .where(cp.c.checkpoint_id.in_(ids)).order_by(cp.c.checkpoint_id, cp.c.tier, cp.c.url)
        ).tuples():
            copies.setdefault(ccid, []).append(
                CopyRecord(tier=_TIERS[tier], url=url, state=cstate, stored_bytes=stored,
                           verified_at=cverified, codec=codec)
            )
        return [
            CheckpointRecord(
                id=cid, job=job, step=step, format=_FORMATS[fmt], state=_STATES[state],
                location=location, bytes=size, saved_at=saved_at, first_seen=first_seen,
                last_seen=last_seen, missing_since=missing_since, verified_at=verified_at,
                state_reason=reason, recorded_loss=loss, generation=generation,
                files=tuple(files.get(cid, ())), copies=tuple(copies.get(cid, ())),
            )
            for (cid, job, step, fmt, state, location, size, saved_at, first_seen, last_seen, missing_since,
                 verified_at, reason, loss, generation) in rows
        ]

    # -- verification --------------------------------------------------------------

    def record_verification(
        self, checkpoint_id: int, results: Sequence[FileCheck], *, now: datetime
    ) -> State:
        """Record per-file read-back results and return the checkpoint's state.

        * A file is bad when reported ``corrupt``/``missing``, or reported
          ``ok`` but its size, sha256 (vs the format's expected hash) or
          crc64nvme (vs the value recorded by an earlier verification)
          differs from the catalog. Any bad file → ``corrupt``, the reason
          naming the file with expected vs actual.
        * Otherwise, only ``error`` results (unreadable) → state unchanged.
        * Otherwise, every cataloged file ``ok`` → ``verified`` (and
          ``verified_at = now`` on the checkpoint and its hot copy).
        * The first ``ok`` verification records the file's crc64nvme.
        * ``incomplete`` and ``deleted`` checkpoints keep their state; their
          file results are still recorded.
        An event is logged for every state change. Raises
        :class:`UnknownCheckpoint` for an unknown id and ``ValueError`` for a
        result naming a file the catalog does not list.
        """
        now = _aware(now)
        with self._write() as conn:
            head = conn.execute(
                select(ck.c.id, ck.c.job_id, ck.c.step, ck.c.state, ck.c.state_reason, ck.c.location)
                .where(ck.c.id == checkpoint_id)
            ).first()
            if head is None:
                raise UnknownCheckpoint(f"checkpoint id {checkpoint_id} is not in the catalog; rescan first")
            rows = {
                r.relpath: r
                for r in conn.execute(
                    select(fl.c.id, fl.c.relpath, fl.c.size, fl.c.crc64nvme, fl.c.sha256,
                           fl.c.sha256_expected, fl.c.status)
                    .where(fl.c.checkpoint_id == checkpoint_id)
                )
            }
            bad: list[str] = []
            errors: list[str] = []
            ok: set[str] = set()
            updates: list[dict[str, Any]] = []
            for res in results:
                if res.status not in FILE_STATUSES:
                    raise ValueError(f"{res.relpath}: status {res.status!r}; use one of {', '.join(FILE_STATUSES)}")
                row = rows.get(res.relpath)
                if row is None:
                    raise ValueError(
                        f"checkpoint {checkpoint_id} has no file {res.relpath!r} in the catalog; "
                        "rescan before verifying"
                    )
                status: str = res.status
                detail = res.detail
                if status == "ok":
                    mismatch = _mismatch(row.size, row.sha256_expected, row.crc64nvme, res)
                    if mismatch:
                        status, detail = "corrupt", mismatch
                elif status in ("corrupt", "missing") and not detail:
                    detail = status
                crc = row.crc64nvme
                if status == "ok" and crc is None:
                    crc = res.crc64nvme
                updates.append(
                    {"_id": row.id, "status": status, "detail": detail, "verified_at": now,
                     "crc64nvme": crc, "sha256": res.sha256 if res.sha256 else row.sha256}
                )
                if status in ("corrupt", "missing"):
                    bad.append(f"{res.relpath}: {detail}")
                elif status == "error":
                    errors.append(res.relpath)
                else:
                    ok.add(res.relpath)
            if updates:
                _bulk_update(conn, fl, updates)

            old = State(head.state)
            new, reason = old, head.state_reason
            if old in (State.INCOMPLETE, State.DELETED):
                pass
            elif bad:
                new = State.CORRUPT
                reason = bad[0] + (f" (+{len(bad) - 1} more bad files)" if len(bad) > 1 else "")
            elif errors:
                pass
            elif rows and ok >= set(rows):
                new, reason = State.VERIFIED, f"{len(rows)} files verified"

            values: dict[str, Any] = {"state": new.value, "state_reason": reason}
            if new == State.VERIFIED:
                values["verified_at"] = now
            if new != old or reason != head.state_reason or new == State.VERIFIED:
                conn.execute(update(ck).where(ck.c.id == checkpoint_id).values(**values))
            if new == State.VERIFIED:
                conn.execute(
                    update(cp)
                    .where(cp.c.checkpoint_id == checkpoint_id, cp.c.tier == Tier.HOT.value,
                           cp.c.url == head.location, cp.c.state == "present")
                    .values(verified_at=now)
                )
            if new != old:
                conn.execute(
                    insert(ev).values(
                        at=now, kind=new.value, job_id=head.job_id, checkpoint_id=checkpoint_id,
                        message=f"step {head.step}: {old.value} -> {new.value}: {reason}",
                        data={"from": old.value, "to": new.value, "bad": bad[:100], "errors": errors[:100]},
                    )
                )
            return new

    # -- copies --------------------------------------------------------------------

    def add_copy(
        self,
        checkpoint_id: int,
        *,
        tier: Tier,
        url: str,
        state: str = "present",
        stored_bytes: int | None,
        codec: str | None,
        manifest_key: str | None,
        verified_at: datetime | None,
        now: datetime,
    ) -> None:
        """Insert or update (on ``(checkpoint_id, tier, url)``) a copy of a
        checkpoint. ``created_at`` is set on insert only. Idempotent."""
        now = _aware(now)
        _check_copy_state(state)
        if verified_at is not None:
            verified_at = _aware(verified_at, "verified_at")
        values = {
            "state": state, "stored_bytes": stored_bytes, "codec": codec,
            "manifest_key": manifest_key, "verified_at": verified_at,
        }
        stmt = self._insert(cp).values(
            checkpoint_id=checkpoint_id, tier=Tier(tier).value, url=url, created_at=now, **values
        )
        stmt = stmt.on_conflict_do_update(index_elements=["checkpoint_id", "tier", "url"], set_=values)
        with self._write() as conn:
            self._require(conn, checkpoint_id)
            conn.execute(stmt)

    def set_copy_state(self, checkpoint_id: int, *, tier: Tier, url: str, state: str, now: datetime) -> None:
        """Set the state of an existing copy; raises :class:`UnknownCheckpoint`
        when there is no such copy. Logs an event when the state changes."""
        now = _aware(now)
        _check_copy_state(state)
        with self._write() as conn:
            row = conn.execute(
                select(cp.c.id, cp.c.state, ck.c.job_id, ck.c.step)
                .join(ck, ck.c.id == cp.c.checkpoint_id)
                .where(cp.c.checkpoint_id == checkpoint_id, cp.c.tier == Tier(tier).value, cp.c.url == url)
            ).first()
            if row is None:
                raise UnknownCheckpoint(
                    f"checkpoint {checkpoint_id} has no {Tier(tier).value} copy at {url}; add it with add_copy"
                )
            if row.state == state:
                return
            conn.execute(update(cp).where(cp.c.id == row.id).values(state=state))
            conn.execute(
                insert(ev).values(
                    at=now, kind="copy-" + state, job_id=row.job_id, checkpoint_id=checkpoint_id,
                    message=f"step {row.step}: {Tier(tier).value} copy {url}: {row.state} -> {state}",
                    data={"tier": Tier(tier).value, "url": url, "from": row.state, "to": state},
                )
            )

    @staticmethod
    def _require(conn: Connection, checkpoint_id: int) -> None:
        if conn.execute(select(ck.c.id).where(ck.c.id == checkpoint_id)).first() is None:
            raise UnknownCheckpoint(f"checkpoint id {checkpoint_id} is not in the catalog; rescan first")

    # -- leases and fenced deletion -------------------------------------------------

    def claim(self, checkpoint_id: int, owner: str, *, now: datetime, ttl: timedelta) -> int | None:
        """Take the lease on a checkpoint for ``ttl``; return the new generation,
        or None when anyone (``owner`` included) holds an unexpired lease.

        One conditional UPDATE: atomic on PostgreSQL (row lock, re-checked
        after waiting) and SQLite (``BEGIN IMMEDIATE``). Every successful
        claim bumps the generation, fencing out the previous holder.
        """
        now = _aware(now)
        if ttl <= timedelta(0):
            raise ValueError(f"lease ttl={ttl} must be positive")
        if not owner:
            raise ValueError("lease owner is empty; pass a unique run id")
        stmt = (
            update(ck)
            .where(
                ck.c.id == checkpoint_id,
                or_(ck.c.lease_owner.is_(None), ck.c.lease_expires.is_(None), ck.c.lease_expires <= now),
            )
            .values(lease_owner=owner, lease_expires=now + ttl, generation=ck.c.generation + 1)
            .returning(ck.c.generation)
        )
        with self._write() as conn:
            generation = conn.execute(stmt).scalar()
            if generation is None:
                self._require(conn, checkpoint_id)
                return None
            return int(generation)

    def release(self, checkpoint_id: int, owner: str, generation: int) -> bool:
        """Give the lease back; False (and nothing changes) when ``owner`` at
        ``generation`` no longer holds it. The generation is kept."""
        with self._write() as conn:
            result = conn.execute(
                update(ck)
                .where(ck.c.id == checkpoint_id, ck.c.lease_owner == owner, ck.c.generation == generation)
                .values(lease_owner=None, lease_expires=None)
            )
            return result.rowcount == 1

    def mark_deleted(
        self,
        checkpoint_id: int,
        *,
        owner: str,
        generation: int,
        now: datetime,
        reasons: Sequence[str],
    ) -> bool:
        """Record that the checkpoint's hot files were deleted (a tombstone).

        Fenced: in one transaction, and only when ``owner`` holds an unexpired
        lease at ``generation``; sets the state ``deleted``, the hot copy
        ``deleted`` and logs a ``deleted`` event with the reasons. Returns
        False and changes nothing when fenced out (a zombie run).
        """
        now = _aware(now)
        with self._write() as conn:
            row = conn.execute(
                update(ck)
                .where(
                    ck.c.id == checkpoint_id,
                    ck.c.lease_owner == owner,
                    ck.c.generation == generation,
                    ck.c.lease_expires > now,
                )
                .values(state=State.DELETED.value, state_reason="; ".join(reasons) or "deleted")
                .returning(ck.c.job_id, ck.c.step, ck.c.location)
            ).first()
            if row is None:
                return False
            conn.execute(
                update(cp)
                .where(cp.c.checkpoint_id == checkpoint_id, cp.c.tier == Tier.HOT.value)
                .values(state="deleted")
            )
            conn.execute(
                insert(ev).values(
                    at=now, kind="deleted", job_id=row.job_id, checkpoint_id=checkpoint_id,
                    message=f"step {row.step}: deleted {row.location}: {'; '.join(reasons) or 'no reason given'}",
                    data={"reasons": list(reasons), "owner": owner, "generation": generation},
                )
            )
            return True

    # -- decisions, events, drills --------------------------------------------------

    def record_decisions(
        self, rows: Sequence[tuple[int, str, Sequence[str]]], *, policy: str, now: datetime
    ) -> None:
        """Append retention decisions ``(checkpoint_id, action, reasons)`` made
        under ``policy`` (its readable text) at ``now``; one transaction."""
        now = _aware(now)
        if not rows:
            return
        with self._write() as conn:
            conn.execute(
                insert(dec),
                [{"checkpoint_id": cid, "at": now, "action": action, "reasons": list(reasons), "policy": policy}
                 for cid, action, reasons in rows],
            )

    def log_event(
        self,
        kind: str,
        message: str,
        *,
        now: datetime,
        job: str | None = None,
        checkpoint_id: int | None = None,
        data: Mapping[str, Any] | None = None,
    ) -> None:
        """Append an event. The job comes from ``checkpoint_id`` when given,
        else from ``job`` (a job not yet cataloged is created, without URL)."""
        now = _aware(now)
        with self._write() as conn:
            job_id: int | None = None
            if checkpoint_id is not None:
                job_id = conn.execute(select(ck.c.job_id).where(ck.c.id == checkpoint_id)).scalar()
                if job_id is None:
                    raise UnknownCheckpoint(f"checkpoint id {checkpoint_id} is not in the catalog; rescan first")
            elif job is not None:
                job_id, _ = self._ensure_job(conn, job, None, now)
            conn.execute(
                insert(ev).values(at=now, kind=kind, message=message, job_id=job_id,
                                  checkpoint_id=checkpoint_id, data=dict(data) if data else None)
            )

    def events(
        self, *, job: str | None = None, kinds: Iterable[str] | None = None, limit: int = 100
    ) -> list[EventRecord]:
        """Events newest first (by time, then insertion order), at most ``limit``."""
        q = select(ev, jb.c.name.label("job_name")).outerjoin(jb, jb.c.id == ev.c.job_id)
        if job is not None:
            q = q.where(jb.c.name == job)
        if kinds is not None:
            q = q.where(ev.c.kind.in_(list(kinds)))
        q = q.order_by(ev.c.at.desc(), ev.c.id.desc()).limit(limit)
        with self._read() as conn:
            return [
                EventRecord(id=r.id, at=r.at, kind=r.kind, message=r.message, job=r.job_name,
                            checkpoint_id=r.checkpoint_id, data=r.data)
                for r in conn.execute(q)
            ]

    def record_drill(self, drill: DrillRecord) -> int:
        """Store a drill and return its id. The job is created if unknown."""
        started = _aware(drill.started_at, "started_at")
        finished = _aware(drill.finished_at, "finished_at") if drill.finished_at else None
        with self._write() as conn:
            if drill.checkpoint_id is not None:
                self._require(conn, drill.checkpoint_id)
            job_id, _ = self._ensure_job(conn, drill.job, None, started)
            return int(
                conn.execute(
                    insert(dr).values(
                        job_id=job_id, checkpoint_id=drill.checkpoint_id, started_at=started,
                        finished_at=finished, ok=drill.ok, device=drill.device,
                        source_tier=drill.source_tier, verdict=dict(drill.verdict),
                        timings=dict(drill.timings), peak_memory_bytes=drill.peak_memory_bytes,
                        error=drill.error,
                    ).returning(dr.c.id)
                ).scalar_one()
            )

    def drills(self, *, job: str | None = None, limit: int = 50) -> list[DrillRecord]:
        """Drills newest first (by start time), at most ``limit``."""
        q = (
            select(dr, jb.c.name.label("job_name"), ck.c.step.label("ck_step"))
            .join(jb, jb.c.id == dr.c.job_id)
            .outerjoin(ck, ck.c.id == dr.c.checkpoint_id)
        )
        if job is not None:
            q = q.where(jb.c.name == job)
        q = q.order_by(dr.c.started_at.desc(), dr.c.id.desc()).limit(limit)
        with self._read() as conn:
            return [
                DrillRecord(
                    job=r.job_name, step=r.ck_step, checkpoint_id=r.checkpoint_id,
                    started_at=r.started_at, finished_at=r.finished_at, ok=bool(r.ok), device=r.device,
                    source_tier=r.source_tier, verdict=r.verdict or {}, timings=r.timings or {},
                    peak_memory_bytes=r.peak_memory_bytes, error=r.error, id=r.id,
                )
                for r in conn.execute(q)
            ]

    def summary(self) -> list[dict[str, Any]]:
        """One row per (job, state), sorted: ``job``, ``state``, ``count``,
        ``bytes``, plus per job ``newest_verified_step`` (or None) and
        ``tiers`` (sorted tiers holding a present/degraded copy of a
        non-deleted checkpoint). Tombstones are included as state ``deleted``."""
        with self._read() as conn:
            per_state = conn.execute(
                select(jb.c.name, ck.c.state, func.count(), func.coalesce(func.sum(ck.c.bytes), 0))
                .join(jb, jb.c.id == ck.c.job_id)
                .group_by(jb.c.name, ck.c.state)
                .order_by(jb.c.name, ck.c.state)
            ).all()
            newest = {
                r[0]: r[1]
                for r in conn.execute(
                    select(jb.c.name, func.max(ck.c.step))
                    .join(jb, jb.c.id == ck.c.job_id)
                    .where(ck.c.state == State.VERIFIED.value)
                    .group_by(jb.c.name)
                )
            }
            tiers: dict[str, set[str]] = {}
            for name, tier in conn.execute(
                select(jb.c.name, cp.c.tier)
                .join(ck, ck.c.job_id == jb.c.id)
                .join(cp, cp.c.checkpoint_id == ck.c.id)
                .where(cp.c.state.in_(("present", "degraded")), ck.c.state != State.DELETED.value)
                .distinct()
            ):
                tiers.setdefault(name, set()).add(tier)
        return [
            {
                "job": name, "state": state, "count": int(count), "bytes": int(total),
                "newest_verified_step": None if newest.get(name) is None else int(newest[name]),
                "tiers": sorted(tiers.get(name, ())),
            }
            for name, state, count, total in per_state
        ]


#: Columns a new file row sets; the others (hashes, status, detail,
#: verified_at) start NULL.
_FILE_INSERT_COLUMNS = ("checkpoint_id", "relpath", "size", "mtime", "etag", "sha256_expected")


def _plain_rows(conn: Connection, stmt: Any) -> list[tuple[Any, ...]]:
    """All rows of ``stmt`` as the driver returns them (plain tuples).

    Skips SQLAlchemy's Row construction and result type processing (~1 s
    per million rows here), so only for columns the driver already returns
    as the right Python type: integers, floats and strings, no datetimes or
    JSON.
    """
    result = conn.execute(stmt)
    try:
        return [tuple(row) for row in result.cursor.fetchall()]
    finally:
        result.close()


def _insert_files(conn: Connection, rows: list[tuple[Any, ...]]) -> int:
    """INSERT file rows (tuples in :data:`_FILE_INSERT_COLUMNS` order) with one
    DBAPI ``executemany``; returns the number of rows.

    Goes around SQLAlchemy's per-row parameter processing, which costs ~8 s
    per million rows here against ~1.5 s for the driver alone (a first scan
    of a million-file tree); the columns hold plain ints, floats and strings
    that need no type processing.
    """
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    sql = (
        f"INSERT INTO {fl.name} ({', '.join(_FILE_INSERT_COLUMNS)}) "
        f"VALUES ({', '.join([mark] * len(_FILE_INSERT_COLUMNS))})"
    )
    conn.exec_driver_sql(sql, rows)
    return len(rows)


def _bulk_update(conn: Connection, table: Any, rows: list[dict[str, Any]]) -> int:
    """UPDATE ``table`` by primary key ``_id`` with one executemany; every row
    must carry the same columns. Returns the number of rows."""
    cols = [k for k in rows[0] if k != "_id"]
    conn.execute(
        update(table)
        .where(table.c.id == bindparam("b__id"))
        .values({k: bindparam("b_" + k) for k in cols}),
        [{"b_" + k: v for k, v in row.items()} for row in rows],
    )
    return len(rows)


def _check_copy_state(state: str) -> None:
    if state not in COPY_STATES:
        raise ValueError(f"copy state {state!r} is unknown; use one of {', '.join(COPY_STATES)}")


def _mismatch(size: int, sha256_expected: str | None, crc_recorded: str | None, res: FileCheck) -> str | None:
    """Why an ``ok`` read-back still contradicts the catalog, or None."""
    if res.size is not None and res.size != size:
        return f"size expected {size}, got {res.size}"
    if res.sha256 and sha256_expected and res.sha256.lower() != sha256_expected.lower():
        return f"sha256 expected {sha256_expected}, got {res.sha256}"
    if res.crc64nvme and crc_recorded and res.crc64nvme != crc_recorded:
        return f"crc64nvme expected {crc_recorded}, got {res.crc64nvme}"
    return None
