"""Catalog rows in and out for backups and rebuilds: one job at a time, one transaction each.

* :func:`export_job` reads every row of one job that storage cannot tell
  (checkpoints and tombstones, files with their verification history, copies,
  drills, events, recovery events) as the JSON-ready body of a catalog backup
  (:mod:`ckptier.storage.catalog_backup`).
* :func:`import_job` writes such a body into a catalog that does not know the
  job yet, in one transaction: a job is restored whole or not at all, so a
  rebuild killed part-way restores the rest on its next run and never a job
  twice.
* :func:`record_rebuilt_copies` records what a rebuild found in the archive
  for one job (new checkpoints made from manifests, archive copies judged
  and proven), in one transaction, and only what differs from the catalog:
  recording the same findings again writes nothing.

The decisions are made by the callers (:mod:`ckptier.tasks.rebuild`); this
module only reads and writes rows. Delete intents, leases, retention
decisions and directory stamps are never exported (a restored intent could
finish a delete nobody re-decided; decisions are advisory history; stamps are
taken anew by the next scan).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, bindparam, func, insert, select, update

from ..records import CopyState, State, Tier
from .api import Catalog
from .core import _parameter_limit
from .tables import checkpoints as ck
from .tables import copies as cp
from .tables import drills as dr
from .tables import events as ev
from .tables import files as fl
from .tables import jobs as jb
from .tables import recoveries as rc
from .tables import scans as sc

#: Columns of each exported table, in order (``step`` names the checkpoint a row belongs to).
CHECKPOINT_COLUMNS = ("step", "format", "location", "state", "state_reason", "bytes", "file_count", "saved_at",
                      "first_seen", "last_seen", "missing_since", "verified_at", "checked_at", "recorded_loss",
                      "metrics")
FILE_COLUMNS = ("step", "relpath", "size", "mtime", "etag", "crc64nvme", "sha256", "sha256_expected", "status",
                "detail", "verified_at")
COPY_COLUMNS = ("step", "tier", "url", "state", "stored_bytes", "codec", "manifest_key", "created_at", "verified_at",
                "storage_class")
DRILL_COLUMNS = ("step", "started_at", "finished_at", "ok", "device", "source_tier", "verdict", "timings",
                 "peak_memory_bytes", "error")
EVENT_COLUMNS = ("step", "at", "kind", "message", "data")
#: A recovery event's ``step`` is the step it chose (None when it failed), which also names its checkpoint.
RECOVERY_COLUMNS = ("step", "started_at", "seconds", "outcome", "verify", "source", "path", "passed_over", "error")
TABLES = {"checkpoints": CHECKPOINT_COLUMNS, "files": FILE_COLUMNS, "copies": COPY_COLUMNS, "drills": DRILL_COLUMNS,
          "events": EVENT_COLUMNS, "recoveries": RECOVERY_COLUMNS}
#: Columns holding times (ISO 8601 text in a backup).
TIME_COLUMNS = frozenset({"saved_at", "first_seen", "last_seen", "missing_since", "verified_at", "checked_at",
                          "created_at", "started_at", "finished_at", "at"})
#: Most events of one job a backup keeps (the newest): the log grows without bound, the rest does not.
MAX_EVENTS = 20_000
#: Most recovery events of one job a backup keeps (the newest), for the same reason.
MAX_RECOVERIES = 20_000
#: The event a rebuild logs first in the catalog it fills (what lets a later run resume it).
REBUILD_STARTED = "rebuild.started"


def _out(name: str, value: Any) -> Any:
    if name in TIME_COLUMNS and value is not None:
        return value.astimezone(UTC).isoformat()
    return value


def _in(name: str, value: Any) -> Any:
    if name in TIME_COLUMNS and value is not None:
        return datetime.fromisoformat(value).astimezone(UTC)
    return value


def _table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> dict[str, Any]:
    return {"columns": list(columns), "rows": [[_out(c, v) for c, v in zip(columns, row)] for row in rows]}


#: The SQL table behind each exported one (for which of its columns may be left out).
_SQL = {"checkpoints": ck, "files": fl, "copies": cp, "drills": dr, "events": ev, "recoveries": rc}


def _rows(body: Mapping[str, Any], name: str) -> list[list[Any]]:
    """The rows of table ``name`` as lists in :data:`TABLES` order, times parsed. A column a
    backup lacks (written before the column existed) is None where the catalog allows it; a
    column this version does not know (a newer ckptier wrote it) or a missing required one is a
    ``ValueError``. A table a backup lacks (``recoveries``, in backups written before recovery
    events were kept) has no rows."""
    table = body.get(name) or {"columns": list(TABLES[name]), "rows": []}
    columns = tuple(table.get("columns", ()))
    unknown = sorted(set(columns) - set(TABLES[name]))
    if unknown:
        raise ValueError(f"backup table {name} has columns {unknown} this ckptier does not know: written by a newer one")
    sql = _SQL[name]
    required = [c for c in TABLES[name] if c != "step" and c not in columns and not sql.c[c].nullable]
    if required or "step" not in columns:
        raise ValueError(f"backup table {name} lacks the columns {required or ['step']}")
    where = [columns.index(c) if c in columns else None for c in TABLES[name]]
    times = [i for i, c in enumerate(TABLES[name]) if c in TIME_COLUMNS]
    out = []
    for raw in table["rows"]:
        if len(raw) != len(columns):
            raise ValueError(f"backup table {name} has a row of {len(raw)} values, expected {len(columns)}")
        row: list[Any] = [raw[i] if i is not None else None for i in where]
        for i in times:
            if row[i] is not None:
                row[i] = datetime.fromisoformat(str(row[i])).astimezone(UTC)
        out.append(row)
    return out


def _insert_rows(conn: Connection, table: Any, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> int:
    """INSERT ``rows`` (sequences of ``columns``' values) many rows per statement, each value through
    its column type's own bind processing (times to naive UTC, JSON to text...) but without
    SQLAlchemy's per-row machinery, which costs seconds per hundred thousand rows. Returns the rows."""
    if not rows:
        return 0
    dialect = conn.dialect
    procs = [(i, p) for i, c in enumerate(columns)
             if (p := table.c[c].type.dialect_impl(dialect).bind_processor(dialect)) is not None]
    mark = "?" if dialect.paramstyle == "qmark" else "%s"
    one = f"({', '.join([mark] * len(columns))})"
    head = f"INSERT INTO {table.name} ({', '.join(columns)}) VALUES "
    per = max(1, min(500, _parameter_limit(conn) // len(columns)))
    flat: list[Any] = []
    pending = 0

    def flush() -> None:
        nonlocal flat, pending
        if pending:
            conn.exec_driver_sql(head + ", ".join([one] * pending), tuple(flat))
        flat, pending = [], 0

    for row in rows:
        values = list(row)
        for i, proc in procs:
            if values[i] is not None:
                values[i] = proc(values[i])
        flat.extend(values)
        pending += 1
        if pending == per:
            flush()
    flush()
    return len(rows)


def export_job(catalog: Catalog, job: str) -> dict[str, Any] | None:
    """Every row of ``job`` a backup keeps, as a JSON-ready body; None when the catalog has no such job.

    ``scanned``: the scanned URLs the job's hot directory lies under (where a
    rebuild lists the hot tree again). Read in one read transaction."""
    with catalog._read() as conn:  # noqa: SLF001 - this module is the catalog's own
        head = conn.execute(select(jb.c.id, jb.c.hot_url, jb.c.created_at).where(jb.c.name == job)).first()
        if head is None:
            return None
        job_id = head.id
        checkpoints = conn.execute(
            select(*(ck.c[c] for c in CHECKPOINT_COLUMNS)).where(ck.c.job_id == job_id).order_by(ck.c.step)).all()
        files = conn.execute(
            select(ck.c.step, *(fl.c[c] for c in FILE_COLUMNS[1:])).join(ck, ck.c.id == fl.c.checkpoint_id)
            .where(ck.c.job_id == job_id).order_by(ck.c.step, fl.c.relpath)).all()
        copies = conn.execute(
            select(ck.c.step, *(cp.c[c] for c in COPY_COLUMNS[1:])).join(ck, ck.c.id == cp.c.checkpoint_id)
            .where(ck.c.job_id == job_id).order_by(ck.c.step, cp.c.tier, cp.c.url)).all()
        drills = conn.execute(
            select(ck.c.step, *(dr.c[c] for c in DRILL_COLUMNS[1:])).outerjoin(ck, ck.c.id == dr.c.checkpoint_id)
            .where(dr.c.job_id == job_id).order_by(dr.c.started_at, dr.c.id)).all()
        newest = (select(ev.c.id).where(ev.c.job_id == job_id).order_by(ev.c.at.desc(), ev.c.id.desc())
                  .limit(MAX_EVENTS).scalar_subquery())
        events = conn.execute(
            select(ck.c.step, *(ev.c[c] for c in EVENT_COLUMNS[1:])).outerjoin(ck, ck.c.id == ev.c.checkpoint_id)
            .where(ev.c.id.in_(newest)).order_by(ev.c.at, ev.c.id)).all()
        recoveries = conn.execute(
            select(*(rc.c[c] for c in RECOVERY_COLUMNS)).where(rc.c.job == job)
            .order_by(rc.c.started_at.desc(), rc.c.id.desc()).limit(MAX_RECOVERIES)).all()[::-1]
        scans = sorted(set(conn.execute(select(sc.c.url).distinct()).scalars()))
    hot = head.hot_url or ""
    return {
        "job": {"name": job, "hot_url": head.hot_url, "created_at": _out("created_at", head.created_at)},
        "scanned": [u for u in scans if hot == u or hot.startswith(u.rstrip("/") + "/")],
        "checkpoints": _table(CHECKPOINT_COLUMNS, checkpoints),
        "files": _table(FILE_COLUMNS, files),
        "copies": _table(COPY_COLUMNS, copies),
        "drills": _table(DRILL_COLUMNS, drills),
        "events": _table(EVENT_COLUMNS, events),
        "recoveries": _table(RECOVERY_COLUMNS, recoveries),
    }


@dataclass(frozen=True)
class Restored:
    """What :func:`import_job` wrote: rows per table (0 everywhere when the job was already there)."""

    job: str
    checkpoints: int = 0
    tombstones: int = 0
    files: int = 0
    copies: int = 0
    drills: int = 0
    events: int = 0
    recoveries: int = 0
    already: bool = False


def job_exists(catalog: Catalog, job: str) -> bool:
    with catalog._read() as conn:  # noqa: SLF001
        return conn.execute(select(jb.c.id).where(jb.c.name == job)).first() is not None


def import_job(catalog: Catalog, body: Mapping[str, Any]) -> Restored:
    """Write a backup body into the catalog, in one transaction, unless its job is already there
    (``already``: a run before this one restored it, or the catalog learnt of it otherwise).

    Raises ``ValueError`` for a body whose tables are not this version's (nothing written)."""
    meta = body["job"]
    name = str(meta["name"])
    tables = {t: _rows(body, t) for t in TABLES}
    with catalog._write() as conn:  # noqa: SLF001
        if conn.execute(select(jb.c.id).where(jb.c.name == name)).first() is not None:
            return Restored(name, already=True)
        job_id = int(conn.execute(insert(jb).values(name=name, hot_url=meta.get("hot_url"),
                                                    created_at=_in("created_at", meta["created_at"]))
                                  .returning(jb.c.id)).scalar_one())
        checkpoints = tables["checkpoints"]
        _insert_rows(conn, ck, ("job_id", "generation", *CHECKPOINT_COLUMNS), [[job_id, 0, *r] for r in checkpoints])
        ids = {int(step): int(cid) for cid, step in conn.execute(select(ck.c.id, ck.c.step).where(ck.c.job_id == job_id))}
        # Rows of a checkpoint: its id in place of the step; drills and events may belong to none.
        files = [[ids[r[0]], *r[1:]] for r in tables["files"] if r[0] in ids]
        copies = [[ids[r[0]], *r[1:]] for r in tables["copies"] if r[0] in ids]
        drills = [[job_id, ids.get(r[0]) if r[0] is not None else None, *r[1:]] for r in tables["drills"]]
        events = [[job_id, ids.get(r[0]) if r[0] is not None else None, *r[1:]] for r in tables["events"]]
        _insert_rows(conn, fl, ("checkpoint_id", *FILE_COLUMNS[1:]), files)
        _insert_rows(conn, cp, ("checkpoint_id", *COPY_COLUMNS[1:]), copies)
        _insert_rows(conn, dr, ("job_id", "checkpoint_id", *DRILL_COLUMNS[1:]), drills)
        _insert_rows(conn, ev, ("job_id", "checkpoint_id", *EVENT_COLUMNS[1:]), events)
        # A recovery names its job by name; its chosen step links it to that checkpoint again.
        recoveries = [[name, ids.get(r[0]) if r[0] is not None else None, *r] for r in tables["recoveries"]]
        _insert_rows(conn, rc, ("job", "checkpoint_id", *RECOVERY_COLUMNS), recoveries)
    return Restored(name, checkpoints=len(checkpoints),
                    tombstones=sum(r[CHECKPOINT_COLUMNS.index("state")] == State.DELETED.value for r in checkpoints),
                    files=len(files), copies=len(copies), drills=len(drills), events=len(events),
                    recoveries=len(recoveries))


def rebuild_started(catalog: Catalog) -> tuple[int, bool]:
    """How many checkpoints the catalog holds, and whether a rebuild started filling it."""
    with catalog._read() as conn:  # noqa: SLF001
        rows = int(conn.execute(select(func.count()).select_from(ck)).scalar_one())
        jobs = int(conn.execute(select(func.count()).select_from(jb)).scalar_one())
        started = conn.execute(select(ev.c.id).where(ev.c.kind == REBUILD_STARTED).limit(1)).first() is not None
    return max(rows, jobs), started


# ----------------------------------------------------------------------------- archive findings


@dataclass(frozen=True)
class NewFile:
    """A file of a checkpoint known only from its archive manifest."""

    relpath: str
    size: int
    crc64nvme: str
    sha256_expected: str | None
    status: str | None  # "ok" when the copy was proven now, else None


@dataclass(frozen=True)
class NewCheckpoint:
    """A checkpoint the catalog does not hold, made from its archive manifest: where it was
    written (``location``: the manifest's source) and its hot copy's state there
    (``deleted``: no hot copy is listed)."""

    format: str
    location: str
    state: State
    state_reason: str | None
    files: tuple[NewFile, ...]
    first_seen: datetime
    verified_at: datetime | None
    recorded_loss: float | None
    hot_url: str


@dataclass(frozen=True)
class RebuiltCopy:
    """One archive copy as a rebuild judged it, for step ``step`` of a job: its URL, state
    (present or degraded), what it stores, when it was proven (None: not proven), and the
    checkpoint to create when the catalog has none (``new``)."""

    step: int
    url: str
    state: CopyState
    stored_bytes: int | None
    codec: str | None
    manifest_key: str | None
    verified_at: datetime | None
    storage_class: str | None
    detail: str | None = None
    new: NewCheckpoint | None = None


@dataclass(frozen=True)
class CopyChange:
    """A copy :func:`record_rebuilt_copies` changed: the step, its new state and the one before
    (None: the copy or the checkpoint is new)."""

    step: int
    url: str
    state: CopyState
    was: CopyState | None


def record_rebuilt_copies(catalog: Catalog, job: str, found: Sequence[RebuiltCopy], *, now: datetime,
                          gone: Mapping[str, CopyState] = {}) -> list[CopyChange]:
    """Record ``found`` for ``job`` in one transaction; returns what changed (empty: the catalog
    already said so).

    A copy whose checkpoint the catalog lacks comes with ``new``: the
    checkpoint is inserted with its files, a hot copy at its location in the
    state ``new`` says, and the archive copy. Others are inserted or updated
    on (checkpoint, tier, url); the proof time is kept when the state is
    unchanged and nothing was proven now, the storage class the promotion
    recorded always. ``gone`` maps archive copy URLs the
    catalog records, which storage no longer shows as a copy, to their new
    state (``missing``: nothing there; ``degraded``: objects without a
    manifest). Every state change logs a ``copy-<state>`` event, every new
    checkpoint one ``rebuilt`` event per job."""
    changes: list[CopyChange] = []
    with catalog._write() as conn:  # noqa: SLF001
        job_id = conn.execute(select(jb.c.id).where(jb.c.name == job)).scalar()
        if job_id is None:
            hot = next((c.new.hot_url for c in found if c.new is not None), None)
            job_id = conn.execute(insert(jb).values(name=job, hot_url=hot, created_at=now).returning(jb.c.id)).scalar_one()
        steps = {int(s): int(i) for i, s in conn.execute(select(ck.c.id, ck.c.step).where(ck.c.job_id == job_id))}
        fresh = [c for c in found if c.step not in steps and c.new is not None]
        created = _insert_checkpoints(conn, job_id, fresh, now)
        steps.update(created)
        existing = {(int(cid), url): (int(i), CopyState(state), verified) for i, cid, url, state, verified in conn.execute(
            select(cp.c.id, cp.c.checkpoint_id, cp.c.url, cp.c.state, cp.c.verified_at)
            .join(ck, ck.c.id == cp.c.checkpoint_id)
            .where(ck.c.job_id == job_id, cp.c.tier == Tier.ARCHIVE.value))}
        inserts: list[list[Any]] = []
        updates: list[dict[str, Any]] = []
        events: list[dict[str, Any]] = []
        for c in found:
            cid = steps.get(c.step)
            if cid is None:
                continue  # nothing to hang the copy on (the caller reports it)
            old = existing.get((cid, c.url))
            if old is None:
                inserts.append([cid, Tier.ARCHIVE.value, c.url, c.state.value, c.stored_bytes, c.codec, c.manifest_key,
                                now, c.verified_at, c.storage_class])
                changes.append(CopyChange(c.step, c.url, c.state, None))
                if c.state != CopyState.PRESENT:
                    events.append(_copy_event(job_id, cid, c.step, c.url, None, c.state, c.detail, now))
                continue
            copy_id, was, verified = old
            if was == c.state and (c.verified_at is None or c.state != CopyState.PRESENT):
                continue
            # The class the promotion confirmed stays as recorded; the listing's is for new rows only.
            updates.append({"b_id": copy_id, "b_state": c.state.value, "b_stored_bytes": c.stored_bytes,
                            "b_codec": c.codec, "b_manifest_key": c.manifest_key,
                            "b_verified_at": c.verified_at if c.verified_at is not None else verified})
            if was != c.state:
                changes.append(CopyChange(c.step, c.url, c.state, was))
                events.append(_copy_event(job_id, cid, c.step, c.url, was, c.state, c.detail, now))
        gone_updates: list[dict[str, Any]] = []
        by_id = {i: s for s, i in steps.items()}
        for (cid, url), (copy_id, was, _) in existing.items():
            state = gone.get(url)
            if state is None or state == was:
                continue
            gone_updates.append({"b_id": copy_id, "b_state": state.value})
            changes.append(CopyChange(by_id[cid], url, state, was))
            events.append(_copy_event(job_id, cid, by_id[cid], url, was, state,
                                      "no copy at this URL in the archive now", now))
        _insert_rows(conn, cp, ("checkpoint_id", "tier", "url", "state", "stored_bytes", "codec", "manifest_key",
                                "created_at", "verified_at", "storage_class"), inserts)
        if updates:
            conn.execute(update(cp).where(cp.c.id == bindparam("b_id")).values(
                {k: bindparam("b_" + k) for k in ("state", "stored_bytes", "codec", "manifest_key", "verified_at")}),
                updates)
        if gone_updates:
            conn.execute(update(cp).where(cp.c.id == bindparam("b_id")).values(state=bindparam("b_state")),
                         gone_updates)
        if created:
            shown = ", ".join(str(s) for s in list(created)[:3]) + (
                f" (+{len(created) - 3} more)" if len(created) > 3 else "")
            events.append({"at": now, "kind": "rebuilt", "job_id": job_id, "checkpoint_id": None,
                           "message": f"{job}: {len(created)} checkpoint(s) rebuilt from their archive manifests, "
                                      f"steps {shown}", "data": {"steps": list(created)[:1000]}})
        if events:
            conn.execute(insert(ev), events)
    return changes


def _copy_event(job_id: int, cid: int, step: int, url: str, was: CopyState | None, state: CopyState,
                detail: str | None, now: datetime) -> dict[str, Any]:
    what = f"step {step}: archive copy {url}: {was.value if was else 'new'} -> {state.value}"
    kind = "archive.degraded" if state == CopyState.DEGRADED else "copy-" + state.value
    return {"at": now, "kind": kind, "job_id": job_id, "checkpoint_id": cid,
            "message": what + (f" ({detail})" if detail else ""),
            "data": {"tier": Tier.ARCHIVE.value, "url": url, "from": was.value if was else None, "to": state.value,
                     "by": "rebuild"}}


def _insert_checkpoints(conn: Connection, job_id: int, found: Sequence[RebuiltCopy],
                        now: datetime) -> dict[int, int]:
    """Insert the checkpoints ``found`` make from their manifests (``RebuiltCopy.new``), with their
    files and hot copies; their ids by step, in step order."""
    if not found:
        return {}
    new = [(c.step, c.new) for c in sorted(found, key=lambda c: c.step) if c.new is not None]
    _insert_rows(conn, ck, ("job_id", "step", "format", "location", "state", "state_reason", "bytes", "file_count",
                            "saved_at", "first_seen", "last_seen", "missing_since", "verified_at", "checked_at",
                            "recorded_loss", "generation"),
                 [[job_id, step, n.format, n.location, n.state.value, n.state_reason, sum(f.size for f in n.files),
                   len(n.files), None, n.first_seen, n.first_seen, None, n.verified_at, n.verified_at, n.recorded_loss, 0]
                  for step, n in new])
    wanted = {step for step, _ in new}
    ids = {int(step): int(cid) for cid, step in conn.execute(select(ck.c.id, ck.c.step).where(ck.c.job_id == job_id))
           if int(step) in wanted}
    _insert_rows(conn, fl, ("checkpoint_id", "relpath", "size", "crc64nvme", "sha256_expected", "status", "detail",
                            "verified_at"),
                 [[ids[step], f.relpath, f.size, f.crc64nvme, f.sha256_expected, f.status,
                   "from the archive manifest" if f.status else None, n.verified_at if f.status else None]
                  for step, n in new for f in n.files])
    # The hot copy is not listed: recorded deleted (as apply leaves a milestone whose hot copy it
    # deleted), so that scans of the hot tree do not take it for a vanished checkpoint.
    _insert_rows(conn, cp, ("checkpoint_id", "tier", "url", "state", "created_at"),
                 [[ids[step], Tier.HOT.value, n.location, CopyState.DELETED.value, now] for step, n in new])
    return {step: ids[step] for step, _ in new}
