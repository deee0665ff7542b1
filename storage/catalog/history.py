"""The catalog's history: retention decisions, events, restore drills and
recoveries (``resume`` calls).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    insert,
    select,
)

from .tables import checkpoints as ck
from .tables import decisions as dec
from .tables import drills as dr
from .tables import events as ev
from .tables import jobs as jb
from .tables import recoveries as rc
from .entries import UnknownCheckpoint, EventRecord, DrillRecord, RecoveryRecord
from .core import CatalogCore, _aware


class CatalogHistory(CatalogCore):
    """History of the catalog: :class:`~ckptier.storage.catalog.protocols.HistoryCatalog`."""

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
