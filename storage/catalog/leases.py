"""Leases: claiming a checkpoint (or a batch of rows to verify), renewing and
releasing the lease, and who holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from sqlalchemy import (
    insert,
    or_,
    select,
    update,
)

from .tables import checkpoints as ck
from .tables import events as ev
from .entries import ProcessId, LeaseHolder
from .core import CatalogCore, _aware


class CatalogLeases(CatalogCore):
    """Leases of the catalog: :class:`~ckptier.storage.catalog.protocols.RowClaimCatalog`."""

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
