"""The catalog: what ckptier knows about every checkpoint, and the only way to change it.

``Catalog`` returns the plain domain types of :mod:`ckptier.storage.records`
(never ORM objects) and takes the current time as ``now`` (an aware UTC
datetime) wherever it writes a time; it never reads the clock.

Concurrency: every write is one transaction (``BEGIN IMMEDIATE`` on SQLite).
Leases (:meth:`Catalog.claim`) and fenced deletion (:meth:`Catalog.mark_deleted`)
are single conditional ``UPDATE`` statements, so two runs racing for the same
checkpoint see exactly one winner on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import sqlite3
import threading
from itertools import chain, repeat
from operator import attrgetter
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

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
    tuple_,
    update,
)
from sqlalchemy.exc import OperationalError

from .. import transitions
from ..errors import CkptierError
from ..records import (
    FileCheck,
    CheckpointRecord,
    CopyRecord,
    CopyState,
    DrillOutcome,
    FileRecord,
    FileRef,
    Format,
    Found,
    HELD_COPY_STATES,
    Recognition,
    State,
    Tier,
    metrics_from_json,
    metrics_to_json,
)
from ..gc_pause import paused_gc
from . import db
from .tables import checkpoints as ck
from .tables import copies as cp
from .tables import decisions as dec
from .tables import dir_stamps as ds
from .tables import drills as dr
from .tables import events as ev
from .tables import files as fl
from .tables import jobs as jb
from .tables import recoveries as rc
from .tables import scans as sc

COPY_STATES = tuple(s.value for s in CopyState)
DELETE_SCOPES = ("checkpoint", "hot-copy")
FILE_STATUSES = transitions.FILE_STATUSES
#: How many file names a state reason or event message lists before "+N more".
_NAMES_SHOWN = 3
#: First key of the PostgreSQL advisory locks that serialise scans of one job.
_SCAN_LOCK_CLASS = 0x636B73  # "cks"
# Stored values to enum members by dictionary: ``Enum(value)`` costs ~1 µs a call,
# a noticeable part of listing 100,000 checkpoints.
_FORMATS = {f.value: f for f in Format}
_STATES = {s.value: s for s in State}
_TIERS = {t.value: t for t in Tier}
_COPY_STATES = {c.value: c for c in CopyState}


class UnknownCheckpoint(CkptierError, LookupError):
    """A checkpoint id (or copy) that the catalog does not hold."""


class LeaseLost(CkptierError):
    """A claimed row's lease ran out or was taken over before its result was recorded:
    nothing was written, and the row's new holder records it instead."""


@dataclass(frozen=True)
class ReadBack:
    """One checkpoint's read-back results, to record with :meth:`Catalog.record_verifications`:
    ``results`` per file, the job's ``grace``, ``extra`` files found beside the
    cataloged ones, and the ``claim`` (owner, generation) it is recorded under, if any."""

    checkpoint_id: int
    results: tuple[FileCheck, ...]
    grace: timedelta = transitions.DEFAULT_GRACE
    extra: tuple[str, ...] = ()
    claim: tuple[str, int] | None = None


@dataclass(frozen=True)
class ScanSummary:
    """What :meth:`Catalog.record_scan` found and changed.

    ``rows_written`` counts rows of jobs, checkpoints, files and copies that
    were inserted, updated or deleted (0 on an unchanged rescan). ``new``,
    ``changed``, ``committed``, ``vanished``, ``reappeared``,
    ``resurrected`` and ``corrupt`` (found incomplete past the grace: files
    its manifest lists are missing or short) count checkpoints;
    ``corrupt_found`` names those (job, step, reason).
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
    corrupt: int = 0
    corrupt_found: tuple[tuple[str, int, str], ...] = ()


@dataclass(frozen=True)
class ProcessId:
    """The process holding a lease: ``host`` name, ``pid`` and ``started``, an
    opaque token of the process's start (None when the platform cannot tell),
    so that a pid reused by a later process is not mistaken for the holder."""

    host: str
    pid: int
    started: str | None = None


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a checkpoint's lease: the run's ``owner`` name, the
    ``generation`` it claimed, when the lease runs out, and the holding
    ``process`` when one was recorded."""

    owner: str
    generation: int
    expires: datetime | None
    process: ProcessId | None = None

    @property
    def host(self) -> str | None:
        return self.process.host if self.process else None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def describe(self) -> str:
        """One phrase naming the holder, e.g. ``run-7 (host gpu1 pid 4242, lease until 2026-...)``."""
        parts = [f"host {self.process.host} pid {self.process.pid}"] if self.process else []
        if self.expires is not None:
            parts.append(f"lease until {self.expires.isoformat(timespec='seconds')}")
        return self.owner + (f" ({', '.join(parts)})" if parts else "")


@dataclass(frozen=True)
class DirStampRecord:
    """A checkpoint directory's stamp (see :meth:`Catalog.dir_stamps`): the
    digest, the subdirectories it covers (relative; ``""`` is the directory
    itself) and when it was taken."""

    checkpoint_id: int
    location: str
    stamp: str
    dirs: tuple[str, ...]
    taken_at: datetime
    files: int = 0


@dataclass(frozen=True)
class DeleteIntent:
    """A delete that a run recorded before deleting files and never recorded
    as finished: ``scope`` is ``"checkpoint"`` or ``"hot-copy"``, ``files``
    how many files it was to delete (fewer listed now: it had started)."""

    checkpoint_id: int
    job: str
    step: int
    scope: str
    at: datetime | None
    files: int | None = None


@dataclass(frozen=True)
class LinkedFile:
    """A file of a standing checkpoint (not deleted, its hot copy present) that is
    a symlink: ``link`` is the key, in the same store, of the file it points at."""

    checkpoint_id: int
    job: str
    step: int
    location: str
    relpath: str
    link: str


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


class _DrillRow(NamedTuple):
    """What a checkpoint's record reads of each of its drills (a ``transitions.DrillLike``)."""

    checkpoint_id: int | None
    ok: bool
    started_at: datetime
    finished_at: datetime | None
    error: str | None
    verdict: Any
    outcome: str | None

    @property
    def judged(self) -> bool:
        return self.outcome != NOT_JUDGED


@dataclass(frozen=True)
class DrillRecord:
    """One restore drill. ``timings`` maps phase name to seconds;
    ``peak_memory_bytes`` is the drill process's peak; ``id`` is set on
    records read back from the catalog. ``outcome``: ``passed``,
    ``failed`` or ``not judged`` (None: by ``ok``, as rows written before
    outcomes were recorded); a drill that was not judged is history only,
    never a checkpoint's most recent drill. ``stack``: the versions it ran on."""

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
    outcome: str | None = None
    stack: Mapping[str, Any] = field(default_factory=dict)

    @property
    def judged(self) -> bool:
        """Whether the drill judged the checkpoint (passed or failed)."""
        return self.outcome != NOT_JUDGED

    @property
    def verdict_name(self) -> str:
        """``passed``, ``failed`` or ``not judged``."""
        return self.outcome or ("passed" if self.ok else "failed")


#: The outcome of a drill that could not judge the checkpoint.
NOT_JUDGED = "not judged"


@dataclass(frozen=True)
class RecoveryRecord:
    """One ``resume`` call (a recovery event): ``job`` as asked, when it
    started (``started_at``) and its wall-clock ``seconds``, ``outcome``
    (``resumed`` or ``failed``), the ``step`` and ``checkpoint_id`` chosen
    (None when it failed), how it was proven (``verify``: ``full`` or
    ``quick``), where it is loaded from (``source``: ``hot``, ``archive``,
    ``fetched``; ``path``), the newer checkpoints ``passed_over`` as
    ``(step, reason)`` pairs, newest first, and a failed call's ``error``.
    ``id`` is set on records read back."""

    job: str
    started_at: datetime
    seconds: float
    outcome: str
    verify: str
    step: int | None = None
    checkpoint_id: int | None = None
    source: str | None = None
    path: str | None = None
    passed_over: tuple[tuple[int, str], ...] = ()
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


class _Everywhere:
    """The container of every location (what an inventory scan did not list is not vanished)."""

    def __contains__(self, item: object) -> bool:
        return True


_EVERYWHERE = _Everywhere()


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
    corrupt: int = 0
    corrupt_found: list[tuple[str, int, str]] = field(default_factory=list)


def _row(old: Any) -> transitions.Row:
    """The rules' view of a checkpoints row (any object with its columns as attributes)."""
    return transitions.Row(
        state=State(old.state), reason=old.state_reason, first_seen=old.first_seen, saved_at=old.saved_at,
        verified_at=old.verified_at, missing_since=old.missing_since,
    )


def _seen(found: Found, changed: Sequence[str], gone: Sequence[str], still_gone: Sequence[str]) -> transitions.Seen:
    return transitions.Seen(
        committed=found.committed, reason=found.reason, saved_at=_epoch(found.saved_at),
        shortfalls=found.shortfalls, changed=tuple(changed), gone=tuple(gone), still_gone=tuple(still_gone),
    )


# Column order of the per-job file load in record_scan (tuples, for speed).
_F_ID, _F_CK, _F_REL, _F_SIZE, _F_MTIME, _F_ETAG, _F_EXP, _F_STATUS, _F_CRC, _F_LINK = range(10)


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
        try:
            with db.read_transaction(self._engine) as conn:
                yield conn
        except OperationalError as exc:
            fault = db.catalog_fault(self.url, exc)
            if fault is None:
                raise
            raise fault from exc

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        # A full disk or a read-only filesystem is the machine's, named in one line with the
        # fix (the transaction was rolled back: nothing half-written).
        try:
            with self._engine.begin() as conn:
                yield conn
        except OperationalError as exc:
            fault = db.catalog_fault(self.url, exc)
            if fault is None:
                raise
            raise fault from exc

    # -- scanning ------------------------------------------------------------------

    def record_scan(
        self,
        store_url: str,
        recognition: Recognition,
        *,
        now: datetime,
        scope_prefix: str = "",
        unchanged: Collection[str] = (),
        live: bool = True,
        grace_for: Callable[[str], timedelta] | None = None,
    ) -> ScanSummary:
        """Bring the catalog in line with one listing of ``store_url`` (under
        ``scope_prefix``, a raw key prefix as given to ``Store.list``).

        ``unchanged`` holds hot locations the scan did not list because their
        directory trees had not changed since the last scan (a local rescan's
        skip): their rows are left exactly as they are, neither vanished nor
        compared, and a job with nothing else to record is not read at all.
        ``live=False`` records a past listing (an S3 Inventory report): what
        it lacks is never marked missing and no delete intent is settled.

        * New checkpoints are inserted (``incomplete`` or ``committed`` as the
          recognition says) with their files and a ``hot`` copy at
          ``location = store_url + "/" + prefix``.
        * Changes only are written: an unchanged rescan writes nothing at all
          (no ``last_seen`` bump, no scans row, no event), so ``last_seen`` is
          the time of the last scan that changed the row.
        * Every state change follows :func:`ckptier.storage.transitions.on_scan`
          (and ``on_vanished``): ``incomplete`` becomes ``committed`` when
          commit evidence appears, and a ``committed``/``verified`` one loses
          its evidence → ``incomplete``; a checkpoint whose manifest lists
          files that are absent or short is ``incomplete`` within the job's
          grace (``grace_for(job)``, default 2 h) and ``corrupt`` after.
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
          One that vanished while a delete intent was pending (a run killed
          after deleting its files) is tombstoned instead (its hot copy only,
          for a ``hot-copy`` intent) and the intent cleared.
        * Each job is one transaction: an error leaves earlier jobs written
          and the failing job untouched, and propagates.
        * When anything changed, one ``scans`` row records the statistics
          (bookkeeping rows, events and scans are not counted in
          ``rows_written``).
        """
        now = _aware(now)
        unchanged = frozenset(unchanged)
        base = store_url.rstrip("/")
        scope = base + "/" + scope_prefix.lstrip("/")
        by_job: dict[str, dict[int, Found]] = {}
        for found in recognition.checkpoints:
            steps = by_job.setdefault(found.job, {})
            # One row per (job, step): a committed find beats an uncommitted one.
            if found.step not in steps or (found.committed and not steps[found.step].committed):
                steps[found.step] = found

        with self._read() as conn:
            stale = conn.execute(
                select(jb.c.name, ck.c.location)
                .join(ck, ck.c.job_id == jb.c.id)
                .where(
                    ck.c.location.startswith(scope, autoescape=True),
                    ck.c.state != State.DELETED.value,
                    ck.c.missing_since.is_(None),
                )
            ) if live else ()
            stale_jobs = {name for name, location in stale if location not in unchanged}
            affected = sorted(set(by_job) | stale_jobs)
            # Jobs whose metrics.jsonl the scan read but none of whose checkpoints it listed again.
            metrics_only = sorted(set(recognition.job_metrics) - set(affected))

        tally = _Tally()
        unlisted: Container[str] = unchanged if live else _EVERYWHERE
        # No cyclic garbage collection while the rows are built: a first scan makes
        # a tuple per listed file and no cycles, and each full collection walks the
        # whole listing still held (~0.3 s per collection for 1,000,000 files).
        with paused_gc():
            for name in affected:
                grace = grace_for(name) if grace_for is not None else transitions.DEFAULT_GRACE
                with self._write() as conn:
                    self._scan_job(conn, name, by_job.get(name, {}), base, scope, now, tally, grace,
                                   unlisted=unlisted, job_metrics=recognition.job_metrics.get(name, {}))
                    if live:
                        self._settle_delete_intents(conn, name, scope, now, tally)
            for name in metrics_only:
                with self._write() as conn:
                    self._scan_metrics(conn, name, recognition.job_metrics[name], tally)

        summary = ScanSummary(
            store_url=store_url,
            scope_prefix=scope_prefix,
            objects=recognition.objects,
            checkpoints=len(recognition.checkpoints),
            unrecognised=len(recognition.unrecognised),
            jobs=tuple(sorted(by_job)),
            **{**asdict(tally), "corrupt_found": tuple(tally.corrupt_found)},
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

    def _scan_metrics(
        self, conn: Connection, name: str, job_metrics: Mapping[int, Mapping[str, float]], tally: _Tally
    ) -> None:
        """Apply a job's ``metrics.jsonl`` to its cataloged checkpoints when the scan
        listed none of them again: reads only their ids, steps and metrics."""
        rows = conn.execute(
            select(ck.c.id, ck.c.step, ck.c.metrics)
            .join(jb, jb.c.id == ck.c.job_id)
            .where(jb.c.name == name, ck.c.state != State.DELETED.value, ck.c.step.in_(sorted(job_metrics)))
        ).tuples().all()
        updates = [
            {"_id": int(cid), "metrics": merged}
            for cid, step, text in rows
            if (merged := _merged_metrics(text, job_metrics[int(step)])) != text
        ]
        if updates:
            tally.rows_written += _bulk_update(conn, ck, updates)

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
        grace: timedelta,
        *,
        unlisted: Container[str] = (),
        job_metrics: Mapping[int, Mapping[str, float]] | None = None,
    ) -> None:
        job_metrics = job_metrics or {}
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
                    ck.c.metrics,
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
                fl.c.link,
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
        file_inserts: dict[tuple[str, ...], list[tuple[Any, ...]]] = {}  # by the columns they fill
        file_updates: list[dict[str, Any]] = []
        file_deletes: list[int] = []
        copy_inserts: list[dict[str, Any]] = []
        copy_updates: list[dict[str, Any]] = []
        events: list[dict[str, Any]] = []

        new_events: list[tuple[transitions.Event, ...]] = []

        def event(e: transitions.Event, checkpoint_id: int | None) -> None:
            events.append(
                {"at": now, "kind": e.kind, "message": e.message, "job_id": job_id,
                 "checkpoint_id": checkpoint_id, "data": dict(e.data) if e.data else None}
            )

        for step, found in sorted(found_by_step.items()):
            location = _join_url(base, found.prefix)
            old = existing.get(step)
            label = f"{name} step {step}"
            if old is None:
                t = transitions.on_scan(None, _seen(found, (), (), ()), label=label, location=location, now=now,
                                        grace=grace)
                new_found.append(found)
                new_ck.append(
                    {
                        "job_id": job_id,
                        "step": step,
                        "format": found.format.value,
                        "location": location,
                        "state": t.state.value,
                        "state_reason": t.reason,
                        "bytes": found.bytes,
                        "file_count": len(found.files),
                        "saved_at": _epoch(found.saved_at),
                        "first_seen": now,
                        "last_seen": now,
                        "missing_since": None,
                        "verified_at": None,
                        "recorded_loss": found.recorded_loss,
                        "metrics": metrics_to_json(found.metrics),
                        "generation": 0,
                    }
                )
                new_events.append(t.events)
                if t.state == State.CORRUPT:
                    tally.corrupt += 1
                    tally.corrupt_found.append((name, step, t.reason or ""))
                continue

            cid = int(old.id)
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
                    file_inserts.setdefault(_FILE_INSERT_COLUMNS, []).append(
                        (cid, ref.relpath, ref.size, ref.mtime, ref.etag, exp, ref.link))
                    continue
                same_bytes = (row[_F_SIZE] == ref.size and row[_F_ETAG] == ref.etag and row[_F_LINK] == ref.link
                              and (row[_F_MTIME] == ref.mtime or not transitions.mtime_tells(row[_F_ETAG], ref.etag)))
                if same_bytes and row[_F_EXP] == exp and row[_F_STATUS] != "missing":
                    continue
                changed_names.append(ref.relpath)
                # A committed checkpoint's files never change legitimately: keep the
                # verified crc64nvme as the baseline, so re-verification catches a
                # replaced object even when the format records no hash of its own.
                file_updates.append(
                    {"_id": row[_F_ID], "size": ref.size, "mtime": ref.mtime, "etag": ref.etag,
                     "sha256_expected": exp, "crc64nvme": row[_F_CRC], "sha256": None, "status": None,
                     "detail": None, "verified_at": None, "link": ref.link}
                )
            gone = [rel for rel in old_files if rel not in listed and old_files[rel][_F_STATUS] != "missing"]
            still_gone = [rel for rel in old_files if rel not in listed and old_files[rel][_F_STATUS] == "missing"]
            t = transitions.on_scan(_row(old), _seen(found, changed_names, gone, still_gone), label=label,
                                    location=location, now=now, grace=grace)

            for rel in (*gone, *still_gone):
                row = old_files[rel]
                if t.forget_gone_files:
                    file_deletes.append(row[_F_ID])
                elif row[_F_STATUS] != "missing":
                    file_updates.append(
                        {"_id": row[_F_ID], "size": row[_F_SIZE], "mtime": row[_F_MTIME],
                         "etag": row[_F_ETAG], "sha256_expected": row[_F_EXP], "crc64nvme": None,
                         "sha256": None, "status": "missing",
                         "detail": f"no longer listed by the scan at {now.isoformat()}",
                         "verified_at": None, "link": row[_F_LINK]}
                    )
            for counter in t.counts:
                setattr(tally, counter, getattr(tally, counter) + 1)
            if t.state == State.CORRUPT and old.state != State.CORRUPT.value:
                tally.corrupt += 1
                tally.corrupt_found.append((name, step, t.reason or ""))
            for e in t.events:
                event(e, cid)

            values = {
                "format": found.format.value,
                "location": location,
                "state": t.state.value,
                "state_reason": t.reason,
                "bytes": found.bytes,
                "file_count": len(found.files),
                "saved_at": _epoch(found.saved_at),
                "missing_since": t.missing_since,
                "verified_at": t.verified_at,
                "recorded_loss": found.recorded_loss,
                "metrics": metrics_to_json(found.metrics),
            }
            if any(getattr(old, k) != v for k, v in values.items()):
                ck_updates.append({"_id": cid, "last_seen": now, **values})

            hot = hot_copies.get((cid, location))
            if hot is None:
                copy_inserts.append(self._hot_copy_row(cid, location, found.bytes, now))
            elif hot[1] != CopyState.PRESENT or hot[2] != found.bytes:
                copy_updates.append({"_id": hot[0], "state": CopyState.PRESENT.value, "stored_bytes": found.bytes})

        # Vanished: cataloged under this store and scope, not listed now.
        for step, old in existing.items():
            if (
                step in found_by_step
                or old.location in unlisted  # not listed, and not vanished either
                or old.state == State.DELETED.value
                or old.missing_since is not None
                or not old.location.startswith(scope)
            ):
                continue
            cid = int(old.id)
            hot = hot_copies.get((cid, old.location))
            if hot is not None and hot[1] == CopyState.DELETED:
                continue  # ckptier removed this hot copy on purpose (an archive copy remains)
            t = transitions.on_vanished(_row(old), label=f"{name} step {step}", location=old.location, now=now)
            ck_updates.append(
                {"_id": cid, "last_seen": old.last_seen,
                 **{k: getattr(old, k) for k in (
                     "format", "location", "bytes", "file_count", "saved_at", "recorded_loss", "metrics")},
                 "state": t.state.value, "state_reason": t.reason, "verified_at": t.verified_at,
                 "missing_since": t.missing_since}
            )
            if hot is not None and hot[1] == CopyState.PRESENT:
                copy_updates.append({"_id": hot[0], "state": CopyState.MISSING.value, "stored_bytes": hot[2]})
            for counter in t.counts:
                setattr(tally, counter, getattr(tally, counter) + 1)
            for e in t.events:
                event(e, cid)

        # Metrics the job's metrics.jsonl gives checkpoints this listing did not show again
        # (an unchanged directory a local rescan skipped, or one gone missing).
        metric_updates = [
            {"_id": int(old.id), "metrics": merged}
            for step, old in existing.items()
            if step not in found_by_step and step in job_metrics and old.state != State.DELETED.value
            and (merged := _merged_metrics(old.metrics, job_metrics[step])) != old.metrics
        ]

        # Write.
        if metric_updates:
            tally.rows_written += _bulk_update(conn, ck, metric_updates)
        if new_ck:
            ids = conn.execute(
                insert(ck).returning(ck.c.id, sort_by_parameter_order=True), new_ck
            ).scalars().all()
            for cid, found, found_events in zip(ids, new_found, new_events, strict=True):
                for e in found_events:
                    event(e, cid)
                shape, rows = _new_file_rows(cid, found.files, found.expected_sha256)
                shaped = file_inserts.get(shape)
                if shaped is None:
                    file_inserts[shape] = rows
                else:
                    shaped.extend(rows)
                copy_inserts.append(self._hot_copy_row(cid, _join_url(base, found.prefix), found.bytes, now))
            tally.new += len(new_ck)
            tally.rows_written += len(new_ck)
            event(transitions.discovered(name, [f.step for f in new_found]), None)
        if ck_updates:
            tally.rows_written += _bulk_update(conn, ck, ck_updates)
        if file_deletes:
            conn.execute(delete(fl).where(fl.c.id.in_(file_deletes)))
            tally.rows_written += len(file_deletes)
        if file_updates:
            tally.rows_written += _bulk_update(conn, fl, file_updates)
        for shape, rows in file_inserts.items():
            tally.rows_written += _insert_files(conn, shape, rows)
        if copy_updates:
            tally.rows_written += _bulk_update(conn, cp, copy_updates)
        if copy_inserts:
            conn.execute(insert(cp), copy_inserts)
            tally.rows_written += len(copy_inserts)
        if events:
            conn.execute(insert(ev), events)

    @staticmethod
    def _hot_copy_row(cid: int, url: str, size: int, now: datetime) -> dict[str, Any]:
        return {
            "checkpoint_id": cid, "tier": Tier.HOT.value, "url": url, "state": CopyState.PRESENT.value,
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

    def latest(self, job: str, *, drilled: bool = False) -> CheckpointRecord | None:
        """The checkpoint of ``job`` safe to resume from, or None: see :meth:`choose_latest`."""
        return self.choose_latest(job, drilled=drilled).record

    def choose_latest(self, job: str, *, drilled: bool = False,
                      exclude: Collection[int] = ()) -> transitions.Latest:
        """The highest-step ``verified`` checkpoint of ``job`` that still has a
        ``present`` copy in some tier and whose most recent drill did not fail
        (with ``drilled``: passed), its proof, and the newer ones passed over
        with why (:func:`ckptier.storage.transitions.pick_latest`). The
        chosen record carries its files. ``exclude``: ids of checkpoints not
        to consider (those a caller already looked at and passed over)."""
        has_copy = (
            select(cp.c.id)
            .where(cp.c.checkpoint_id == ck.c.id, cp.c.state == CopyState.PRESENT.value)
            .exists()
        )
        with self._read() as conn:
            ids = list(conn.execute(
                select(ck.c.id).join(jb, jb.c.id == ck.c.job_id)
                .where(jb.c.name == job, ck.c.state == State.VERIFIED.value, has_copy)
                .order_by(ck.c.step.desc())
            ).scalars())
            if exclude:
                ids = [i for i in ids if i not in exclude]
            # Newest first, a few at a time (8, 32, 128...): the answer is nearly always among the
            # newest, so a launcher's `ckptier latest` loads a handful of rows, not the job's 1,000.
            # pick_latest looks newest first and stops at its answer, so a prefix answers as all would.
            candidates: list[CheckpointRecord] = []
            latest = transitions.pick_latest((), drilled=drilled)
            start, size = 0, 8
            while start < len(ids):
                candidates += self._load(conn, [ck.c.id.in_(ids[start:start + size])], with_files=False)
                start, size = start + size, size * 4
                latest = transitions.pick_latest(candidates, drilled=drilled)
                if latest.record is not None:
                    break
            if latest.record is None:
                return latest
            record = self._load(conn, [ck.c.id == latest.record.id], with_files=True)[0]
        return transitions.Latest(record, latest.proof, latest.proven_at, latest.passed_over)

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

    def hot_locations(self) -> list[str]:
        """Every hot location the catalog knows, sorted and distinct: the URLs
        scans recorded and each job's hot directory."""
        with self._read() as conn:
            scanned = set(conn.execute(select(sc.c.url).distinct()).scalars())
            scanned |= set(conn.execute(select(jb.c.hot_url).where(jb.c.hot_url.is_not(None)).distinct()).scalars())
        return sorted(scanned)

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
                   ck.c.state_reason, ck.c.recorded_loss, ck.c.generation, ck.c.metrics)
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
                    fl.c.sha256_expected, fl.c.status, fl.c.detail, fl.c.link)
            for cid, rel, size, mtime, etag, crc, exp, status, detail, link in conn.execute(
                select(fl.c.checkpoint_id, *cols)
                .where(fl.c.checkpoint_id.in_(ids))
                .order_by(fl.c.checkpoint_id, fl.c.relpath)
            ).all():
                files.setdefault(cid, []).append(
                    FileRecord(relpath=rel, size=size, mtime=mtime, etag=etag, crc64nvme=crc,
                               sha256_expected=exp, status=status, detail=detail, link=link)
                )
        # The most recent drill of each by the one rule (transitions.latest_drill: a drill
        # that was not judged is history only); read newest recorded first, so that of two
        # equal drills the later recorded speaks.
        drills = [_DrillRow(*row) for row in conn.execute(
            select(dr.c.checkpoint_id, dr.c.ok, dr.c.started_at, dr.c.finished_at, dr.c.error, dr.c.verdict,
                   dr.c.outcome)
            .where(dr.c.checkpoint_id.in_(ids))
            .order_by(dr.c.id.desc())
        ).tuples()]
        last_drill: dict[int, DrillOutcome] = {}
        for cid, d in transitions.latest_drills(drills).items():
            summary = d.verdict.get("summary") if isinstance(d.verdict, dict) else None
            last_drill[cid] = DrillOutcome(ok=bool(d.ok), at=d.finished_at or d.started_at,
                                           detail=None if d.ok else (d.error or summary))
        copies: dict[int, list[CopyRecord]] = {}
        for ccid, tier, url, cstate, stored, cverified, codec, sclass in conn.execute(
            select(cp.c.checkpoint_id, cp.c.tier, cp.c.url, cp.c.state, cp.c.stored_bytes, cp.c.verified_at,
                   cp.c.codec, cp.c.storage_class)
            .where(cp.c.checkpoint_id.in_(ids)).order_by(cp.c.checkpoint_id, cp.c.tier, cp.c.url)
        ).tuples():
            copies.setdefault(ccid, []).append(
                CopyRecord(tier=_TIERS[tier], url=url, state=_COPY_STATES[cstate], stored_bytes=stored,
                           verified_at=cverified, codec=codec, storage_class=sclass)
            )
        return [
            CheckpointRecord(
                id=cid, job=job, step=step, format=_FORMATS[fmt], state=_STATES[state],
                location=location, bytes=size, saved_at=saved_at, first_seen=first_seen,
                last_seen=last_seen, missing_since=missing_since, verified_at=verified_at,
                state_reason=reason, recorded_loss=loss, generation=generation,
                files=tuple(files.get(cid, ())), copies=tuple(copies.get(cid, ())),
                last_drill=last_drill.get(cid), metrics=metrics_from_json(metrics),
            )
            for (cid, job, step, fmt, state, location, size, saved_at, first_seen, last_seen, missing_since,
                 verified_at, reason, loss, generation, metrics) in rows
        ]

    def links(self, scope: str) -> list[LinkedFile]:
        """Every file that is a symlink (:attr:`FileRecord.link`) of a checkpoint whose
        location starts with ``scope`` (a store's URL and ``/``), that is not a
        tombstone and still has its hot copy there: what a delete of the files
        they point at must leave standing."""
        held = (
            select(cp.c.id)
            .where(cp.c.checkpoint_id == ck.c.id, cp.c.tier == Tier.HOT.value, cp.c.url == ck.c.location,
                   cp.c.state == CopyState.PRESENT.value)
            .exists()
        )
        with self._read() as conn:
            rows = conn.execute(
                select(ck.c.id, jb.c.name, ck.c.step, ck.c.location, fl.c.relpath, fl.c.link)
                .join(ck, ck.c.id == fl.c.checkpoint_id)
                .join(jb, jb.c.id == ck.c.job_id)
                .where(fl.c.link.is_not(None), ck.c.state != State.DELETED.value,
                       ck.c.location.startswith(scope, autoescape=True), held)
                .order_by(jb.c.name, ck.c.step, fl.c.relpath)
            ).tuples().all()
        return [LinkedFile(int(i), job, int(step), loc, rel, link) for i, job, step, loc, rel, link in rows]

    def record_file_changes(self, checkpoint_id: int, changes: Sequence[transitions.Change], *,
                            now: datetime) -> State:
        """Record what a look at the files now found (a ``stat`` or HEAD of each,
        :func:`ckptier.tasks.prove.prove_now`): ``changes`` are the files that
        are not what the catalog holds. Each changed file takes what is there
        now (size, mtime, ETag, link; no status: never verified; the recorded
        crc64nvme stays as the baseline it is held to), a gone one is
        ``missing``, and the checkpoint moves as
        :func:`ckptier.storage.transitions.on_files_changed` says (verified or
        corrupt -> committed: verify again), with its event. Returns the state.
        Raises :class:`UnknownCheckpoint` for an unknown id."""
        now = _aware(now)
        with self._write() as conn:
            head = conn.execute(
                select(ck.c.id, ck.c.job_id, ck.c.step, ck.c.state, ck.c.state_reason, ck.c.location,
                       ck.c.first_seen, ck.c.saved_at, ck.c.verified_at, ck.c.missing_since)
                .where(ck.c.id == checkpoint_id)
            ).first()
            if head is None:
                raise UnknownCheckpoint(f"checkpoint id {checkpoint_id} is not in the catalog; rescan first")
            t = transitions.on_files_changed(_row(head), changes,
                                             label=f"checkpoint {checkpoint_id} (step {head.step})")
            if head.state in (State.INCOMPLETE.value, State.DELETED.value) or not changes:
                return t.state
            ids = dict(conn.execute(select(fl.c.relpath, fl.c.id).where(fl.c.checkpoint_id == checkpoint_id))
                       .tuples().all())
            present = [{"_id": ids[c.relpath], "size": c.now.size, "mtime": c.now.mtime, "etag": c.now.etag,
                        "link": c.now.link, "status": None, "detail": None, "sha256": None, "verified_at": None}
                       for c in changes if c.now is not None and c.relpath in ids]
            gone = [{"_id": ids[c.relpath], "status": "missing", "detail": f"{c.why} ({now.isoformat()})",
                     "verified_at": None} for c in changes if c.now is None and c.relpath in ids]
            for rows in (present, gone):
                if rows:
                    _bulk_update(conn, fl, rows)
            conn.execute(update(ck).where(ck.c.id == checkpoint_id)
                         .values(state=t.state.value, state_reason=t.reason, verified_at=t.verified_at))
            if t.events:
                conn.execute(insert(ev), [{"at": now, "kind": e.kind, "job_id": head.job_id,
                                           "checkpoint_id": checkpoint_id, "message": e.message,
                                           "data": dict(e.data) if e.data else None} for e in t.events])
        return t.state

    # -- verification --------------------------------------------------------------

    def record_verification(
        self,
        checkpoint_id: int,
        results: Sequence[FileCheck],
        *,
        now: datetime,
        grace: timedelta = transitions.DEFAULT_GRACE,
        extra: Sequence[str] = (),
        claim: tuple[str, int] | None = None,
    ) -> State:
        """Record per-file read-back results and return the checkpoint's state.

        ``checked_at`` is set to ``now`` whatever the results. With ``claim``
        (``owner``, ``generation`` of a row claimed by :meth:`claim_rows`), the
        results are recorded only while that lease holds, and the lease is
        released in the same transaction; otherwise :class:`LeaseLost` is
        raised and nothing changes (exactly one holder records a row).

        What the results mean is :func:`ckptier.storage.transitions.on_verification`:
        a file reported ``corrupt``/``missing``, or ``ok`` but contradicting
        the catalog (size, expected sha256, recorded crc64nvme) → ``corrupt``,
        the reason naming the file with expected vs actual; files a manifest
        of the checkpoint requires that are absent or short (results with a
        ``shortfall``; those for files the catalog does not hold are not
        stored as files) → ``incomplete`` within ``grace`` of the save,
        ``corrupt`` after; only ``error`` results → state unchanged; every
        cataloged file ``ok`` → ``verified`` (``verified_at = now`` on the
        checkpoint and its hot copy; ``extra`` files are named in the
        reason). The first ``ok`` verification records the file's crc64nvme.
        ``incomplete`` and ``deleted`` checkpoints keep their state; their
        file results are still recorded. An event is logged for every state
        change. Raises :class:`UnknownCheckpoint` for an unknown id and
        ``ValueError`` for a result naming a file the catalog does not list.
        """
        (outcome,) = self.record_verifications(
            [ReadBack(checkpoint_id, tuple(results), grace=grace, extra=tuple(extra), claim=claim)], now=now)
        if isinstance(outcome, LeaseLost):
            raise outcome
        return outcome

    def record_verifications(self, items: Sequence[ReadBack], *, now: datetime) -> list[State | LeaseLost]:
        """Record several checkpoints' read-backs in one transaction, each as
        :meth:`record_verification` does; returns, in order, each one's state,
        or the :class:`LeaseLost` (not raised) of an item whose ``claim`` no
        longer holds (that item changes nothing; the others are recorded).

        The statements are per batch, not per checkpoint (the rows are read
        with one query each and written with one executemany each), so a
        verification run records its results at a small fixed cost per
        batch. Raises :class:`UnknownCheckpoint` for an unknown id and
        ``ValueError`` for a result naming a file the catalog does not
        list; then nothing of the batch is recorded.
        """
        now = _aware(now)
        if not items:
            return []
        ids = list(dict.fromkeys(i.checkpoint_id for i in items))
        if len(ids) != len(items):
            raise ValueError("record_verifications: a checkpoint id appears twice in one batch; record it once")
        with self._write() as conn:
            heads = {
                r.id: r for r in conn.execute(
                    select(ck.c.id, ck.c.job_id, ck.c.step, ck.c.state, ck.c.state_reason, ck.c.location,
                           ck.c.first_seen, ck.c.saved_at, ck.c.verified_at, ck.c.missing_since)
                    .where(ck.c.id.in_(ids))
                )
            }
            for cid in ids:
                if cid not in heads:
                    raise UnknownCheckpoint(f"checkpoint id {cid} is not in the catalog; rescan first")
            outcomes: list[State | LeaseLost] = []
            files_by_ck: dict[int, dict[str, Any]] = {cid: {} for cid in ids}
            for r in conn.execute(
                select(fl.c.id, fl.c.checkpoint_id, fl.c.relpath, fl.c.size, fl.c.crc64nvme, fl.c.sha256,
                       fl.c.sha256_expected, fl.c.status)
                .where(fl.c.checkpoint_id.in_(ids))
            ):
                files_by_ck[r.checkpoint_id][r.relpath] = r
            file_updates: list[dict[str, Any]] = []
            states: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
            hot_verified: list[dict[str, Any]] = []
            events: list[dict[str, Any]] = []
            released = self._release_claims(conn, [i for i in items if i.claim is not None], now=now)
            for item in items:
                head = heads[item.checkpoint_id]
                if item.claim is not None and item.checkpoint_id not in released:
                    outcomes.append(LeaseLost(
                        f"checkpoint id {item.checkpoint_id} (step {head.step}): the claim of {item.claim[0]} at "
                        f"generation {item.claim[1]} ran out or was taken over; its new holder verifies it"))
                    continue
                rows = files_by_ck[item.checkpoint_id]
                files = [FileRecord(r.relpath, r.size, None, None, r.crc64nvme, r.sha256_expected, r.status, None)
                         for r in rows.values()]
                v = transitions.on_verification(
                    _row(head), files, item.results, label=f"checkpoint {item.checkpoint_id} (step {head.step})",
                    now=now, grace=item.grace, extra=item.extra,
                )
                file_updates.extend(
                    {"_id": rows[f.relpath].id, "status": f.status, "detail": f.detail, "verified_at": now,
                     "crc64nvme": f.crc64nvme, "sha256": f.sha256 if f.sha256 else rows[f.relpath].sha256}
                    for f in v.files
                )
                t = v.transition
                verified = t.state == State.VERIFIED
                values: dict[str, Any] = {"_id": item.checkpoint_id, "state": t.state.value,
                                          "state_reason": t.reason, "checked_at": now}
                if verified:
                    values["verified_at"] = t.verified_at
                    hot_verified.append({"b_ck": item.checkpoint_id, "b_url": head.location})
                states[verified].append(values)
                events.extend({"at": now, "kind": e.kind, "job_id": head.job_id, "checkpoint_id": item.checkpoint_id,
                               "message": e.message, "data": dict(e.data) if e.data else None} for e in t.events)
                outcomes.append(t.state)
            if file_updates:
                _bulk_update(conn, fl, file_updates)
            for group in states.values():
                if group:
                    _bulk_update(conn, ck, group)
            if hot_verified:
                conn.execute(
                    update(cp)
                    .where(cp.c.checkpoint_id == bindparam("b_ck"), cp.c.tier == Tier.HOT.value,
                           cp.c.url == bindparam("b_url"), cp.c.state == CopyState.PRESENT.value)
                    .values(verified_at=now),
                    hot_verified,
                )
            if events:
                conn.execute(insert(ev), events)
            return outcomes

    @staticmethod
    def _release_claims(conn: Connection, items: Sequence[ReadBack], *, now: datetime) -> set[int]:
        """Release the leases ``items`` were claimed under, each only while its holder
        still holds it at its generation; the ids released (one statement per owner)."""
        released: set[int] = set()
        by_owner: dict[str, list[tuple[int, int]]] = {}
        for i in items:
            assert i.claim is not None
            by_owner.setdefault(i.claim[0], []).append((i.checkpoint_id, i.claim[1]))
        for owner, pairs in by_owner.items():
            released.update(conn.execute(
                update(ck)
                .where(tuple_(ck.c.id, ck.c.generation).in_(pairs), ck.c.lease_owner == owner, ck.c.lease_expires > now)
                .values(lease_owner=None, lease_expires=None, lease_host=None, lease_pid=None, lease_started=None)
                .returning(ck.c.id)
            ).scalars())
        return released

    # -- copies --------------------------------------------------------------------

    def add_copy(
        self,
        checkpoint_id: int,
        *,
        tier: Tier,
        url: str,
        state: CopyState = CopyState.PRESENT,
        stored_bytes: int | None,
        codec: str | None,
        manifest_key: str | None,
        verified_at: datetime | None,
        now: datetime,
        storage_class: str | None = None,
    ) -> None:
        """Insert or update (on ``(checkpoint_id, tier, url)``) a copy of a
        checkpoint. ``created_at`` is set on insert only. ``storage_class``:
        the S3 class its objects were confirmed in. Idempotent."""
        now = _aware(now)
        state = _check_copy_state(state)
        if verified_at is not None:
            verified_at = _aware(verified_at, "verified_at")
        values = {
            "state": state.value, "stored_bytes": stored_bytes, "codec": codec,
            "manifest_key": manifest_key, "verified_at": verified_at, "storage_class": storage_class,
        }
        stmt = self._insert(cp).values(
            checkpoint_id=checkpoint_id, tier=Tier(tier).value, url=url, created_at=now, **values
        )
        stmt = stmt.on_conflict_do_update(index_elements=["checkpoint_id", "tier", "url"], set_=values)
        with self._write() as conn:
            self._require(conn, checkpoint_id)
            conn.execute(stmt)

    def set_copy_state(self, checkpoint_id: int, *, tier: Tier, url: str, state: CopyState, now: datetime) -> None:
        """Set the state of an existing copy; raises :class:`UnknownCheckpoint`
        when there is no such copy. Logs an event when the state changes."""
        now = _aware(now)
        state = _check_copy_state(state)
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
            conn.execute(update(cp).where(cp.c.id == row.id).values(state=state.value))
            conn.execute(
                insert(ev).values(
                    at=now, kind="copy-" + state.value, job_id=row.job_id, checkpoint_id=checkpoint_id,
                    message=f"step {row.step}: {Tier(tier).value} copy {url}: {row.state} -> {state.value}",
                    data={"tier": Tier(tier).value, "url": url, "from": row.state, "to": state.value},
                )
            )

    @staticmethod
    def _require(conn: Connection, checkpoint_id: int) -> None:
        if conn.execute(select(ck.c.id).where(ck.c.id == checkpoint_id)).first() is None:
            raise UnknownCheckpoint(f"checkpoint id {checkpoint_id} is not in the catalog; rescan first")

    # -- leases and fenced deletion -------------------------------------------------

    @staticmethod
    def _held(checkpoint_id: int, owner: str, generation: int, now: datetime) -> ColumnElement[bool]:
        """The fence: ``owner`` holds an unexpired lease on the checkpoint at ``generation``."""
        return and_(
            ck.c.id == checkpoint_id,
            ck.c.lease_owner == owner,
            ck.c.generation == generation,
            ck.c.lease_expires > now,
        )

    def claim(
        self,
        checkpoint_id: int,
        owner: str,
        *,
        now: datetime,
        ttl: timedelta,
        process: ProcessId | None = None,
        take_over: Callable[[LeaseHolder], bool] | None = None,
    ) -> int | None:
        """Take the lease on a checkpoint for ``ttl``; return the new generation,
        or None when another holder (``owner`` included) keeps it.

        One conditional UPDATE: atomic on PostgreSQL (row lock, re-checked
        after waiting) and SQLite (``BEGIN IMMEDIATE``). Every successful
        claim bumps the generation, fencing out the previous holder.
        ``process`` (this run's host, pid and process start) is recorded with
        the lease. When the lease is held and unexpired, ``take_over(holder)``
        (called outside any transaction: it may look at the process table)
        may say the holder is gone; the lease is then taken over with a
        compare-and-swap on the holder's generation, and a
        ``lease.taken_over`` event names the old holder.
        """
        now = _aware(now)
        if ttl <= timedelta(0):
            raise ValueError(f"lease ttl={ttl} must be positive")
        if not owner:
            raise ValueError("lease owner is empty; pass a unique run id")
        values = {
            "lease_owner": owner, "lease_expires": now + ttl, "generation": ck.c.generation + 1,
            "lease_host": process.host if process else None, "lease_pid": process.pid if process else None,
            "lease_started": process.started if process else None,
        }
        free = or_(ck.c.lease_owner.is_(None), ck.c.lease_expires.is_(None), ck.c.lease_expires <= now)
        with self._write() as conn:
            generation = conn.execute(
                update(ck).where(ck.c.id == checkpoint_id, free).values(**values).returning(ck.c.generation)
            ).scalar()
            if generation is not None:
                return int(generation)
            self._require(conn, checkpoint_id)
        if take_over is None:
            return None
        current = self.lease_holder(checkpoint_id, now=now)
        if current is None:  # released meanwhile: claim it the plain way
            return self.claim(checkpoint_id, owner, now=now, ttl=ttl, process=process)
        if not take_over(current):
            return None
        with self._write() as conn:
            row = conn.execute(
                update(ck)
                .where(ck.c.id == checkpoint_id, ck.c.lease_owner == current.owner,
                       ck.c.generation == current.generation)
                .values(**values)
                .returning(ck.c.generation, ck.c.job_id, ck.c.step)
            ).first()
            if row is None:
                return None  # someone else moved first
            conn.execute(
                insert(ev).values(
                    at=now, kind="lease.taken_over", job_id=row.job_id, checkpoint_id=checkpoint_id,
                    message=f"step {row.step}: lease of {current.describe()} taken over by {owner}: "
                            f"its process is gone",
                    data={"from": current.owner, "from_generation": current.generation, "host": current.host,
                          "pid": current.pid, "to": owner, "generation": int(row.generation)},
                )
            )
            return int(row.generation)

    def claim_rows(
        self,
        ids: Sequence[int],
        owner: str,
        *,
        now: datetime,
        ttl: timedelta,
        since: datetime,
        limit: int,
        process: ProcessId | None = None,
    ) -> list[tuple[int, int]]:
        """Lease up to ``limit`` of the checkpoints ``ids`` that nobody holds and that
        no verification finished at or after ``since`` (``checked_at``); returns
        ``(id, generation)`` pairs in id order (empty: nothing free now).

        The lease is the one :meth:`claim` takes (owner, expiry, process, a new
        generation), so tiering and verification never hold one row at once,
        a heartbeat (:meth:`renew`) keeps it, and a dead holder's rows come
        free when it runs out. One statement: on PostgreSQL the candidates are
        locked ``FOR UPDATE SKIP LOCKED`` (concurrent claimers take disjoint
        rows without waiting); on SQLite the conditional ``UPDATE`` runs under
        ``BEGIN IMMEDIATE``. Several processes claiming the same ``ids`` thus
        each get different rows.
        """
        now, since = _aware(now), _aware(since, "since")
        if ttl <= timedelta(0):
            raise ValueError(f"lease ttl={ttl} must be positive")
        if not owner:
            raise ValueError("lease owner is empty; pass a unique run id")
        if limit < 1 or not ids:
            return []
        free = or_(ck.c.lease_owner.is_(None), ck.c.lease_expires.is_(None), ck.c.lease_expires <= now)
        unchecked = or_(ck.c.checked_at.is_(None), ck.c.checked_at < since)
        pick = select(ck.c.id).where(ck.c.id.in_(list(ids)), free, unchecked).order_by(ck.c.id).limit(limit)
        values = {
            "lease_owner": owner, "lease_expires": now + ttl, "generation": ck.c.generation + 1,
            "lease_host": process.host if process else None, "lease_pid": process.pid if process else None,
            "lease_started": process.started if process else None,
        }
        if self.dialect == "postgresql":  # a CTE is evaluated once: never more than ``limit`` rows
            picked = pick.with_for_update(skip_locked=True).cte("picked")
            stmt = update(ck).where(ck.c.id == picked.c.id)
        else:
            stmt = update(ck).where(ck.c.id.in_(pick.scalar_subquery()))
        with self._write() as conn:
            rows = conn.execute(stmt.values(**values).returning(ck.c.id, ck.c.generation)).tuples().all()
        return sorted((int(i), int(g)) for i, g in rows)

    def finish_claim(self, checkpoint_id: int, owner: str, generation: int, *, now: datetime) -> bool:
        """End a claim of :meth:`claim_rows` without recording a verification: set
        ``checked_at = now`` and release the lease, only while ``owner`` holds it at
        ``generation``; False (nothing changes) when the lease was lost."""
        now = _aware(now)
        with self._write() as conn:
            return conn.execute(
                update(ck).where(self._held(checkpoint_id, owner, generation, now))
                .values(checked_at=now, lease_owner=None, lease_expires=None, lease_host=None, lease_pid=None,
                        lease_started=None)
            ).rowcount == 1

    def unchecked(self, ids: Sequence[int], *, since: datetime) -> int:
        """How many of the checkpoints ``ids`` no verification finished at or after ``since``
        (free or leased): what a sweep sharing them still waits for."""
        since = _aware(since, "since")
        if not ids:
            return 0
        with self._read() as conn:
            return int(conn.execute(
                select(func.count()).select_from(ck)
                .where(ck.c.id.in_(list(ids)), or_(ck.c.checked_at.is_(None), ck.c.checked_at < since))
            ).scalar_one())

    def get_many(self, ids: Iterable[int]) -> list[CheckpointRecord]:
        """The checkpoints with these ids (any state, with files), ordered by job and step."""
        wanted = list(ids)
        if not wanted:
            return []
        with self._read() as conn:
            return self._load(conn, [ck.c.id.in_(wanted)], with_files=True)

    def lease_holder(self, checkpoint_id: int, *, now: datetime) -> LeaseHolder | None:
        """Who holds an unexpired lease on the checkpoint at ``now``, or None."""
        now = _aware(now)
        with self._read() as conn:
            r = conn.execute(
                select(ck.c.lease_owner, ck.c.generation, ck.c.lease_expires, ck.c.lease_host, ck.c.lease_pid,
                       ck.c.lease_started)
                .where(ck.c.id == checkpoint_id, ck.c.lease_owner.is_not(None), ck.c.lease_expires > now)
            ).first()
        if r is None:
            return None
        process = ProcessId(r.lease_host, int(r.lease_pid), r.lease_started) if r.lease_host and r.lease_pid else None
        return LeaseHolder(owner=r.lease_owner, generation=int(r.generation), expires=r.lease_expires,
                           process=process)

    def renew(self, checkpoint_id: int, owner: str, generation: int, *, now: datetime, ttl: timedelta) -> datetime | None:
        """Extend ``owner``'s unexpired lease at ``generation`` to ``now + ttl``
        (the heartbeat of a live run); the new expiry, or None when the lease
        was lost (expired or taken over): the run must then stop acting on it."""
        now = _aware(now)
        with self._write() as conn:
            result = conn.execute(
                update(ck).where(self._held(checkpoint_id, owner, generation, now)).values(lease_expires=now + ttl)
            )
            return now + ttl if result.rowcount == 1 else None

    def release(self, checkpoint_id: int, owner: str, generation: int) -> bool:
        """Give the lease back; False (and nothing changes) when ``owner`` at
        ``generation`` no longer holds it. The generation is kept."""
        with self._write() as conn:
            result = conn.execute(
                update(ck)
                .where(ck.c.id == checkpoint_id, ck.c.lease_owner == owner, ck.c.generation == generation)
                .values(lease_owner=None, lease_expires=None, lease_host=None, lease_pid=None, lease_started=None)
            )
            return result.rowcount == 1

    def record_delete_intent(
        self, checkpoint_id: int, *, owner: str, generation: int, scope: str, files: int, now: datetime
    ) -> bool:
        """Record, before any file is deleted, that ``owner`` is deleting the
        checkpoint (``scope="checkpoint"``) or only its hot copy
        (``"hot-copy"``): its ``files`` files. Fenced like
        :meth:`mark_deleted`; False and nothing changes when fenced out. The
        tombstone clears it; a run killed between leaves it for a rescan or
        the next apply to resolve."""
        now = _aware(now)
        if scope not in DELETE_SCOPES:
            raise ValueError(f"delete scope {scope!r} is unknown; use one of {', '.join(DELETE_SCOPES)}")
        with self._write() as conn:
            result = conn.execute(
                update(ck).where(self._held(checkpoint_id, owner, generation, now))
                .values(delete_intent=scope, delete_intent_at=now, delete_intent_files=files)
            )
            return result.rowcount == 1

    def clear_delete_intent(self, checkpoint_id: int, *, owner: str, generation: int, now: datetime, why: str) -> bool:
        """Drop a delete intent whose delete never started (every file still
        present); fenced. Logs ``delete.intent_cleared`` with ``why``."""
        now = _aware(now)
        with self._write() as conn:
            row = conn.execute(
                update(ck).where(self._held(checkpoint_id, owner, generation, now), ck.c.delete_intent.is_not(None))
                .values(delete_intent=None, delete_intent_at=None, delete_intent_files=None)
                .returning(ck.c.job_id, ck.c.step)
            ).first()
            if row is None:
                return False
            conn.execute(insert(ev).values(
                at=now, kind="delete.intent_cleared", job_id=row.job_id, checkpoint_id=checkpoint_id,
                message=f"step {row.step}: delete intent cleared: {why}", data={"owner": owner}))
            return True

    def delete_intents(self, *, job: str | None = None) -> list[DeleteIntent]:
        """Pending delete intents (deletes a run started and never recorded
        as finished), ordered by job and step."""
        q = (
            select(ck.c.id, jb.c.name, ck.c.step, ck.c.delete_intent, ck.c.delete_intent_at, ck.c.delete_intent_files)
            .join(jb, jb.c.id == ck.c.job_id)
            .where(ck.c.delete_intent.is_not(None))
            .order_by(jb.c.name, ck.c.step)
        )
        if job is not None:
            q = q.where(jb.c.name == job)
        with self._read() as conn:
            return [DeleteIntent(checkpoint_id=r.id, job=r.name, step=int(r.step), scope=r.delete_intent,
                                 at=r.delete_intent_at, files=r.delete_intent_files) for r in conn.execute(q)]

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
        ``deleted``, clears the delete intent and logs a ``deleted`` event
        with the reasons. Returns False and changes nothing when fenced out (a
        zombie run).
        """
        now = _aware(now)
        with self._write() as conn:
            row = conn.execute(
                update(ck)
                .where(self._held(checkpoint_id, owner, generation, now))
                .values(state=State.DELETED.value, state_reason="; ".join(reasons) or "deleted",
                        delete_intent=None, delete_intent_at=None, delete_intent_files=None)
                .returning(ck.c.job_id, ck.c.step, ck.c.location)
            ).first()
            if row is None:
                return False
            conn.execute(
                update(cp)
                .where(cp.c.checkpoint_id == checkpoint_id, cp.c.tier == Tier.HOT.value)
                .values(state=CopyState.DELETED.value)
            )
            conn.execute(
                insert(ev).values(
                    at=now, kind="deleted", job_id=row.job_id, checkpoint_id=checkpoint_id,
                    message=f"step {row.step}: deleted {row.location}: {'; '.join(reasons) or 'no reason given'}",
                    data={"reasons": list(reasons), "owner": owner, "generation": generation},
                )
            )
            return True

    def mark_hot_copy_deleted(
        self,
        checkpoint_id: int,
        *,
        owner: str,
        generation: int,
        now: datetime,
        reasons: Sequence[str],
    ) -> bool:
        """Record that only the checkpoint's hot copy was deleted (an archive
        copy remains): the hot copy becomes ``deleted``, the state is kept,
        the delete intent is cleared and a ``copy-deleted`` event logged.
        Fenced like :meth:`mark_deleted`."""
        now = _aware(now)
        with self._write() as conn:
            row = conn.execute(
                update(ck)
                .where(self._held(checkpoint_id, owner, generation, now))
                .values(delete_intent=None, delete_intent_at=None, delete_intent_files=None)
                .returning(ck.c.job_id, ck.c.step, ck.c.location)
            ).first()
            if row is None:
                return False
            conn.execute(
                update(cp)
                .where(cp.c.checkpoint_id == checkpoint_id, cp.c.tier == Tier.HOT.value, cp.c.url == row.location)
                .values(state=CopyState.DELETED.value)
            )
            conn.execute(
                insert(ev).values(
                    at=now, kind="copy-deleted", job_id=row.job_id, checkpoint_id=checkpoint_id,
                    message=f"step {row.step}: hot copy {row.location} deleted: "
                            f"{'; '.join(reasons) or 'no reason given'}",
                    data={"tier": Tier.HOT.value, "url": row.location, "to": CopyState.DELETED.value, "reasons": list(reasons),
                          "owner": owner, "generation": generation},
                )
            )
            return True

    def _settle_delete_intents(self, conn: Connection, name: str, scope: str, now: datetime, tally: _Tally) -> None:
        """Tombstone the checkpoints of job ``name`` under ``scope`` that have
        a delete intent and that this scan found gone: a run was killed after
        deleting their files and before recording it. A checkpoint still
        partly listed keeps its intent (the next apply finishes the delete)."""
        rows = conn.execute(
            select(ck.c.id, ck.c.job_id, ck.c.step, ck.c.location, ck.c.delete_intent, ck.c.state)
            .join(jb, jb.c.id == ck.c.job_id)
            .where(jb.c.name == name, ck.c.delete_intent.is_not(None), ck.c.missing_since.is_not(None),
                   ck.c.location.startswith(scope, autoescape=True))
        ).all()
        for r in rows:
            whole = r.delete_intent == "checkpoint" and r.state != State.DELETED.value
            why = "an interrupted delete: a rescan found every file gone"
            values: dict[str, Any] = {"delete_intent": None, "delete_intent_at": None, "delete_intent_files": None,
                                      "missing_since": None}
            if whole:
                values.update(state=State.DELETED.value, state_reason=why)
            conn.execute(update(ck).where(ck.c.id == r.id).values(**values))
            conn.execute(
                update(cp).where(cp.c.checkpoint_id == r.id, cp.c.tier == Tier.HOT.value, cp.c.url == r.location)
                .values(state=CopyState.DELETED.value)
            )
            conn.execute(insert(ev).values(
                at=now, kind="deleted" if whole else "copy-deleted", job_id=r.job_id,
                checkpoint_id=r.id,
                message=f"step {r.step}: {'deleted' if whole else 'hot copy deleted'} {r.location}: {why}",
                data={"reasons": [why], "settled_by": "scan", "scope": r.delete_intent}))
            tally.rows_written += 1

    # -- forgetting -------------------------------------------------------------------

    def forget(self, checkpoint_id: int, *, missing_since: datetime, now: datetime, reason: str) -> bool:
        """Tombstone a checkpoint whose files the caller has just found gone from every tier.

        For rows a scan marked missing that will never come back (a trainer
        that rotates its own checkpoints). Conditional, in one transaction:
        only while the row is live, still missing since ``missing_since`` (a
        scan that saw it reappear in between wins) and holds no unexpired
        lease. Sets the state ``deleted`` with ``reason``, every copy not
        already ``deleted`` to ``missing``, and logs a ``forgotten`` event.
        Returns False and changes nothing otherwise. A tombstone whose files
        reappear is revived by the next scan, as any other.
        """
        now = _aware(now)
        missing_since = _aware(missing_since, "missing_since")
        with self._write() as conn:
            row = conn.execute(
                update(ck)
                .where(
                    ck.c.id == checkpoint_id,
                    ck.c.state != State.DELETED.value,
                    ck.c.missing_since == missing_since,
                    or_(ck.c.lease_owner.is_(None), ck.c.lease_expires.is_(None), ck.c.lease_expires <= now),
                )
                .values(state=State.DELETED.value, state_reason=reason)
                .returning(ck.c.job_id, ck.c.step, ck.c.location, ck.c.state_reason)
            ).first()
            if row is None:
                return False
            conn.execute(
                update(cp)
                .where(cp.c.checkpoint_id == checkpoint_id, cp.c.state != CopyState.DELETED.value)
                .values(state=CopyState.MISSING.value)
            )
            conn.execute(
                insert(ev).values(
                    at=now, kind="forgotten", job_id=row.job_id, checkpoint_id=checkpoint_id,
                    message=f"step {row.step}: forgotten ({row.location}): {reason}",
                    data={"missing_since": missing_since.isoformat()},
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
                        error=drill.error, outcome=drill.outcome, stack=dict(drill.stack) or None,
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
                    peak_memory_bytes=r.peak_memory_bytes, error=r.error, id=r.id, outcome=r.outcome,
                    stack=r.stack or {},
                )
                for r in conn.execute(q)
            ]

    # -- recovery events ------------------------------------------------------

    def record_recovery(self, recovery: RecoveryRecord) -> int:
        """Store one recovery event and return its id. The job need not be known
        to the catalog (an attempt for an unknown name is an attempt); a
        ``checkpoint_id`` that no longer exists is stored as None."""
        started = _aware(recovery.started_at, "started_at")
        with self._write() as conn:
            cid = recovery.checkpoint_id
            if cid is not None and conn.execute(select(ck.c.id).where(ck.c.id == cid)).first() is None:
                cid = None
            return int(conn.execute(
                insert(rc).values(
                    job=recovery.job, started_at=started, seconds=float(recovery.seconds), outcome=recovery.outcome,
                    step=recovery.step, checkpoint_id=cid, verify=recovery.verify, source=recovery.source,
                    path=recovery.path, passed_over=[{"step": s, "reason": r} for s, r in recovery.passed_over],
                    error=recovery.error,
                ).returning(rc.c.id)
            ).scalar_one())

    def recoveries(self, *, job: str | None = None, since: datetime | None = None,
                   limit: int | None = None) -> list[RecoveryRecord]:
        """Recovery events newest first (by start, then id): of ``job`` (every job
        without it), started at or after ``since``, at most ``limit``."""
        q = select(rc)
        if job is not None:
            q = q.where(rc.c.job == job)
        if since is not None:
            q = q.where(rc.c.started_at >= _aware(since, "since"))
        q = q.order_by(rc.c.started_at.desc(), rc.c.id.desc())
        if limit is not None:
            q = q.limit(limit)
        with self._read() as conn:
            return [
                RecoveryRecord(
                    job=r.job, started_at=r.started_at, seconds=float(r.seconds), outcome=r.outcome, verify=r.verify,
                    step=r.step, checkpoint_id=r.checkpoint_id, source=r.source, path=r.path,
                    passed_over=tuple((int(p["step"]), str(p["reason"])) for p in (r.passed_over or [])),
                    error=r.error, id=r.id,
                )
                for r in conn.execute(q)
            ]

    # -- directory stamps (local rescans) ------------------------------------

    def dir_stamps(self, scope: str) -> dict[str, DirStampRecord]:
        """Stamps of the checkpoints whose hot location starts with ``scope``,
        by location, for those a rescan may skip only: ``committed`` or
        ``verified``, not missing, no delete intent pending, the hot copy
        present at the location the stamp was taken of."""
        with self._read() as conn:
            rows = conn.execute(
                select(ds.c.checkpoint_id, ds.c.location, ds.c.stamp, ds.c.dirs, ds.c.taken_at, ck.c.file_count)
                .join(ck, ck.c.id == ds.c.checkpoint_id)
                .join(cp, (cp.c.checkpoint_id == ck.c.id) & (cp.c.url == ck.c.location))
                .where(
                    ds.c.location.startswith(scope, autoescape=True),
                    ds.c.location == ck.c.location,
                    ck.c.state.in_([State.COMMITTED.value, State.VERIFIED.value]),
                    ck.c.missing_since.is_(None),
                    ck.c.delete_intent.is_(None),
                    cp.c.tier == Tier.HOT.value,
                    cp.c.state == "present",
                )
            ).all()
        return {
            r.location: DirStampRecord(int(r.checkpoint_id), r.location, r.stamp, tuple(r.dirs.split("\n")),
                                       r.taken_at, int(r.file_count))
            for r in rows
        }

    def put_dir_stamps(self, stamps: Mapping[str, tuple[str, Sequence[str]]], *, now: datetime) -> int:
        """Record ``stamps`` (hot location -> (digest, subdirectories)), replacing
        the stamps those checkpoints had; locations no checkpoint is at are
        ignored. Bookkeeping: not counted as catalog rows written. Returns
        how many stamps were recorded."""
        now = _aware(now)
        written = 0
        items = sorted(stamps.items())
        with self._write() as conn:
            for start in range(0, len(items), 500):
                chunk = dict(items[start : start + 500])
                ids = dict(conn.execute(select(ck.c.location, ck.c.id).where(ck.c.location.in_(list(chunk)))).tuples().all())
                if not ids:
                    continue
                conn.execute(delete(ds).where(ds.c.checkpoint_id.in_(list(ids.values()))))
                conn.execute(insert(ds), [
                    {"checkpoint_id": cid, "location": loc, "stamp": chunk[loc][0],
                     "dirs": "\n".join(chunk[loc][1]), "taken_at": now}
                    for loc, cid in ids.items()
                ])
                written += len(ids)
        return written

    def drop_dir_stamps(self, locations: Collection[str]) -> None:
        """Forget the stamps taken of ``locations`` (their next scan lists them)."""
        items = sorted(set(locations))
        with self._write() as conn:
            for start in range(0, len(items), 500):
                conn.execute(delete(ds).where(ds.c.location.in_(items[start : start + 500])))

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
                .where(cp.c.state.in_(sorted(s.value for s in HELD_COPY_STATES)), ck.c.state != State.DELETED.value)
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
_FILE_INSERT_COLUMNS = ("checkpoint_id", "relpath", "size", "mtime", "etag", "sha256_expected", "link")
_RELPATH = attrgetter("relpath")
_SIZE = attrgetter("size")
_MTIME = attrgetter("mtime")
_LINK = attrgetter("link")
_ETAG = attrgetter("etag")


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


def _new_file_rows(
    cid: int, files: Sequence[FileRef], hashes: Mapping[str, str]
) -> tuple[tuple[str, ...], list[tuple[Any, ...]]]:
    """The new file rows of checkpoint ``cid``: the columns they fill (some
    of :data:`_FILE_INSERT_COLUMNS`, in its order) and one tuple per file
    in that order.

    ``checkpoint_id``, ``relpath`` and ``size`` are always there. A column
    that is None for every file is left out (the database fills in NULL):
    binding a None costs the driver an adaptation lookup per value,
    about 0.4 s per million, and a local listing has no etags and most
    formats no hashes. The columns are gathered with ``map`` and joined with
    ``zip``, no Python step per file (a first scan makes one row per listed
    file).
    """
    relpaths = list(map(_RELPATH, files))
    columns: dict[str, list[Any]] = {"relpath": relpaths, "size": list(map(_SIZE, files))}
    for name, values in (("mtime", map(_MTIME, files)), ("etag", map(_ETAG, files)),
                         ("sha256_expected", map(hashes.get, relpaths) if hashes else ()),
                         ("link", map(_LINK, files))):
        kept = list(values)
        if kept.count(None) < len(kept):
            columns[name] = kept
    return ("checkpoint_id", *columns), list(zip(repeat(cid, len(files)), *columns.values(), strict=True))


#: Rows one INSERT of new file rows carries at most (see :func:`_insert_files`).
FILE_ROWS_PER_INSERT = 500


def _insert_files(conn: Connection, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> int:
    """INSERT file rows (tuples of ``columns``, names from
    :data:`_FILE_INSERT_COLUMNS`; the others are NULL); returns the number of
    rows.

    Many rows per statement (``INSERT ... VALUES (...), (...), ...``, at most
    :data:`FILE_ROWS_PER_INSERT` and the driver's limit on parameters), so
    that a first scan of a million files is two thousand statements, not a
    million steps of one. Measured on SQLite: 0.8 s per million rows, against
    1.6 s for ``executemany`` of one row at a time. Every statement but the
    last has the same text, which the driver prepares once. Goes around
    SQLAlchemy's per-row parameter processing, which costs ~8 s per million
    rows here: the columns hold plain ints, floats and strings that need no
    type processing.
    """
    unknown = set(columns) - set(_FILE_INSERT_COLUMNS)
    if unknown:
        raise ValueError(f"file rows name columns {sorted(unknown)} that new file rows do not have; "
                         f"use some of {', '.join(_FILE_INSERT_COLUMNS)}")
    mark = "?" if conn.dialect.paramstyle == "qmark" else "%s"
    row = f"({', '.join([mark] * len(columns))})"
    head = f"INSERT INTO {fl.name} ({', '.join(columns)}) VALUES "
    per = max(1, min(FILE_ROWS_PER_INSERT, _parameter_limit(conn) // len(columns)))
    flat = chain.from_iterable
    full = head + ", ".join([row] * per)
    whole = len(rows) - len(rows) % per
    for start in range(0, whole, per):
        conn.exec_driver_sql(full, tuple(flat(rows[start : start + per])))
    if whole < len(rows):
        conn.exec_driver_sql(head + ", ".join([row] * (len(rows) - whole)), tuple(flat(rows[whole:])))
    return len(rows)


def _parameter_limit(conn: Connection) -> int:
    """How many parameters one statement may bind: SQLite's compiled-in limit
    as the connection reports it (999 before SQLite 3.32, 32,766 since),
    PostgreSQL's 65,535."""
    if conn.dialect.name != "sqlite":
        return 65_535
    driver = conn.connection.driver_connection
    getlimit = getattr(driver, "getlimit", None)
    if getlimit is None:
        return 999
    return int(getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))


def _merged_metrics(text: str | None, from_jsonl: Mapping[str, float]) -> str | None:
    """A cataloged checkpoint's metrics (``text``) with the names ``metrics.jsonl``
    adds; a name the row already has keeps its value (the checkpoint's own files
    win, and a directory not listed again cannot say which were its own)."""
    return metrics_to_json({**from_jsonl, **dict(metrics_from_json(text))})


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


def _check_copy_state(state: CopyState | str) -> CopyState:
    """``state`` as a :class:`CopyState`; a string that names none is a ``ValueError``."""
    if state not in _COPY_STATES:
        raise ValueError(f"copy state {state!r} is unknown; use one of {', '.join(COPY_STATES)}")
    return _COPY_STATES[state]
