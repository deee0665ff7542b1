"""Scanning: :meth:`~CatalogScans.record_scan` brings the catalog in line with one
listing of a store, and the directory stamps a local rescan skips unchanged
checkpoints by.
"""

from __future__ import annotations

from itertools import chain, repeat
from operator import attrgetter
from collections.abc import Callable, Collection, Container, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Connection,
    delete,
    insert,
    select,
    text,
    update,
)

from .. import transitions
from ..records import (
    CopyState,
    FileRef,
    Found,
    Recognition,
    State,
    Tier,
    metrics_from_json,
    metrics_to_json,
)
from ..gc_pause import paused_gc
from .tables import checkpoints as ck
from .tables import copies as cp
from .tables import dir_stamps as ds
from .tables import events as ev
from .tables import files as fl
from .tables import jobs as jb
from .tables import scans as sc
from .entries import ScanSummary, DirStampRecord
from .core import CatalogCore, _SCAN_LOCK_CLASS, _aware, _epoch, _parent, _join_url, _row, _bulk_update, _parameter_limit


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


def _seen(found: Found, changed: Sequence[str], gone: Sequence[str], still_gone: Sequence[str]) -> transitions.Seen:
    return transitions.Seen(
        committed=found.committed, reason=found.reason, saved_at=_epoch(found.saved_at),
        shortfalls=found.shortfalls, changed=tuple(changed), gone=tuple(gone), still_gone=tuple(still_gone),
    )


# Column order of the per-job file load in record_scan (tuples, for speed).
_F_ID, _F_CK, _F_REL, _F_SIZE, _F_MTIME, _F_ETAG, _F_EXP, _F_STATUS, _F_CRC, _F_LINK = range(10)


class CatalogScans(CatalogCore):
    """Scans and directory stamps of the catalog: :class:`~ckptier.storage.catalog.protocols.ScanCatalog`."""

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
            # One executemany, then the new ids by (job, step), which is unique: an INSERT ...
            # RETURNING whose ids must come back in parameter order runs one statement per
            # row on SQLite (10,000 statements for a first scan of 10,000 checkpoints). The ids
            # are read for the new steps' range only: a rescan that finds the newest few of a
            # job of 100,000 reads a few rows back, not the job's every row.
            conn.execute(insert(ck), new_ck)
            steps = [row["step"] for row in new_ck]
            id_of = dict(_plain_rows(conn, select(ck.c.step, ck.c.id).where(
                ck.c.job_id == job_id, ck.c.step.between(min(steps), max(steps)))))
            ids = [int(id_of[step]) for step in steps]
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
        # Rows unpacked by position (a rescan reads one per checkpoint: 10,000 and more).
        return {
            location: DirStampRecord(int(cid), location, stamp, tuple(dirs.split("\n")), taken_at, int(files))
            for cid, location, stamp, dirs, taken_at, files in rows
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


def _merged_metrics(text: str | None, from_jsonl: Mapping[str, float]) -> str | None:
    """A cataloged checkpoint's metrics (``text``) with the names ``metrics.jsonl``
    adds; a name the row already has keeps its value (the checkpoint's own files
    win, and a directory not listed again cannot say which were its own)."""
    return metrics_to_json({**from_jsonl, **dict(metrics_from_json(text))})
