"""Carry out a retention plan: promote, prove, then fenced deletes.

The plan (``tasks/retention.py``) decides; this module only acts, and it
trusts nothing stale: like restic's prune, it proves the repository first
and deletes afterwards. The order of a run:

1. **Canary.** Every S3-like store that will be deleted from must pass its
   start-up canary (put, get, compare, delete) or nothing is deleted from it.
2. **Interrupted deletes.** A checkpoint with a pending delete intent (a run
   was killed between deleting files and recording it) is resolved first:
   every file still present → the intent is dropped and the files' delete
   tag turned to ``keep`` (nothing was deleted; the plan decides again,
   with fresh proofs, and tags again what it still deletes); some or all
   gone → the rest are tagged and deleted and the tombstone recorded.
3. **Promote.** Each ``promote`` item: claim the catalog lease, re-read the
   record, copy it to the archive (``tasks/archive.py``: encode, upload, read
   back, commit marker), record the verified archive copy, release.
4. **Prove.** Only for jobs whose promotions all succeeded. The checkpoints
   the job's deletions rely on — the newest verified, the ``keep_last``
   newest, the ``min_verified`` floor — are proven again now: a hot copy by
   reading its bytes or comparing the store's full-object checksums
   (:func:`ckptier.tasks.verify.verify_many`), an archive-only one by reading
   its archive copy back. A keeper that fails is recorded corrupt and the
   job is planned again (and the new keepers proven) before anything is
   deleted; a keeper that cannot be read defers the job's deletions.
5. **Delete.** Each ``delete`` item the fresh plan still deletes: claim the
   lease, re-read the record and re-check the preconditions against the
   *current* catalog (:func:`delete_refusal`). A hot-copy delete (a
   milestone) first proves its archive copy again (decoded and compared with
   the manifest and the catalog, or the store's full-object checksums
   compared with the manifest); a copy that fails is marked ``degraded`` and
   the hot copy kept. A checkpoint that a standing checkpoint's symlink points
   into is kept while that one stands (:func:`link_refusal`). Each file is
   looked at now (a ``stat``; :func:`ckptier.tasks.prove.prove_now`) and must
   be the file the catalog's verdict is about, else nothing of it is deleted
   and the change is recorded (verify again, rescan). Then the delete intent is recorded (fenced), each
   file tagged ``ckptier:retention = delete`` on a store that can tag
   (:class:`~ckptier.storage.base.Taggable`: S3), so that the bucket's
   lifecycle rule from ``ckptier lifecycle`` expires what this run decided
   to delete and nothing else should the run stop before deleting, then the files
   deleted in batches of at most 1,000 keys while the lease holds, each only
   while it is still the object that look proved
   (:meth:`~ckptier.storage.base.ProvenDeletes.delete_proven`: the same
   device, inode, size and mtime, never through a symlink; on S3 the same
   size, ETag and version), and only what the store confirmed counts (a name
   whose bytes another name still holds frees nothing): all files gone → the tombstone (fenced
   by the lease's generation, clearing the intent); some failed → an event,
   intent kept, the next run finishes; only delete markers → an event
   "space not freed".

Leases are short and a heartbeat renews them while the run lives
(``tasks/leases.py``); a lease whose holder's process is gone is taken over
at once. An item another live run holds is ``held``, naming the holder.

A crash anywhere leaves every kept checkpoint with at least one verified
copy (the hot copy is never touched before an archive copy is committed,
recorded and proven again), and a re-run finishes the work: promotion is
idempotent (an existing commit marker with the same, intact content counts
as done), deletes are idempotent (an absent key counts as deleted) and
resumable (the intent).

``dry_run`` runs the same decisions over :class:`DryRunStore`-wrapped stores
and a catalog that is only read: the report says what would happen (without
the proofs, which a real run makes before deleting).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol

from ckptier.storage.base import MAX_DELETE_BATCH, Canary, DeleteResult, ObjectInfo, ProvenDeletes, Store, Taggable
from ckptier.storage.base import file_key as hot_file_key
from ckptier.storage.base import is_single_file
from ckptier.storage.catalog.api import DeleteIntent, LeaseHolder, LinkedFile
from ckptier.storage.catalog.protocols import (
    CheckpointReads,
    CopyCatalog,
    DecisionLog,
    DeleteCatalog,
    LeaseCatalog,
    ProofCatalog,
)
from ckptier.storage.transitions import Change
from ckptier.storage.errors import CkptierError, DeleteInterrupted, NotFound, StoreError, Unavailable
from ckptier.storage.records import CheckpointRecord, CopyState, FileCheck, State, Tier
from ckptier.storage.wrappers import DryRunStore

from .archive import ArchiveCheck, HotCopyMismatch, check_archive_copy, promote
from .reports import ItemResult, Outcome, Proof
from .leases import DEFAULT_TTL, Lease, LeaseKeeper, this_process
from .lifecycle import DELETE_TAG, KEEP_TAG
from .prove import prove_now, settle
from .verify import verify_many
from .retention import (DEFAULT_MAX_MISSING_FRACTION, Plan, PlanItem, Policy, hot_present, keepers, plan_retention,
                        shrink_guard)

log = logging.getLogger(__name__)

#: Threads reading keepers' bytes during the proof.
PROOF_WORKERS = 4

#: Threads tagging a checkpoint's files before they are deleted (two requests per file on S3).
TAG_WORKERS = 8


@dataclass(frozen=True)
class Unproven:
    """Why a keeper was not proven: ``failed`` when its copy was read and is
    bad (the checkpoint is now corrupt), not ``failed`` when it could not be
    read at all (nothing was learnt; the job's deletions wait)."""

    why: str
    failed: bool


@dataclass
class ApplyReport:
    """Everything one :func:`apply_plan` run did or, in a dry run, would do."""

    dry_run: bool
    items: list[ItemResult] = field(default_factory=list)
    canary_failures: dict[str, str] = field(default_factory=dict)
    refused: str | None = None
    proofs: list[Proof] = field(default_factory=list)

    def _with(self, action: str, *outcomes: str) -> list[ItemResult]:
        return [i for i in self.items if i.action == action and i.outcome in outcomes]

    @property
    def promoted(self) -> list[ItemResult]:
        return self._with("promote", "done", "would")

    @property
    def deleted(self) -> list[ItemResult]:
        return self._with("delete", "done", "would")

    @property
    def held(self) -> list[ItemResult]:
        """Items skipped because another live run holds their checkpoint."""
        return [i for i in self.items if i.outcome == "held"]

    @property
    def failures(self) -> list[ItemResult]:
        return [i for i in self.items if i.outcome in ("failed", "partial", "fenced")]

    @property
    def ok(self) -> bool:
        """True when nothing failed (skipped, held and deferred items are not failures)."""
        return not self.failures and not self.canary_failures

    @property
    def bytes_freed(self) -> int:
        return sum(i.freed for i in self.items)

    def summary(self) -> str:
        """One line: counts by action and outcome, bytes freed, keepers proven."""
        verb = "would " if self.dry_run else ""
        parts = [
            f"{verb}promote {len(self.promoted)}",
            f"{verb}delete {len(self.deleted)} ({self.bytes_freed} bytes freed)",
        ]
        for outcome in ("skipped", "held", "deferred", "failed", "partial", "fenced"):
            n = sum(1 for i in self.items if i.outcome == outcome)
            if n:
                parts.append(f"{outcome} {n}")
        if self.proofs:
            bad = sum(1 for p in self.proofs if not p.ok)
            parts.append(
                f"proved {len(self.proofs) - bad} of {len(self.proofs)} keepers "
                f"({sum(p.bytes_read for p in self.proofs)} bytes read, "
                f"{sum(p.bytes_skipped for p in self.proofs)} by store checksum)"
            )
        if self.canary_failures:
            parts.append(f"canary failed on {len(self.canary_failures)} store(s)")
        return ", ".join(parts)


# ---------------------------------------------------------------- pure decisions


def delete_refusal(
    item: PlanItem,
    record: CheckpointRecord | None,
    job_records: Sequence[CheckpointRecord],
    *,
    max_missing_fraction: float = DEFAULT_MAX_MISSING_FRACTION,
) -> str | None:
    """Why ``item`` must not be deleted now, judged on the *current* catalog, or ``None``.

    ``record`` is the checkpoint re-read after claiming its lease;
    ``job_records`` every live record of its job. Pure. Refuses: a vanished
    or already deleted record; a state other than verified (or incomplete,
    when the plan deletes a stale save); a checkpoint missing from hot
    storage; a job whose listing shrank (more than ``max_missing_fraction``
    of its checkpoints missing, or all); the newest verified checkpoint of
    the job (unless only its hot copy goes and an archive copy is verified);
    a hot-copy delete without a verified archive copy.
    """
    if record is None:
        return "no longer in the catalog"
    if record.state == State.DELETED:
        return "already deleted"
    allowed = {State.VERIFIED} | ({State.INCOMPLETE} if item.state == State.INCOMPLETE.value else set())
    if record.state not in allowed:
        return f"state is now {record.state.value} (plan saw {item.state or 'unknown'}); not deleting"
    if record.missing_since is not None:
        return f"missing from hot storage since {record.missing_since.isoformat()}; nothing to delete"
    if any(c.tier == Tier.HOT and c.state in (CopyState.MISSING, CopyState.DELETED) for c in record.copies):
        return "the catalog records no present hot copy; nothing to delete"
    live = [c for c in job_records if c.state != State.DELETED]
    gone = sum(1 for c in live if c.missing_since is not None)
    if live and (gone == len(live) or gone / len(live) > max_missing_fraction):
        return (
            f"listing shrank: {gone} of {len(live)} checkpoints of job {record.job!r} missing from hot "
            f"storage (> {max_missing_fraction:.0%}); check the scanned URL, rescan, then apply"
        )
    verified = [c for c in live if c.state == State.VERIFIED]
    newest = max(verified, key=lambda c: (c.step, c.id)) if verified else None
    archived = record.has_verified_archive()
    if item.scope == "hot-copy" and not archived:
        return "hot-copy delete planned but no verified archive copy is recorded now"
    if newest is not None and newest.id == record.id and not archived:
        return "newest verified checkpoint of the job; never deleted"
    return None


def intent_progress(intent: DeleteIntent, listed: int, present: int) -> Literal["not-started", "started"]:
    """Whether an interrupted delete had started deleting files. Pure.

    ``listed`` is how many files the catalog lists for the checkpoint now,
    ``present`` how many of them the store still has. Not started only when
    every file it was to delete is still listed and present; a rescan that
    dropped vanished files from the catalog shows as fewer listed.
    """
    wanted = intent.files if intent.files is not None else listed
    return "not-started" if present == listed and listed >= wanted else "started"


def link_refusal(record: CheckpointRecord, store_url: str, prefix: str, links: Sequence[LinkedFile],
                 *, single: bool) -> str | None:
    """Why ``record`` (at ``prefix`` in the store ``store_url``) must stay because a
    standing checkpoint's file is a symlink into it (``links``: the catalog's
    :meth:`~ckptier.storage.catalog.api.Catalog.links` of that store), or
    None. Deleting it would leave that checkpoint's file pointing at
    nothing, so it stays while the other one stands (it goes once that one
    no longer links here). Links of the checkpoint itself do not count. Pure."""
    base = store_url.rstrip("/") + "/"
    into = [ln for ln in links
            if ln.checkpoint_id != record.id and ln.location.startswith(base)
            and (ln.link == prefix if single else ln.link.startswith(prefix.rstrip("/") + "/") if prefix else True)]
    if not into:
        return None
    first = into[0]
    more = f" (+{len(into) - 1} more)" if len(into) > 1 else ""
    return (f"kept: {first.job} step {first.step}'s {first.relpath} is a symlink to {first.link}{more}; a checkpoint "
            "another one links into is deleted only once that one no longer does")


def _batches(keys: Sequence[Any], size: int = MAX_DELETE_BATCH) -> list[Sequence[Any]]:
    return [keys[i : i + size] for i in range(0, len(keys), size)]


# -------------------------------------------------------------------- catalog side


class ApplyCatalog(LeaseCatalog, CheckpointReads, CopyCatalog, DecisionLog, ProofCatalog, DeleteCatalog, Protocol):
    """What :func:`apply_plan` reads and writes in the catalog: leases, the
    checkpoints and their symlinked files, copies, decisions and events,
    read-backs and settled file changes, fenced deletes
    (:class:`~ckptier.storage.catalog.api.Catalog` fits)."""


class _ReadOnlyCatalog:
    """The catalog as a dry run sees it: reads pass through, writes are dropped."""

    def __init__(self, catalog: ApplyCatalog) -> None:
        self._catalog = catalog
        self._gen = 0

    def get_by_id(self, checkpoint_id: int) -> CheckpointRecord | None:
        return self._catalog.get_by_id(checkpoint_id)

    def checkpoints(self, *, job: str | None = None, states: Iterable[State] | None = None,
                    include_deleted: bool = False, with_files: bool = True) -> list[CheckpointRecord]:
        return self._catalog.checkpoints(job=job, states=states, include_deleted=include_deleted,
                                         with_files=with_files)

    def delete_intents(self, *, job: str | None = None) -> list[DeleteIntent]:
        return self._catalog.delete_intents(job=job)

    def lease_holder(self, checkpoint_id: int, *, now: datetime) -> LeaseHolder | None:
        return self._catalog.lease_holder(checkpoint_id, now=now)

    def claim(self, checkpoint_id: int, owner: str, *, now: datetime, ttl: timedelta, **_: Any) -> int | None:
        self._gen += 1
        return self._gen

    def renew(self, checkpoint_id: int, owner: str, generation: int, *, now: datetime, ttl: timedelta) -> datetime:
        return now + ttl

    def release(self, checkpoint_id: int, owner: str, generation: int) -> bool:
        return True

    def record_verification(self, checkpoint_id: int, results: Sequence[FileCheck], *, now: datetime,
                            grace: timedelta = timedelta(0), extra: Sequence[str] = (),
                            claim: tuple[str, int] | None = None) -> State:
        raise AssertionError("a dry run proves nothing: apply returns before proving keepers")

    def links(self, scope: str) -> list[LinkedFile]:
        return self._catalog.links(scope)

    def record_file_changes(self, checkpoint_id: int, changes: Sequence[Change], *, now: datetime) -> State:
        record = self._catalog.get_by_id(checkpoint_id)
        return record.state if record is not None else State.DELETED

    def _drop(self, *a: Any, **kw: Any) -> bool:
        return True

    def _ignore(self, *a: Any, **kw: Any) -> None:
        return None

    add_copy = set_copy_state = record_decisions = log_event = _ignore
    mark_deleted = mark_hot_copy_deleted = record_delete_intent = clear_delete_intent = _drop


# --------------------------------------------------------------------------- apply


@dataclass(frozen=True)
class ApplyContext:
    """What an :func:`apply_plan` run works with, apart from the plan.

    ``catalog`` is a :class:`ckptier.storage.catalog.api.Catalog`
    (:class:`ApplyCatalog`). ``hot_for(record)`` gives the hot store and the
    checkpoint's key prefix in it; ``archive_for(job)`` the job's archive
    store (``None``: no archive tier); an archive copy outside that store
    cannot be proven, so its hot copy is kept. ``owner`` names the run in
    leases and events; ``now()`` is the clock (called at each step, aware
    UTC); ``lease_ttl`` how long a claim holds between heartbeats (a run
    whose lease was lost is fenced out). ``dry_run``: decide over
    :class:`DryRunStore`-wrapped stores and a catalog that is only read.
    ``policy_for(job)``, when given, re-plans each job on the current
    catalog after its keepers were proven (see :func:`apply_plan`).
    ``promote_many(records)``, when given, makes the archive copies of
    several checkpoints at once elsewhere (a thread pool, a Dask cluster:
    :mod:`ckptier.tasks.fanout`), yielding for each, in order, its
    :class:`~ckptier.tasks.archive.ArchiveCopy` or the exception that
    stopped it; the run still claims, checks and records every one.
    """

    catalog: ApplyCatalog
    hot_for: Callable[[CheckpointRecord], tuple[Store, str]]
    archive_for: Callable[[str], Store | None]
    owner: str
    now: Callable[[], datetime]
    lease_ttl: timedelta = DEFAULT_TTL
    dry_run: bool = False
    policy_for: Callable[[str], Policy | None] | None = None
    promote_many: Callable[[Sequence[CheckpointRecord]], Iterable[Any]] | None = None


def apply_plan(
    plan: Plan,
    context: ApplyContext,
    *,
    policy: str = "",
    max_missing_fraction: float = DEFAULT_MAX_MISSING_FRACTION,
    proven: set[int] | None = None,
) -> ApplyReport:
    """Carry out ``plan`` in ``context``: resume interrupted deletes, promote, prove, delete; return what happened.

    ``policy`` (the plan's policy, in words) is recorded with the decisions.
    With ``context.policy_for``, each job is planned again on the current
    catalog after its keepers were proven (and again whenever one failed):
    an item is deleted only if the fresh plan still deletes it with the same
    scope; its ``max_missing_fraction`` then drives the shrink re-check
    (``max_missing_fraction`` here otherwise). Without it, a keeper that
    fails defers the job's deletions. ``proven`` holds the ids of
    checkpoints already proven earlier in the same run (not proven again)
    and gains those proven now. Items are handled in (job, step) order; an
    item another live run holds is ``held``, not waited for.

    Errors of one item are recorded on it and the run goes on with the next
    (the store raising ``Unavailable`` after its retries stops deletions from
    that store for the rest of the run). Nothing raises for an item's
    failure: :attr:`ApplyReport.ok` and :attr:`ApplyReport.failures` say
    what failed (the command line exits 1 on them). Idempotent: re-running the same plan after a crash
    finishes the remaining work and repeats nothing that was recorded.
    """
    run = _Run(plan, context, proven=proven if proven is not None else set())
    try:
        run.carry_out(policy=policy, max_missing_fraction=max_missing_fraction)
    finally:
        run.leases.close()
    return run.report


def _result(item: PlanItem, outcome: Outcome, detail: str, *, freed: int = 0) -> ItemResult:
    return ItemResult(
        job=item.job,
        step=item.step,
        checkpoint_id=item.checkpoint_id,
        action=item.action,
        scope=item.scope,
        outcome=outcome,
        detail=detail,
        bytes=item.bytes,
        freed=freed,
    )


def _canary(store: Store) -> str | None:
    """Run the store's start-up canary if it has one (:class:`Canary`); return why it failed, or None."""
    if not isinstance(store, Canary):
        return None
    try:
        store.canary()
    except CkptierError as exc:
        return str(exc)
    return None


def live_keys(store: Store, prefix: str, record: CheckpointRecord, keys: Sequence[str]) -> tuple[list[str], str | None]:
    """Deletion trusts only a live listing: list the checkpoint's keys now and
    return those of ``keys`` (the catalog's) that are listed, or why nothing
    may be deleted: a file listed under the checkpoint that the catalog does
    not know (it changed since it was scanned, or the catalog's files came
    from an older S3 Inventory report), or nothing listed at all."""
    wanted = set(keys)
    single = is_single_file(prefix, record)
    listed = {i.key for i in store.list(prefix if single else prefix.rstrip("/") + "/") if not single or i.key == prefix}
    unknown = sorted(listed - wanted)
    if unknown:
        return [], (f"{len(unknown)} file(s) listed now under {store.url}/{prefix} are not in the catalog "
                    f"(first: {unknown[0]}): it changed since it was scanned; rescan it before deleting")
    if not listed & wanted:
        return [], f"none of its files is listed now under {store.url}/{prefix}; rescan it (nothing deleted)"
    return [k for k in keys if k in listed], None


def tag_keys(store: Store, keys: Sequence[str], tag: tuple[str, str]) -> dict[str, str]:
    """Put ``tag`` on every object of ``keys`` when ``store`` can tag
    (:class:`Taggable`); nothing on any other store. Returns the keys that
    could not be tagged, with why (a key already gone is not a failure).
    Idempotent; other tags of the objects stay."""
    if not isinstance(store, Taggable) or not keys:
        return {}
    def one(key: str) -> str | None:
        try:
            store.put_object_tagging(key, {tag[0]: tag[1]})
        except NotFound:
            return None
        except CkptierError as exc:
            return str(exc)
        return None

    with ThreadPoolExecutor(max_workers=min(TAG_WORKERS, len(keys))) as pool:
        return {k: why for k, why in zip(keys, pool.map(one, keys), strict=True) if why is not None}


def _delete(store: Store, proven: Sequence[ObjectInfo]) -> DeleteResult:
    """Delete each of ``proven`` only while it is still the object proven
    (:class:`~ckptier.storage.base.ProvenDeletes`). A store that cannot bind a
    delete to an identity deletes nothing: every key fails, saying so."""
    if isinstance(store, ProvenDeletes):
        return store.delete_proven(proven)
    why = f"{store.url} cannot bind a delete to what was proven (no delete_proven); nothing deleted from it"
    return DeleteResult(failed={i.key: why for i in proven})


class _Run:
    """One :func:`apply_plan` run: its stores, leases, report and the steps in order."""

    def __init__(self, plan: Plan, context: ApplyContext, *, proven: set[int]) -> None:
        self.plan = plan
        self.cat: ApplyCatalog = _ReadOnlyCatalog(context.catalog) if context.dry_run else context.catalog
        self.hot_for = context.hot_for
        self._archive_for = context.archive_for
        self.owner = context.owner
        self.now = context.now
        self.dry_run = context.dry_run
        self.policy_for = context.policy_for
        self.proven = proven
        self.report = ApplyReport(dry_run=context.dry_run, refused=plan.refused)
        self.leases = LeaseKeeper(self.cat, context.owner, now=context.now, ttl=context.lease_ttl,
                                  process=this_process())
        self._wrapped: dict[str, Store] = {}
        self._archives: dict[str, Store | None] = {}
        self.canaried: dict[str, str | None] = {}
        #: Stores that answered ``Unavailable`` (after their retries) to a delete: url -> why.
        self.unavailable: dict[str, str] = {}
        #: Makes several archive copies at once (see :class:`ApplyContext`); None: one by one here.
        self.promote_many = context.promote_many

    # -- helpers

    def wrap(self, store: Store) -> Store:
        if not self.dry_run:
            return store
        key = f"{store.url}#{id(store)}"
        if key not in self._wrapped:
            self._wrapped[key] = DryRunStore(store)
        return self._wrapped[key]

    def archive_of(self, job: str) -> Store | None:
        if job not in self._archives:
            store = self._archive_for(job)
            self._archives[job] = None if store is None else self.wrap(store)
        return self._archives[job]

    def event(self, kind: str, message: str, item: PlanItem | None = None, *, job: str | None = None,
              **data: Any) -> None:
        log.info("%s: %s", kind, message)
        self.cat.log_event(
            kind,
            message,
            now=self.now(),
            job=item.job if item else job,
            checkpoint_id=item.checkpoint_id if item else None,
            data=data or None,
        )

    def canary(self, store: Store) -> str | None:
        """The store's canary verdict, run once per store per run (None: passed)."""
        if store.url not in self.canaried:
            why = _canary(store)
            self.canaried[store.url] = why
            if why is not None:
                self.report.canary_failures[store.url] = why
                self.event("apply.canary_failed", f"{store.url}: {why}; nothing deleted from it")
        return self.canaried[store.url]

    def held(self, item: PlanItem) -> ItemResult:
        holder = self.leases.holder(item.checkpoint_id)
        who = holder.describe() if holder is not None else "another run (released since)"
        return _result(item, "held", f"held by another live run: {who}; re-run when it has finished")

    # -- the run

    def carry_out(self, *, policy: str, max_missing_fraction: float) -> None:
        plan, report, cat = self.plan, self.report, self.cat
        items = sorted(plan.items, key=lambda i: (i.job, i.step, i.checkpoint_id))
        promotes = [i for i in items if i.action == "promote"]
        deletes = [i for i in items if i.action == "delete"]
        if not self.dry_run and items:
            cat.record_decisions(
                [(i.checkpoint_id, i.action, list(i.reasons)) for i in items], policy=policy, now=self.now()
            )
        if plan.refused:
            self.event("apply.refused", f"deletion suspended by the plan: {plan.refused}")

        # 1. Canary every store we will delete from, before anything else.
        targets: dict[int, tuple[Store, str]] = {}
        for item in deletes:
            record = cat.get_by_id(item.checkpoint_id)
            if record is None:
                continue
            try:
                store, prefix = self.hot_for(record)
            except CkptierError as exc:
                report.items.append(_result(item, "failed", f"cannot open the hot store: {exc}"))
                continue
            targets[item.checkpoint_id] = (self.wrap(store), prefix)
            self.canary(targets[item.checkpoint_id][0])

        # 2. Deletes an earlier run started and never recorded.
        jobs = sorted({i.job for i in items})
        resumed: set[int] = set()  # settled here (or held): the plan's own item for it is not carried out
        if not self.dry_run:
            for job in jobs:
                for intent in cat.delete_intents(job=job):
                    res, settled = self.resume_delete(intent)
                    report.items.append(res)
                    if settled:
                        resumed.add(intent.checkpoint_id)

        # 3. Promotions.
        failed_jobs: dict[str, str] = {}
        fanned = self.promote_many is not None and not self.dry_run and len(promotes) > 1
        for item, res in zip(promotes, self.promote_fanned(promotes) if fanned else map(self.promote_one, promotes)):
            report.items.append(res)
            if res.outcome in ("failed", "fenced"):
                failed_jobs.setdefault(item.job, f"promotion of step {item.step} failed")

        # 4. Prove the keepers of every job that will delete, re-planning when one fails.
        fresh: dict[str, dict[int, PlanItem] | None] = {}
        for job in sorted({i.job for i in deletes} - set(failed_jobs)):
            job_deletes = [i for i in deletes if i.job == job and i.checkpoint_id in targets]
            if not any(self.canaried.get(targets[i.checkpoint_id][0].url) is None for i in job_deletes):
                continue
            job_policy = self.policy_for(job) if self.policy_for is not None else None
            threshold = job_policy.max_missing_fraction if job_policy is not None else max_missing_fraction
            why, replanned = self.prove_job(job, job_policy, [i for i in items if i.job == job], threshold)
            if why is not None:
                failed_jobs[job] = why
            fresh[job] = replanned

        # 5. Deletions, last, each fenced.
        unavailable = self.unavailable
        for item in deletes:
            if item.checkpoint_id in resumed:
                continue  # its interrupted delete was finished (or is held) above
            if item.checkpoint_id not in targets:
                if not any(r.checkpoint_id == item.checkpoint_id for r in report.items):
                    report.items.append(_result(item, "skipped", "no longer in the catalog"))
                continue
            store, prefix = targets[item.checkpoint_id]
            if item.job in failed_jobs:
                report.items.append(_result(item, "deferred", f"{failed_jobs[item.job]}; deletes of job wait"))
                continue
            if self.canaried.get(store.url):
                report.items.append(_result(item, "deferred", f"canary failed on {store.url}"))
                continue
            job_policy = self.policy_for(item.job) if self.policy_for is not None else None
            if job_policy is not None:
                if fresh.get(item.job) is None:
                    records = cat.checkpoints(job=item.job, with_files=False)
                    fresh[item.job] = {i.checkpoint_id: i for i in plan_retention(records, job_policy, now=self.now()).items}
                again = (fresh[item.job] or {}).get(item.checkpoint_id)
                if again is None or again.action != "delete" or again.scope != item.scope:
                    why = "; ".join(again.reasons) if again is not None else "no longer planned"
                    self.event("delete.refused", f"job {item.job} step {item.step}: a fresh plan keeps it ({why})", item)
                    report.items.append(_result(item, "skipped", f"a fresh plan no longer deletes it: {why}"))
                    continue
            if store.url in unavailable:
                report.items.append(_result(item, "deferred", f"{store.url} unavailable: {unavailable[store.url]}"))
                continue
            threshold = job_policy.max_missing_fraction if job_policy is not None else max_missing_fraction
            report.items.append(self.delete_one(item, store, prefix, threshold))
        self.event("apply.finished", report.summary(), None, ok=report.ok, dry_run=self.dry_run)

    # -- 2. interrupted deletes

    def resume_delete(self, intent: DeleteIntent) -> tuple[ItemResult, bool]:
        """Resolve one pending delete intent (see the module docstring, step 2).

        Returns the result and whether the intent was settled here (False
        when the delete had not started and the intent was dropped: the
        plan's own item then decides, with fresh proofs).
        """
        item = PlanItem(job=intent.job, step=intent.step, checkpoint_id=intent.checkpoint_id, action="delete",
                        reasons=("an interrupted delete",), bytes=0, scope=intent.scope)  # type: ignore[arg-type]
        lease = self.leases.claim(intent.checkpoint_id)
        if lease is None:
            return self.held(item), True
        try:
            return self._resume(intent, item, lease)
        finally:
            self.leases.release(lease)

    def _resume(self, intent: DeleteIntent, item: PlanItem, lease: Lease) -> tuple[ItemResult, bool]:
        record = self.cat.get_by_id(intent.checkpoint_id)
        if record is None:
            return _result(item, "skipped", "no longer in the catalog"), True
        item = PlanItem(job=item.job, step=item.step, checkpoint_id=item.checkpoint_id, action="delete",
                        reasons=item.reasons, bytes=record.bytes, scope=item.scope)
        try:
            store, prefix = self.hot_for(record)
            if (why := self.canary(store)) is not None:
                return _result(item, "deferred", f"interrupted delete waits: canary failed on {store.url}: {why}"), True
            keys = [hot_file_key(prefix, record, f.relpath) for f in record.files]
        except CkptierError as exc:
            return _result(item, "failed", f"cannot look at the interrupted delete's files: {exc}"), True
        looked = prove_now(store, prefix, record)
        if looked.verdict == "unknown":
            return _result(item, "failed", f"cannot look at the interrupted delete's files: {looked.error}"), True
        present = [f.key for f in looked.files if f.info is not None]
        # Files that are no longer the ones proven (replaced since) are not ours to delete: they stay.
        foreign = [f.key for f in looked.files if f.info is not None and f.change is not None]
        if intent_progress(intent, len(keys), len(present)) == "not-started":
            untagged = tag_keys(store, present, KEEP_TAG)
            if untagged:
                key, why = next(iter(untagged.items()))
                return _result(item, "failed", f"interrupted delete had not started, but {len(untagged)} file(s) still "
                                               f"carry the delete tag (e.g. {key}: {why}); the intent stays, re-run "
                                               f"apply"), True
            self.cat.clear_delete_intent(intent.checkpoint_id, owner=self.owner, generation=lease.generation,
                                         now=self.now(), why="every file still present: the delete had not started")
            return _result(item, "skipped", "interrupted delete had not started; intent dropped, the plan decides "
                                            "anew"), False
        reasons = [f"finished a delete interrupted at {intent.at.isoformat() if intent.at else 'an unknown time'}"]
        if foreign:
            reasons.append(f"left in place, replaced since they were proven: {', '.join(foreign[:5])}"
                           f"{' …' if len(foreign) > 5 else ''} (a rescan sees what they are)")
        res = self.delete_keys(item, record, store, looked.proven, lease, reasons,
                               freed_sizes={hot_file_key(prefix, record, f.relpath): f.size for f in record.files})
        return res, True

    # -- 3. promotions

    def promote_one(self, item: PlanItem) -> ItemResult:
        ready = self._promote_ready(item)
        if isinstance(ready, ItemResult):
            return ready
        lease, record, archive = ready
        try:
            if self.dry_run:
                return _result(item, "would", f"would promote {record.bytes} bytes to {archive.url}")
            try:
                hot, prefix = self.hot_for(record)
                copy = promote(self.wrap(hot), prefix, record, archive, now=self.now(), owner=self.owner)
            except HotCopyMismatch as exc:
                # The bytes just read are the proof a verification would give: record it, so that
                # the next plan passes the milestone on instead of failing here every run.
                self.cat.record_verification(
                    record.id, [FileCheck(exc.relpath, "corrupt", size=exc.size, crc64nvme=exc.crc64nvme,
                                          detail=f"read for promotion: {exc}")], now=self.now())
                why = f"{exc}; recorded corrupt (kept as evidence), the next apply plans without it"
                self.event("promote.failed", f"job {item.job} step {item.step}: {why}", item)
                return _result(item, "failed", why)
            except CkptierError as exc:
                return self._promote_done(item, exc)
            return self._promote_done(item, copy)
        finally:
            self.leases.release(lease)

    def promote_fanned(self, items: Sequence[PlanItem]) -> list[ItemResult]:
        """Promote ``items`` at once through ``promote_many`` (the copies made elsewhere, in
        parallel; this run claims, checks and records each, as :meth:`promote_one` does)."""
        assert self.promote_many is not None
        results: dict[int, ItemResult] = {}
        ready: list[tuple[PlanItem, Lease, CheckpointRecord]] = []
        for item in items:
            got = self._promote_ready(item)
            if isinstance(got, ItemResult):
                results[item.checkpoint_id] = got
            else:
                ready.append((item, got[0], got[1]))
        try:
            outcomes = self.promote_many([r for _, _, r in ready])
            for (item, lease, _), outcome in zip(ready, outcomes, strict=True):
                if not self.leases.valid(lease):
                    outcome = CkptierError(f"lease on step {item.step} was lost while it was being promoted; "
                                           "re-run to resume")
                results[item.checkpoint_id] = self._promote_done(item, outcome)
        finally:
            for _, lease, _ in ready:
                self.leases.release(lease)
        return [results[i.checkpoint_id] for i in items]

    def _promote_ready(self, item: PlanItem) -> ItemResult | tuple[Lease, CheckpointRecord, Store]:
        """Claim ``item`` and check it still needs promoting: the lease, the fresh record and the
        archive store, or the result that ends it (held, skipped, failed; nothing claimed then)."""
        archive = self.archive_of(item.job)
        if archive is None:
            return _result(item, "failed", f"job {item.job}: plan says promote but no archive store is configured")
        lease = self.leases.claim(item.checkpoint_id)
        if lease is None:
            return self.held(item)
        record = self.cat.get_by_id(item.checkpoint_id)
        why = None
        if record is None or record.state == State.DELETED:
            why = "no longer in the catalog"
        elif record.has_verified_archive():
            why = "already has a verified archive copy"
        elif record.state != State.VERIFIED:
            why = f"state is now {record.state.value}; only verified checkpoints are promoted"
        if why is not None or record is None:
            self.leases.release(lease)
            return _result(item, "skipped", why or "no longer in the catalog")
        return lease, record, archive

    def _promote_done(self, item: PlanItem, copy: Any) -> ItemResult:
        """Record a promotion's outcome: the archive copy made, or the error that stopped it."""
        cat = self.cat
        if isinstance(copy, BaseException):
            self.event("promote.failed", f"job {item.job} step {item.step}: {copy}", item)
            return _result(item, "failed", str(copy))
        cat.add_copy(
            item.checkpoint_id,
            tier=Tier.ARCHIVE,
            url=copy.url,
            state=CopyState.PRESENT,
            stored_bytes=copy.stored_bytes,
            codec=copy.codec,
            manifest_key=copy.manifest_key,
            verified_at=copy.verified_at,
            now=self.now(),
            storage_class=copy.storage_class,
        )
        what = "already archived" if copy.already_archived else "archived"
        self.event(
            "promote.done",
            f"job {item.job} step {item.step}: {what} at {copy.url} ({copy.raw_bytes} → {copy.stored_bytes} bytes)",
            item,
            url=copy.url,
            stored_bytes=copy.stored_bytes,
            raw_bytes=copy.raw_bytes,
        )
        return _result(item, "done", f"{what} at {copy.url}")

    # -- 4. proofs

    def prove_job(
        self, job: str, policy: Policy | None, items: Sequence[PlanItem], max_missing_fraction: float
    ) -> tuple[str | None, dict[int, PlanItem] | None]:
        """Prove the keepers of ``job`` again, re-planning while one fails.

        Returns why the job's deletions must wait (None: they may go on) and
        the fresh plan by checkpoint id (None without a policy). A job whose
        listing shrank needs no proof: each of its deletions is refused.
        """
        if self.dry_run:
            return None, None
        proven = self.proven
        for _ in range(len(items) + 1):  # each round turns at least one keeper corrupt
            records = self.cat.checkpoints(job=job)
            if shrink_guard(records, max_missing_fraction) is not None:
                return None, None
            fresh = plan_retention(records, policy, now=self.now()).items if policy is not None else list(items)
            todo = [k for k in keepers(records, policy, fresh) if k.id not in proven]
            if not todo:
                return None, ({i.checkpoint_id: i for i in fresh} if policy is not None else None)
            failed: list[str] = []
            hot = [k for k in todo if hot_present(k)]
            for record, outcome in verify_many(self.hot_for, hot, deep=False, workers=PROOF_WORKERS):
                state = self.cat.record_verification(record.id, outcome.results, now=self.now())
                problems = [f"{r.relpath}: {r.detail or r.status}" for r in outcome.results if r.status != "ok"]
                ok = state == State.VERIFIED and outcome.ok
                self.report.proofs.append(Proof(job, record.step, record.id, "hot", ok,
                                                "; ".join(problems[:3]) or "intact", outcome.bytes_read,
                                                outcome.bytes_skipped))
                if state == State.CORRUPT:
                    failed.append(f"step {record.step} ({'; '.join(problems[:2])})")
                elif not ok:
                    return (f"keeper step {record.step} could not be proven ({'; '.join(problems[:2])}); "
                            f"re-run apply when its store answers"), None
                else:
                    proven.add(record.id)
            for record in (k for k in todo if not hot_present(k)):
                unproven = self.prove_archive_keeper(record)
                if unproven is None:
                    proven.add(record.id)
                elif not unproven.failed:
                    return f"keeper step {record.step}: {unproven.why}", None
                else:
                    failed.append(f"step {record.step} ({unproven.why})")
            if not failed:
                return None, ({i.checkpoint_id: i for i in fresh} if policy is not None else None)
            self.event("apply.keeper_failed",
                       f"job {job}: keeper(s) failed their proof and are now corrupt: {', '.join(failed)}; "
                       + ("planning the job again" if policy is not None else "its deletes wait"),
                       None, job=job, keepers=failed)
            if policy is None:
                return f"keeper {failed[0]} failed its proof; re-run apply to plan again", None
        return "keepers kept failing their proofs; re-run apply", None

    def prove_archive_keeper(self, record: CheckpointRecord) -> Unproven | None:
        """Prove a keeper whose only copy is in the archive. None when intact;
        :class:`Unproven` otherwise: not ``failed`` when it could not be read
        (nothing learnt), ``failed`` when it was read and is bad (the copy is
        marked degraded and the checkpoint corrupt)."""
        copy = record.archive_copy()
        if copy is None or copy.state != CopyState.PRESENT:
            return Unproven("cannot prove it: no present copy in any tier", failed=False)
        result = self.check_archive(record)
        if isinstance(result, str):
            return Unproven(result, failed=False)
        self.report.proofs.append(Proof(record.job, record.step, record.id, "archive", result.ok,
                                        "; ".join(result.problems[:3]) or "intact", result.bytes_read,
                                        result.bytes_skipped))
        if result.ok:
            return None
        detail = "; ".join(result.problems[:2])
        self.cat.record_verification(
            record.id,
            [FileCheck(rel, "corrupt", detail=f"archive copy {copy.url}: {detail}") for rel in result.bad_files],
            now=self.now(),
        )
        return Unproven(detail, failed=True)

    def check_archive(self, record: CheckpointRecord) -> ArchiveCheck | str:
        """Read back ``record``'s archive copy (store checksums allowed): the
        :class:`~ckptier.tasks.archive.ArchiveCheck`, or, as a string, why it
        could not be read. A failed copy is marked degraded with an
        ``archive.degraded`` event."""
        copy = record.archive_copy()
        archive = self.archive_of(record.job)
        if copy is None or archive is None:
            return "cannot prove the archive copy: no archive store is configured for the job"
        try:
            result = check_archive_copy(record, archive, store_checksums=True)
        except StoreError as exc:
            return f"cannot read the archive copy back: {exc}"
        if not result.ok:
            only = not hot_present(record)
            self.cat.set_copy_state(record.id, tier=Tier.ARCHIVE, url=copy.url, state=CopyState.DEGRADED, now=self.now())
            self.cat.log_event(
                "archive.degraded",
                f"{record.job} step {record.step}: archive copy {copy.url} is damaged"
                + (" and it is the ONLY copy: restore it from elsewhere now" if only else "; the hot copy is kept")
                + f" ({'; '.join(result.problems[:3])})",
                now=self.now(), job=record.job, checkpoint_id=record.id,
                data={"only_copy": only, "problems": list(result.problems)},
            )
        return result

    # -- 5. deletions

    def delete_one(self, item: PlanItem, store: Store, prefix: str, max_missing_fraction: float) -> ItemResult:
        cat = self.cat
        lease = self.leases.claim(item.checkpoint_id)
        if lease is None:
            return self.held(item)
        try:
            record = cat.get_by_id(item.checkpoint_id)
            job_records = cat.checkpoints(job=item.job, with_files=False) if record is not None else []
            why = delete_refusal(item, record, job_records, max_missing_fraction=max_missing_fraction)
            if why is not None:
                if record is None or record.state != State.DELETED:  # an earlier run finished it: no news
                    self.event("delete.refused", f"job {item.job} step {item.step}: {why}", item)
                return _result(item, "skipped", why)
            assert record is not None
            sizes = {hot_file_key(prefix, record, f.relpath): f.size for f in record.files}
            keys, why = live_keys(store, prefix, record, list(sizes))
            if why is None:
                why = link_refusal(record, store.url, prefix, cat.links(store.url.rstrip("/") + "/"),
                                   single=is_single_file(prefix, record))
            if why is not None:
                self.event("delete.refused", f"job {item.job} step {item.step}: {why}", item)
                return _result(item, "skipped", why)
            # Each file must be the one the verdict is about, proven now (a stat, no read),
            # and the delete is bound to what this look saw.
            looked = prove_now(store, prefix, record)
            if looked.verdict in ("unknown", "vanished"):
                return _result(item, "deferred", f"cannot look at its files now: {looked.describe()}; re-run apply")
            if looked.verdict == "changed":
                settle(cat, looked, now=self.now())
                why = f"{looked.describe()}; nothing deleted: verify it again (a rescan sees the rest)"
                self.event("delete.refused", f"job {item.job} step {item.step}: {why}", item)
                return _result(item, "skipped", why)
            listed = set(keys)
            proven = [i for i in looked.proven if i.key in listed]
            if self.dry_run:
                result = DeleteResult()
                for batch in _batches(proven):
                    result.merge(_delete(store, batch))
                tagged = f", tagged {DELETE_TAG[0]}={DELETE_TAG[1]} first" if isinstance(store, Taggable) else ""
                return _result(item, "would", f"would delete {len(result.deleted)} files ({item.scope}){tagged}",
                               freed=record.bytes)
            if item.scope == "hot-copy":
                checked = self.check_archive(record)
                if isinstance(checked, str):
                    self.event("delete.refused", f"job {item.job} step {item.step}: {checked}; hot copy kept", item)
                    return _result(item, "failed", f"{checked}; hot copy kept")
                detail = "; ".join(checked.problems[:2])
                self.report.proofs.append(Proof(record.job, record.step, record.id, "archive", checked.ok,
                                                detail or "intact", checked.bytes_read, checked.bytes_skipped))
                if not checked.ok:
                    self.event("delete.refused", f"job {item.job} step {item.step}: archive copy failed its proof "
                                                 f"({detail}); hot copy kept", item)
                    return _result(item, "failed", f"archive copy failed its proof ({detail}); hot copy kept: "
                                                   f"inspect the archive copy (ckptier verify --deep)")
            if not cat.record_delete_intent(item.checkpoint_id, owner=self.owner, generation=lease.generation,
                                            scope=item.scope, files=len(keys), now=self.now()):
                self.event("delete.fenced", f"job {item.job} step {item.step}: lease lost before deleting", item)
                return _result(item, "fenced", "lease was taken over before deleting; nothing deleted")
            reasons = list(item.reasons)
            if item.scope == "hot-copy":
                reasons.append(f"archive copy proven at {self.now().isoformat()}")
            return self.delete_keys(item, record, store, proven, lease, reasons,
                                    freed_sizes={k: sizes[k] for k in keys})
        finally:
            self.leases.release(lease)

    def delete_keys(
        self,
        item: PlanItem,
        record: CheckpointRecord,
        store: Store,
        proven: Sequence[ObjectInfo],
        lease: Lease,
        reasons: list[str],
        *,
        freed_sizes: dict[str, int],
    ) -> ItemResult:
        """Tag the ``proven`` objects' keys with :data:`DELETE_TAG` (on a taggable
        store), delete each in batches while the lease holds and only while it
        is still the object proven (:func:`_delete`), then record the tombstone
        (of the checkpoint, or of its hot copy for a ``hot-copy`` scope); the
        delete intent must already be recorded. A key replaced since its proof
        is left alone and keeps the intent for the next run."""
        cat = self.cat
        keys = [i.key for i in proven]
        untagged = tag_keys(store, keys, DELETE_TAG)
        if untagged:  # the tag is the lifecycle rule's backstop; ckptier deletes the files itself now
            key, why = next(iter(untagged.items()))
            self.event("delete.untagged", f"job {item.job} step {item.step}: {len(untagged)} of {len(keys)} files "
                                          f"could not be tagged {DELETE_TAG[0]}={DELETE_TAG[1]} (e.g. {key}: {why}); "
                                          f"deleting them anyway", item, keys=sorted(untagged))
        result = DeleteResult()
        for batch in _batches(proven):
            if not self.leases.valid(lease):
                self.event("delete.lease_expired", f"job {item.job} step {item.step}: lease lost mid-delete", item)
                break
            try:
                result.merge(_delete(store, batch))
            except StoreError as exc:
                error = exc
                if isinstance(exc, DeleteInterrupted):
                    result.merge(exc.result)
                    error = exc.error
                self.event(
                    "delete.failed",
                    f"job {item.job} step {item.step}: {exc}; {len(result.deleted)} of {len(keys)} files "
                    f"confirmed deleted, the delete intent stays for the next run",
                    item,
                    deleted=list(result.deleted),
                )
                detail = f"unavailable: {exc}" if isinstance(error, Unavailable) else str(exc)
                if isinstance(error, Unavailable):
                    self.unavailable[store.url] = detail  # no more deletes from it in this run
                return _result(item, "failed", detail)
        confirmed = set(result.deleted)
        # A name whose bytes another name still holds (a hard link, a symlink) frees nothing.
        freed = sum(freed_sizes.get(k, 0) for k in confirmed - set(result.markers_only) - set(result.shared))
        if result.changed:
            key, why = next(iter(result.changed.items()))
            self.event("delete.changed", f"job {item.job} step {item.step}: {len(result.changed)} file(s) replaced "
                                         f"since they were proven were left alone (e.g. {key}: {why}); the delete "
                                         f"intent stays, the next run settles it", item, changed=dict(result.changed))
        if result.markers_only:
            self.event(
                "delete.space_not_freed",
                f"job {item.job} step {item.step}: space not freed: versioned bucket {store.url} kept old "
                f"versions of {len(result.markers_only)} files behind delete markers; add a lifecycle rule",
                item,
                keys=list(result.markers_only),
            )
        if confirmed != set(keys):
            missing = sorted(set(keys) - confirmed)
            self.event(
                "delete.partial",
                f"job {item.job} step {item.step}: {len(confirmed)} of {len(keys)} files deleted; "
                f"not deleted: {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}; the delete intent "
                f"stays, the next run finishes",
                item,
                failed=dict(result.failed),
            )
            return _result(item, "partial", f"{len(missing)} of {len(keys)} files not deleted", freed=freed)
        mark = cat.mark_hot_copy_deleted if item.scope == "hot-copy" else cat.mark_deleted
        if not mark(item.checkpoint_id, owner=self.owner, generation=lease.generation, now=self.now(), reasons=reasons):
            self.event("delete.fenced", f"job {item.job} step {item.step}: lease lost to another run; tombstone "
                                        f"refused (the delete intent stays for the next run)", item)
            return _result(item, "fenced", "lease was taken over; catalog unchanged", freed=freed)
        if item.scope == "hot-copy":
            self.event("delete.hot_copy", f"job {item.job} step {item.step}: hot copy deleted; " + "; ".join(reasons),
                       item)
            return _result(item, "done", "hot copy deleted; archive copy remains", freed=freed)
        return _result(item, "done", f"deleted {len(keys)} files", freed=freed)
