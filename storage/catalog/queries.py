"""Reading the catalog: checkpoints (with their files, copies and most recent
drill), the one to resume from, jobs, hot locations, symlinked files and the
per-job summary.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import (
    ColumnElement,
    Connection,
    and_,
    func,
    select,
    true,
)

from .. import transitions
from ..records import (
    CheckpointRecord,
    CopyRecord,
    CopyState,
    DrillOutcome,
    FileRecord,
    HELD_COPY_STATES,
    NOT_JUDGED,
    State,
    Tier,
    metrics_from_json,
)
from .tables import checkpoints as ck
from .tables import copies as cp
from .tables import drills as dr
from .tables import files as fl
from .tables import jobs as jb
from .tables import scans as sc
from .core import CatalogCore, _FORMATS, _STATES, _TIERS, _COPY_STATES

if TYPE_CHECKING:
    from .entries import LinkedFile


class CatalogQueries(CatalogCore):
    """Reads of the catalog: :class:`~ckptier.storage.catalog.protocols.QueryCatalog`."""

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

    def get_many(self, ids: Iterable[int]) -> list[CheckpointRecord]:
        """The checkpoints with these ids (any state, with files), ordered by job and step."""
        wanted = list(ids)
        if not wanted:
            return []
        with self._read() as conn:
            return self._load(conn, [ck.c.id.in_(wanted)], with_files=True)

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
        last_drill = _last_drills(conn, dr.c.checkpoint_id.in_(ids))
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

    def last_drills(self, *, job: str) -> dict[int, DrillOutcome]:
        """Checkpoint id -> its most recent drill, for every drilled checkpoint of
        ``job`` (tombstones too): the outcome each record's ``last_drill`` holds, by
        the one rule (:func:`ckptier.storage.transitions.latest_drill`) over all of
        the job's drills, without loading the records."""
        with self._read() as conn:
            return _last_drills(conn, dr.c.job_id == select(jb.c.id).where(jb.c.name == job).scalar_subquery())

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
        from .entries import LinkedFile  # lazy: the record types' dataclasses only where one is built

        return [LinkedFile(int(i), job, int(step), loc, rel, link) for i, job, step, loc, rel, link in rows]

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


def _last_drills(conn: Connection, where: ColumnElement[bool]) -> dict[int, DrillOutcome]:
    """The most recent drill of each checkpoint among the drills ``where`` selects, by
    the one rule (:func:`~ckptier.storage.transitions.latest_drill`: a drill that was not
    judged is history only); read newest recorded first, so that of two equal drills
    the later recorded speaks."""
    drills = [_DrillRow(*row) for row in conn.execute(
        select(dr.c.checkpoint_id, dr.c.ok, dr.c.started_at, dr.c.finished_at, dr.c.error, dr.c.verdict,
               dr.c.outcome)
        .where(where)
        .order_by(dr.c.id.desc())
    ).tuples()]
    out: dict[int, DrillOutcome] = {}
    for cid, d in transitions.latest_drills(drills).items():
        summary = d.verdict.get("summary") if isinstance(d.verdict, dict) else None
        out[cid] = DrillOutcome(ok=bool(d.ok), at=d.finished_at or d.started_at,
                                detail=None if d.ok else (d.error or summary))
    return out
