"""Fenced deletion: delete intents recorded before files go, tombstones (the
whole checkpoint or its hot copy only), and forgetting a checkpoint gone
from every tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import (
    insert,
    or_,
    select,
    update,
)

from ..records import (
    CopyState,
    State,
    Tier,
)
from .tables import checkpoints as ck
from .tables import copies as cp
from .tables import events as ev
from .tables import jobs as jb
from .entries import DeleteIntent
from .core import CatalogCore, DELETE_SCOPES, _aware


class CatalogDeletes(CatalogCore):
    """Fenced deletion and forgetting of the catalog: :class:`~ckptier.storage.catalog.protocols.TombstoneCatalog`."""

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
