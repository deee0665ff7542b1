"""Verification: recording per-file read-back results and what a look at the
files found, and ending a verification claim without a result.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Connection,
    bindparam,
    func,
    insert,
    or_,
    select,
    tuple_,
    update,
)

from .. import transitions
from ..records import (
    FileCheck,
    CopyState,
    FileRecord,
    State,
    Tier,
)
from .tables import checkpoints as ck
from .tables import copies as cp
from .tables import events as ev
from .tables import files as fl
from .core import CatalogCore, _aware, _row, _bulk_update

if TYPE_CHECKING:
    from .entries import LeaseLost, ReadBack


class CatalogVerification(CatalogCore):
    """Verification of the catalog: :class:`~ckptier.storage.catalog.protocols.VerifyCatalog`."""

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
                from .entries import UnknownCheckpoint  # lazy: `ckptier latest` settles without the record types

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
        from .entries import LeaseLost, ReadBack  # lazy: as in record_verifications

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
        from .entries import LeaseLost, UnknownCheckpoint  # lazy: `ckptier latest` imports this concern to settle

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
