"""The dashboard's own catalog queries: read only, aggregated in SQL.

Each function returns a SQLAlchemy Core statement; :func:`frame` runs one in
a read transaction and returns a pandas DataFrame. The overview needs only
GROUP BY aggregates over checkpoints and copies (never a row per file), so
it costs what the database costs. Drills are read through
:meth:`Catalog.drills`, not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import pandas as pd
from sqlalchemy import Engine, Select, String, and_, case, exists, func, literal, or_, select, true, type_coerce, union_all

from ckptier.storage.catalog import db
from ckptier.storage.catalog.tables import checkpoints as ck
from ckptier.storage.catalog.tables import copies as cp
from ckptier.storage.catalog.tables import events as ev
from ckptier.storage.catalog.tables import files as fl
from ckptier.storage.catalog.tables import jobs as jb
from ckptier.storage.records import CopyState

#: Copy states that still hold the bytes (a degraded copy is damaged, but stored).
HELD = (CopyState.PRESENT.value, CopyState.DEGRADED.value)
#: Newest saves per job read to learn the job's usual checkpoint interval.
RECENT_SAVES = 21
#: Event kinds that change which copies hold bytes (storage over time).
STORAGE_EVENT_KINDS = ("deleted", "vanished", "reappeared", "resurrected")
#: Event kinds that record a verification outcome (verification history).
VERIFICATION_EVENT_KINDS = (
    "verified", "corrupt", "committed", "changed", "uncommitted", "copy-degraded", "copy-present", "archive.degraded",
)


def frame(engine: Engine, stmt: Select[Any], columns: Sequence[str] | None = None) -> pd.DataFrame:
    """Run ``stmt`` in a read transaction; a DataFrame with the statement's column names."""
    with db.read_transaction(engine) as conn:
        result = conn.execute(stmt)
        names = list(columns) if columns is not None else list(result.keys())
        # Plain tuples: pandas probes each Row for attributes, which costs more than reading it.
        return pd.DataFrame.from_records([tuple(r) for r in result.all()], columns=names)


def tuples(engine: Engine, stmt: Select[Any]) -> list[tuple[Any, ...]]:
    """Run ``stmt`` in a read transaction; its rows as plain tuples."""
    with db.read_transaction(engine) as conn:
        return [tuple(r) for r in conn.execute(stmt).all()]


def frames(engine: Engine, stmts: Sequence[Select[Any]], columns: Sequence[str]) -> pd.DataFrame:
    """Run several statements with the same columns in one read transaction; their rows concatenated."""
    rows: list[Any] = []
    with db.read_transaction(engine) as conn:
        for stmt in stmts:
            rows.extend(tuple(r) for r in conn.execute(stmt).all())
    return pd.DataFrame.from_records(rows, columns=list(columns))


def _job_filter(stmt: Select[Any], job: str | None) -> Select[Any]:
    return stmt if job is None else stmt.where(jb.c.name == job)


def jobs(job: str | None = None) -> Select[Any]:
    """Every job (or ``job``): ``job``, ``hot_url``, ``created_at``."""
    return _job_filter(select(jb.c.name.label("job"), jb.c.hot_url, jb.c.created_at), job).order_by(jb.c.name)


def placement(job: str | None = None) -> Select[Any]:
    """Checkpoints grouped by job, state and where their bytes are held.

    One row per (job, state, hot, archive, degraded) where ``hot`` /
    ``archive`` are 1 when a hot / archive copy holds the bytes (present or
    degraded) and ``degraded`` is 1 when the archive copy is degraded.
    Columns: ``count``, ``bytes`` (logical), ``hot_bytes`` and
    ``archive_bytes`` (stored), ``missing`` (count with ``missing_since``),
    ``oldest_verified_at`` (min ``verified_at``), ``max_step``,
    ``newest_saved_at``. Tombstones are included (state ``deleted``).
    """
    def tier_held(tier: str) -> Any:
        return and_(cp.c.tier == tier, cp.c.state.in_(HELD))

    inner = (
        select(
            ck.c.job_id,
            ck.c.state,
            ck.c.bytes,
            ck.c.missing_since,
            ck.c.verified_at,
            ck.c.step,
            ck.c.saved_at,
            func.max(case((tier_held("hot"), 1), else_=0)).label("hot"),
            func.max(case((tier_held("archive"), 1), else_=0)).label("archive"),
            func.max(case((and_(cp.c.tier == "archive", cp.c.state == CopyState.DEGRADED.value), 1), else_=0)).label("degraded"),
            func.sum(case((tier_held("hot"), cp.c.stored_bytes), else_=0)).label("hot_bytes"),
            func.sum(case((tier_held("archive"), cp.c.stored_bytes), else_=0)).label("archive_bytes"),
        )
        .select_from(ck.outerjoin(cp, cp.c.checkpoint_id == ck.c.id))
        .group_by(ck.c.id)
    )
    if job is not None:  # filter inside, so that only the job's rows are grouped
        inner = inner.where(ck.c.job_id == select(jb.c.id).where(jb.c.name == job).scalar_subquery())
    per = inner.subquery()
    stmt = (
        select(
            jb.c.name.label("job"),
            per.c.state,
            per.c.hot,
            per.c.archive,
            per.c.degraded,
            func.count().label("count"),
            func.sum(per.c.bytes).label("bytes"),
            func.sum(per.c.hot_bytes).label("hot_bytes"),
            func.sum(per.c.archive_bytes).label("archive_bytes"),
            func.count(per.c.missing_since).label("missing"),
            func.min(per.c.verified_at).label("oldest_verified_at"),
            func.max(per.c.step).label("max_step"),
            func.max(per.c.saved_at).label("newest_saved_at"),
        )
        .select_from(per.join(jb, jb.c.id == per.c.job_id))
        .group_by(jb.c.name, per.c.state, per.c.hot, per.c.archive, per.c.degraded)
        .order_by(jb.c.name, per.c.state)
    )
    return stmt


def recent_saves(job: str, n: int = RECENT_SAVES) -> Select[Any]:
    """The ``n`` highest steps of ``job`` (tombstones too: they keep the cadence):
    ``job``, ``step``, ``saved_at`` (``first_seen`` when storage gave no time).

    One statement per job on purpose: it walks the (job, step) index
    backwards and stops after ``n`` rows (about 0.03 ms), where one window
    function over every job sorts the whole table (170 ms at 100,000
    checkpoints).
    """
    return (
        select(jb.c.name.label("job"), ck.c.step, func.coalesce(ck.c.saved_at, ck.c.first_seen).label("saved_at"))
        .select_from(ck.join(jb, jb.c.id == ck.c.job_id))
        .where(jb.c.name == job)
        .order_by(ck.c.step.desc())
        .limit(n)
    )


def _held(tier: str) -> Any:
    """EXISTS a copy in ``tier`` holding the bytes of the outer query's checkpoint."""
    other = cp.alias("held_copy")
    return exists(
        select(literal(1)).where(other.c.checkpoint_id == ck.c.id, other.c.tier == tier, other.c.state.in_(HELD))
    )


def problems(job: str | None = None) -> Select[Any]:
    """Corrupt checkpoints and degraded archive copies, one row each:
    ``job``, ``step``, ``problem`` (``corrupt`` / ``degraded``), ``hot``
    (1 when a hot copy still holds the bytes), ``detail``."""
    corrupt = _job_filter(
        select(jb.c.name.label("job"), ck.c.step, literal("corrupt").label("problem"),
               case((_held("hot"), 1), else_=0).label("hot"), ck.c.state_reason.label("detail"))
        .select_from(ck.join(jb, jb.c.id == ck.c.job_id))
        .where(ck.c.state == "corrupt"),
        job,
    )
    degraded = _job_filter(
        select(jb.c.name.label("job"), ck.c.step, literal("degraded").label("problem"),
               case((_held("hot"), 1), else_=0).label("hot"), cp.c.url.label("detail"))
        .select_from(cp.join(ck, ck.c.id == cp.c.checkpoint_id).join(jb, jb.c.id == ck.c.job_id))
        .where(cp.c.tier == "archive", cp.c.state == CopyState.DEGRADED.value, ck.c.state != "deleted"),
        job,
    )
    return corrupt.union_all(degraded).order_by("job", "step")  # type: ignore[return-value]


def restorable(checkpoint_ids: Sequence[int]) -> Select[Any]:
    """For the given checkpoints: ``id``, ``step``, ``state``, ``saved_at``
    and ``held`` (1 when some copy, hot or archive, holds the bytes)."""
    any_held = exists(select(literal(1)).where(cp.c.checkpoint_id == ck.c.id, cp.c.state.in_(HELD)))
    return select(
        ck.c.id, ck.c.step, ck.c.state, func.coalesce(ck.c.saved_at, ck.c.first_seen).label("saved_at"),
        case((any_held, 1), else_=0).label("held"),
    ).where(ck.c.id.in_(list(checkpoint_ids)))


def _as_stored(column: Any) -> Any:
    """A time column as the driver returns it (SQLite: ISO text; PostgreSQL: a naive UTC
    datetime), without the per-value conversion to an aware datetime: for a statement
    whose times are converted in one vectorized pass (``pd.to_datetime(utc=True)``)."""
    return type_coerce(column, String).label(column.name)


def checkpoint_columns(job: str, step: int | None = None) -> Select[Any]:
    """The columns of ``job``'s checkpoints (tombstones included; of ``step`` alone when given)
    that the checkpoints table and the step chart show, by step, a tuple per row and no record
    built: ``id``, ``step``, ``format``, ``state``, ``bytes``, ``state_reason``, and ``saved_at``,
    ``verified_at``, ``missing_since`` as stored (see :func:`_as_stored`). Their copies:
    :func:`checkpoint_copy_columns`."""
    stmt = (
        select(ck.c.id, ck.c.step, ck.c.format, ck.c.state, ck.c.bytes, ck.c.state_reason,
               _as_stored(ck.c.saved_at), _as_stored(ck.c.verified_at), _as_stored(ck.c.missing_since))
        .select_from(ck.join(jb, jb.c.id == ck.c.job_id))
        .where(jb.c.name == job)
        .order_by(ck.c.step, ck.c.id)
    )
    return stmt if step is None else stmt.where(ck.c.step == step)


def checkpoint_copy_columns(job: str, step: int | None = None) -> Select[Any]:
    """The copies of the checkpoints :func:`checkpoint_columns` reads: ``checkpoint_id``,
    ``tier``, ``state``, ``stored_bytes``, in the order a record holds them (by checkpoint,
    tier, URL: :meth:`Catalog.checkpoints`)."""
    stmt = (
        select(cp.c.checkpoint_id, cp.c.tier, cp.c.state, cp.c.stored_bytes)
        .select_from(cp.join(ck, ck.c.id == cp.c.checkpoint_id).join(jb, jb.c.id == ck.c.job_id))
        .where(jb.c.name == job)
        .order_by(cp.c.checkpoint_id, cp.c.tier, cp.c.url)
    )
    return stmt if step is None else stmt.where(ck.c.step == step)


def storage_copies(job: str | None) -> Select[Any]:
    """Every copy of ``job``'s checkpoints (None: every job's), tombstones included:
    ``checkpoint_id``, ``step``, ``tier``, ``state``, ``stored_bytes``,
    ``bytes`` (logical), ``created_at``, ``saved_at`` (times as stored, naive UTC:
    see :func:`_as_stored`)."""
    return (
        select(cp.c.checkpoint_id, ck.c.step, cp.c.tier, cp.c.state, cp.c.stored_bytes, ck.c.bytes,
               _as_stored(cp.c.created_at), _as_stored(ck.c.saved_at))
        .select_from(cp.join(ck, ck.c.id == cp.c.checkpoint_id).join(jb, jb.c.id == ck.c.job_id))
        .where(true() if job is None else jb.c.name == job)
        .order_by(cp.c.created_at, cp.c.id)
    )


def storage_events(job: str | None) -> Select[Any]:
    """The events of ``job`` (None: every job's) that change which copies hold bytes: ``at``,
    ``kind``, ``checkpoint_id``, ``data``, oldest first (``at`` as stored: see :func:`_as_stored`)."""
    return (
        select(_as_stored(ev.c.at), ev.c.kind, ev.c.checkpoint_id, ev.c.data)
        .select_from(ev.join(jb, jb.c.id == ev.c.job_id))
        .where(true() if job is None else jb.c.name == job, ev.c.checkpoint_id.is_not(None),
               or_(ev.c.kind.in_(STORAGE_EVENT_KINDS), ev.c.kind.like("copy-%")))
        .order_by(ev.c.at, ev.c.id)
    )


def events(job: str | None = None, *, checkpoint_id: int | None = None, kinds: Sequence[str] | None = None,
           limit: int = 300) -> Select[Any]:
    """Events newest first (time, then insertion order), at most ``limit``:
    ``at``, ``job``, ``step`` (None for job-wide events), ``kind``, ``message``."""
    stmt = (
        select(ev.c.at, jb.c.name.label("job"), ck.c.step, ev.c.kind, ev.c.message)
        .select_from(ev.outerjoin(jb, jb.c.id == ev.c.job_id).outerjoin(ck, ck.c.id == ev.c.checkpoint_id))
    )
    if job is not None:
        stmt = stmt.where(jb.c.name == job)
    if checkpoint_id is not None:
        stmt = stmt.where(ev.c.checkpoint_id == checkpoint_id)
    if kinds is not None:
        stmt = stmt.where(ev.c.kind.in_(list(kinds)))
    return stmt.order_by(ev.c.at.desc(), ev.c.id.desc()).limit(limit)


def file_hashes(checkpoint_id: int) -> Select[Any]:
    """The files of one checkpoint with their last computed sha256 and
    verification time (what :class:`FileRecord` does not carry)."""
    return (
        select(fl.c.relpath, fl.c.sha256, fl.c.verified_at)
        .where(fl.c.checkpoint_id == checkpoint_id)
        .order_by(fl.c.relpath)
    )


def _later(a: Any, b: Any) -> Any:
    """The later of two times (NULL ``a``: ``b``), in SQL every catalog backend runs."""
    return case((a > b, a), else_=b)


def storage_series(job: str | None) -> Select[Any]:
    """Storage over time of ``job`` (None: every job), as :func:`.history.storage_history` defines it,
    aggregated in the database: one row per moment the totals changed, oldest first, with the change
    at that moment: ``at`` (as stored: see :func:`_as_stored`), ``hot_bytes``, ``archive_stored_bytes``,
    ``archive_logical_bytes`` (deltas; their running sums are the series: :func:`.history.from_deltas`).

    The same definition, step by step: a *slot* is a checkpoint's copies in one tier
    (``start``: the earliest ``created_at``, for the hot tier the checkpoint's ``saved_at`` when
    earlier; ``stored``: the newest copy's ``stored_bytes``, else the logical size; ``held_now``: some
    copy present or degraded). Storage events (oldest first, then in insertion order) set their slot
    out or in; a *change* is an event whose target differs from the slot's state before it (held at
    first). When the state after the last event disagrees with ``held_now``, the difference is booked
    at the slot's last event, or (none) at the newest start or event of any slot. Every moment is at
    least the slot's start.
    """
    where_ck = true() if job is None else jb.c.name == job
    newest = cp.alias("newest_copy")
    newest_stored = (  # the newest copy's size, read only for a slot of several copies (a moved location)
        select(newest.c.stored_bytes)
        .where(newest.c.checkpoint_id == cp.c.checkpoint_id, newest.c.tier == cp.c.tier)
        .order_by(newest.c.created_at.desc(), newest.c.id.desc())
        .limit(1)
        .scalar_subquery()
    )
    hot_start = case((and_(cp.c.tier == "hot", ck.c.saved_at.is_not(None), ck.c.saved_at < cp.c.created_at),
                      ck.c.saved_at), else_=cp.c.created_at)
    slots = (
        select(
            cp.c.checkpoint_id, cp.c.tier,
            func.min(hot_start).label("start"),
            func.max(case((cp.c.state.in_(HELD), 1), else_=0)).label("held_now"),
            func.max(ck.c.bytes).label("logical"),
            case((func.count() == 1, func.max(func.coalesce(cp.c.stored_bytes, ck.c.bytes))),
                 else_=func.coalesce(newest_stored, func.max(ck.c.bytes))).label("stored"),
        )
        .select_from(cp.join(ck, ck.c.id == cp.c.checkpoint_id).join(jb, jb.c.id == ck.c.job_id))
        .where(where_ck)
        .group_by(cp.c.checkpoint_id, cp.c.tier)
        .cte("slots")
    )
    kind = ev.c.kind
    tier = case((kind.in_(("deleted", "vanished", "reappeared", "resurrected")), literal("hot")),
                else_=ev.c.data["tier"].as_string())
    target = case((kind.in_(("deleted", "vanished", "copy-deleted", "copy-missing")), 0),
                  (kind.in_(("reappeared", "resurrected", "copy-present", "copy-degraded")), 1))
    moved = (
        select(ev.c.id, ev.c.checkpoint_id, tier.label("tier"), ev.c.at, target.label("target"))
        .select_from(ev.join(jb, jb.c.id == ev.c.job_id))
        .where(true() if job is None else jb.c.name == job, ev.c.checkpoint_id.is_not(None), target.is_not(None))
        .subquery("moved")
    )
    se = moved.c
    slot_key, order = (se.checkpoint_id, se.tier), (se.at, se.id)
    moves = select(
        se.checkpoint_id, se.tier, se.at, se.target,
        func.lag(se.target, 1, 1).over(partition_by=slot_key, order_by=order).label("before"),
        func.lead(se.id).over(partition_by=slot_key, order_by=order).label("next_id"),
    ).subquery("moves")
    # Only events of a slot that exists move anything (and count as its last change).
    slot_moves = (
        select(moves, slots.c.start, slots.c.stored, slots.c.logical, slots.c.held_now)
        .select_from(moves.join(slots, and_(slots.c.checkpoint_id == moves.c.checkpoint_id, slots.c.tier == moves.c.tier)))
        .cte("slot_moves")
    )
    # Each slot's state after its last event and that event's time (no event: held, and NULL).
    last = select(slot_moves.c.checkpoint_id, slot_moves.c.tier, slot_moves.c.target, slot_moves.c.at) \
        .where(slot_moves.c.next_id.is_(None)).subquery("last_move")
    latest = select(func.max(_later(slot_moves.c.at, slots.c.start))).select_from(
        slots.outerjoin(slot_moves, and_(slot_moves.c.checkpoint_id == slots.c.checkpoint_id,
                                         slot_moves.c.tier == slots.c.tier))).scalar_subquery()
    ended = func.coalesce(last.c.target, 1)
    sign_now = case((slots.c.held_now == 1, 1), else_=-1)
    sign_move = case((slot_moves.c.target == 1, 1), else_=-1)
    deltas = union_all(
        select(slots.c.start.label("at"), slots.c.tier, slots.c.stored, slots.c.logical),
        select(_later(slot_moves.c.at, slot_moves.c.start), slot_moves.c.tier,
               sign_move * slot_moves.c.stored, sign_move * slot_moves.c.logical)
        .where(slot_moves.c.target != slot_moves.c.before),
        select(_later(func.coalesce(last.c.at, latest), slots.c.start), slots.c.tier,
               sign_now * slots.c.stored, sign_now * slots.c.logical)
        .select_from(slots.outerjoin(last, and_(last.c.checkpoint_id == slots.c.checkpoint_id, last.c.tier == slots.c.tier)))
        .where(ended != slots.c.held_now),
    ).subquery("deltas")
    hot = deltas.c.tier == "hot"
    stmt = (
        select(
            type_coerce(deltas.c.at, String).label("at"),
            func.sum(case((hot, deltas.c.stored), else_=0)).label("hot_bytes"),
            func.sum(case((hot, 0), else_=deltas.c.stored)).label("archive_stored_bytes"),
            func.sum(case((hot, 0), else_=deltas.c.logical)).label("archive_logical_bytes"),
        )
        .group_by(deltas.c.at)
        .order_by(deltas.c.at)
    )
    return cast("Select[Any]", stmt)  # four typed columns; the module's statements are all Select[Any]
