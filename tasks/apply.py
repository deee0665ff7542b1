"""Carry out a retention plan: promote first, then fenced deletes.

The plan (``tasks/retention.py``) decides; this module only acts, and it
trusts nothing stale. The order of a run:

1. **Canary.** Every S3-like store that will be deleted from must pass its
   start-up canary (put, get, compare, delete) or nothing is deleted from it.
2. **Promote.** Each ``promote`` item: claim the catalog lease, re-read the
   record, copy it to the archive (``tasks/archive.py``: encode, upload, read
   back, commit marker), record the verified archive copy, release.
3. **Delete.** Only for jobs whose promotions all succeeded. Each ``delete``
   item: claim the lease, re-read the record and re-check the preconditions
   against the *current* catalog (not the plan): not already deleted, not
   corrupt, present in hot storage, the job's listing has not shrunk, not the
   newest verified checkpoint, and for a hot-copy delete (a milestone) a
   verified archive copy. Then delete the recorded files in batches of at
   most 1,000 keys and record only what the store confirmed: all files gone
   → ``mark_deleted`` with the lease's generation (a run whose lease was
   taken over changes nothing); some failed → an event, state unchanged, the
   next run resumes; only delete markers → an event "space not freed".

A crash anywhere leaves every kept checkpoint with at least one verified
copy (the hot copy is never touched before an archive copy is committed and
recorded), and a re-run finishes the work: promotion is idempotent (an
existing commit marker with the same content counts as done) and deletes
are idempotent (an absent key counts as deleted).

``dry_run`` runs the same decisions over :class:`DryRunStore`-wrapped stores
and a catalog that is only read: the report says what would happen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from ckptier.storage.base import MAX_DELETE_BATCH, DeleteResult, Store
from ckptier.storage.errors import CkptierError, StoreError, Unavailable
from ckptier.storage.model import CheckpointRecord, State, Tier
from ckptier.storage.wrappers import DryRunStore

from .archive import hot_file_key, promote
from .retention import Plan, PlanItem, Policy, plan_retention

log = logging.getLogger(__name__)

Outcome = Literal["done", "would", "skipped", "failed", "partial", "fenced", "deferred"]

#: Default shrink-guard threshold used by the re-check when the plan gives none.
DEFAULT_MAX_MISSING_FRACTION = 0.5


class ApplyFailed(CkptierError):
    """A run finished with failed items; the report says which."""


@dataclass(frozen=True)
class ItemResult:
    """What happened to one plan item.

    ``outcome``: ``done`` (carried out), ``would`` (dry run: would be carried
    out), ``skipped`` (nothing to do or not ours: already done, held by
    another run, precondition no longer true), ``deferred`` (waits for a
    later run: a promotion of the job failed, the canary failed), ``failed``
    (an error), ``partial`` (some files deleted, the rest failed), ``fenced``
    (files deleted but the lease was lost: the catalog row was not changed).
    ``bytes`` is the checkpoint's size; ``freed`` the hot bytes actually
    deleted (0 on a versioned bucket that only got delete markers).
    """

    job: str
    step: int
    checkpoint_id: int
    action: str
    scope: str
    outcome: Outcome
    detail: str
    bytes: int = 0
    freed: int = 0


@dataclass
class ApplyReport:
    """Everything one :func:`apply_plan` run did or, in a dry run, would do."""

    dry_run: bool
    items: list[ItemResult] = field(default_factory=list)
    canary_failures: dict[str, str] = field(default_factory=dict)
    refused: str | None = None

    def _with(self, action: str, *outcomes: str) -> list[ItemResult]:
        return [i for i in self.items if i.action == action and i.outcome in outcomes]

    @property
    def promoted(self) -> list[ItemResult]:
        return self._with("promote", "done", "would")

    @property
    def deleted(self) -> list[ItemResult]:
        return self._with("delete", "done", "would")

    @property
    def failures(self) -> list[ItemResult]:
        return [i for i in self.items if i.outcome in ("failed", "partial", "fenced")]

    @property
    def ok(self) -> bool:
        """True when nothing failed (skipped and deferred items are not failures)."""
        return not self.failures and not self.canary_failures

    @property
    def bytes_freed(self) -> int:
        return sum(i.freed for i in self.items)

    def summary(self) -> str:
        """One line: counts by action and outcome, bytes freed."""
        verb = "would " if self.dry_run else ""
        parts = [
            f"{verb}promote {len(self.promoted)}",
            f"{verb}delete {len(self.deleted)} ({self.bytes_freed} bytes freed)",
        ]
        for outcome in ("skipped", "deferred", "failed", "partial", "fenced"):
            n = sum(1 for i in self.items if i.outcome == outcome)
            if n:
                parts.append(f"{outcome} {n}")
        if self.canary_failures:
            parts.append(f"canary failed on {len(self.canary_failures)} store(s)")
        return ", ".join(parts)

    def raise_for_failures(self) -> None:
        """Raise :class:`ApplyFailed` naming the first failure when anything failed."""
        if self.ok:
            return
        first = self.failures[0].detail if self.failures else next(iter(self.canary_failures.values()))
        raise ApplyFailed(f"apply: {self.summary()}; first failure: {first}; re-run apply to resume")


# ---------------------------------------------------------------- pure re-checks


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
    if any(c.tier == Tier.HOT and c.state in ("missing", "deleted") for c in record.copies):
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


def _batches(keys: Sequence[str], size: int = MAX_DELETE_BATCH) -> list[Sequence[str]]:
    return [keys[i : i + size] for i in range(0, len(keys), size)]


# -------------------------------------------------------------------- catalog side


class _ReadOnlyCatalog:
    """The catalog as a dry run sees it: reads pass through, writes are dropped."""

    def __init__(self, catalog: Any) -> None:
        self._catalog = catalog
        self._gen = 0

    def get_by_id(self, checkpoint_id: int) -> CheckpointRecord | None:
        return self._catalog.get_by_id(checkpoint_id)  # type: ignore[no-any-return]

    def checkpoints(self, **kw: Any) -> list[CheckpointRecord]:
        return self._catalog.checkpoints(**kw)  # type: ignore[no-any-return]

    def claim(self, checkpoint_id: int, owner: str, *, now: datetime, ttl: timedelta) -> int | None:
        self._gen += 1
        return self._gen

    def release(self, checkpoint_id: int, owner: str, generation: int) -> bool:
        return True

    def add_copy(self, *a: Any, **kw: Any) -> None:
        return None

    def set_copy_state(self, *a: Any, **kw: Any) -> None:
        return None

    def mark_deleted(self, *a: Any, **kw: Any) -> bool:
        return True

    def record_decisions(self, *a: Any, **kw: Any) -> None:
        return None

    def log_event(self, *a: Any, **kw: Any) -> None:
        return None


# --------------------------------------------------------------------------- apply


def apply_plan(
    plan: Plan,
    *,
    catalog: Any,
    hot_for: Callable[[CheckpointRecord], tuple[Store, str]],
    archive_for: Callable[[str], Store | None],
    owner: str,
    now: Callable[[], datetime],
    lease_ttl: timedelta,
    dry_run: bool = False,
    policy: str = "",
    max_missing_fraction: float = DEFAULT_MAX_MISSING_FRACTION,
    policy_for: Callable[[str], Policy | None] | None = None,
) -> ApplyReport:
    """Carry out ``plan``: promotions, then fenced deletions; return what happened.

    ``catalog`` is a :class:`ckptier.storage.catalog.api.Catalog`.
    ``hot_for(record)`` gives the hot store and the checkpoint's key prefix
    in it; ``archive_for(job)`` the job's archive store (``None``: no archive
    tier). ``owner`` names this run in leases and events; ``now()`` is the
    clock (called at each step, aware UTC); ``lease_ttl`` how long a claim
    holds — a run that outlives it is fenced out. ``policy`` is recorded with
    the decisions. ``policy_for(job)``, when given, re-plans each job on the
    current catalog right before its deletions (after the promotions): an
    item is deleted only if the fresh plan still deletes it with the same
    scope; its ``max_missing_fraction`` then drives the shrink re-check.
    Items are handled in (job, step) order; an item another
    run holds is skipped, not waited for.

    Errors of one item are recorded on it and the run goes on with the next
    (the store raising ``Unavailable`` after its retries stops deletions from
    that store for the rest of the run). Nothing raises for an item's
    failure: call :meth:`ApplyReport.raise_for_failures` to turn failures
    into an exception. Idempotent: re-running the same plan after a crash
    finishes the remaining work and repeats nothing that was recorded.
    """
    report = ApplyReport(dry_run=dry_run, refused=plan.refused)
    cat: Any = _ReadOnlyCatalog(catalog) if dry_run else catalog
    hot_cache: dict[str, Store] = {}
    archive_cache: dict[str, Store | None] = {}

    def wrap(store: Store) -> Store:
        if not dry_run:
            return store
        key = f"{store.url}#{id(store)}"
        if key not in hot_cache:
            hot_cache[key] = DryRunStore(store)
        return hot_cache[key]

    def archive_of(job: str) -> Store | None:
        if job not in archive_cache:
            store = archive_for(job)
            archive_cache[job] = None if store is None else wrap(store)
        return archive_cache[job]

    def event(kind: str, message: str, item: PlanItem | None = None, **data: Any) -> None:
        log.info("%s: %s", kind, message)
        cat.log_event(
            kind,
            message,
            now=now(),
            job=item.job if item else None,
            checkpoint_id=item.checkpoint_id if item else None,
            data=data or None,
        )

    items = sorted(plan.items, key=lambda i: (i.job, i.step, i.checkpoint_id))
    promotes = [i for i in items if i.action == "promote"]
    deletes = [i for i in items if i.action == "delete"]
    if not dry_run and items:
        cat.record_decisions(
            [(i.checkpoint_id, i.action, list(i.reasons)) for i in items], policy=policy, now=now()
        )
    if plan.refused:
        event("apply.refused", f"deletion suspended by the plan: {plan.refused}")

    # 1. Canary every store we will delete from, before anything else.
    delete_targets: dict[int, tuple[Store, str, CheckpointRecord]] = {}
    canaried: dict[str, str | None] = {}
    for item in deletes:
        record = cat.get_by_id(item.checkpoint_id)
        if record is None:
            continue
        try:
            store, prefix = hot_for(record)
        except CkptierError as exc:
            report.items.append(_result(item, "failed", f"cannot open the hot store: {exc}"))
            continue
        store = wrap(store)
        delete_targets[item.checkpoint_id] = (store, prefix, record)
        if store.url not in canaried:
            canaried[store.url] = _canary(store)
            if canaried[store.url] is not None:
                report.canary_failures[store.url] = canaried[store.url]  # type: ignore[assignment]
                event("apply.canary_failed", f"{store.url}: {canaried[store.url]}; nothing deleted from it")

    # 2. Promotions.
    failed_jobs: dict[str, str] = {}
    for item in promotes:
        res = _promote_one(item, cat, hot_for, archive_of, wrap, owner, now, lease_ttl, dry_run, event)
        report.items.append(res)
        if res.outcome in ("failed", "fenced"):
            failed_jobs.setdefault(item.job, f"promotion of step {item.step} failed")

    # 3. Deletions, last, each fenced.
    unavailable: dict[str, str] = {}
    fresh: dict[str, dict[int, PlanItem] | None] = {}
    for item in deletes:
        if item.checkpoint_id not in delete_targets:
            if not any(r.checkpoint_id == item.checkpoint_id for r in report.items):
                report.items.append(_result(item, "skipped", "no longer in the catalog"))
            continue
        store, prefix, _ = delete_targets[item.checkpoint_id]
        if item.job in failed_jobs:
            report.items.append(_result(item, "deferred", f"{failed_jobs[item.job]}; deletes of job wait"))
            continue
        if canaried.get(store.url):
            report.items.append(_result(item, "deferred", f"canary failed on {store.url}"))
            continue
        job_policy = policy_for(item.job) if policy_for is not None else None
        if job_policy is not None:
            if item.job not in fresh:
                records = cat.checkpoints(job=item.job, with_files=False)
                replan = plan_retention(records, job_policy, now=now())
                fresh[item.job] = {i.checkpoint_id: i for i in replan.items}
            again = (fresh[item.job] or {}).get(item.checkpoint_id)
            if again is None or again.action != "delete" or again.scope != item.scope:
                why = "; ".join(again.reasons) if again is not None else "no longer planned"
                event("delete.refused", f"job {item.job} step {item.step}: a fresh plan keeps it ({why})", item)
                report.items.append(_result(item, "skipped", f"a fresh plan no longer deletes it: {why}"))
                continue
        if store.url in unavailable:
            report.items.append(_result(item, "deferred", f"{store.url} unavailable: {unavailable[store.url]}"))
            continue
        threshold = job_policy.max_missing_fraction if job_policy is not None else max_missing_fraction
        res = _delete_one(item, cat, store, prefix, owner, now, lease_ttl, dry_run, event, threshold)
        report.items.append(res)
        if res.outcome == "failed" and res.detail.startswith("unavailable:"):
            unavailable[store.url] = res.detail
    event("apply.finished", report.summary(), None, ok=report.ok, dry_run=dry_run)
    return report


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
    """Run the store's start-up canary if it has one; return why it failed, or None."""
    probe = getattr(store, "canary", None)
    if probe is None:
        return None
    try:
        probe()
    except CkptierError as exc:
        return str(exc)
    return None


def _promote_one(
    item: PlanItem,
    cat: Any,
    hot_for: Callable[[CheckpointRecord], tuple[Store, str]],
    archive_of: Callable[[str], Store | None],
    wrap: Callable[[Store], Store],
    owner: str,
    now: Callable[[], datetime],
    lease_ttl: timedelta,
    dry_run: bool,
    event: Callable[..., None],
) -> ItemResult:
    archive = archive_of(item.job)
    if archive is None:
        return _result(item, "failed", f"job {item.job}: plan says promote but no archive store is configured")
    gen = cat.claim(item.checkpoint_id, owner, now=now(), ttl=lease_ttl)
    if gen is None:
        return _result(item, "skipped", "held by another run")
    try:
        record = cat.get_by_id(item.checkpoint_id)
        if record is None or record.state == State.DELETED:
            return _result(item, "skipped", "no longer in the catalog")
        if record.has_verified_archive():
            return _result(item, "skipped", "already has a verified archive copy")
        if record.state != State.VERIFIED:
            return _result(item, "skipped", f"state is now {record.state.value}; only verified checkpoints are promoted")
        if dry_run:
            return _result(item, "would", f"would promote {record.bytes} bytes to {archive.url}")
        try:
            hot, prefix = hot_for(record)
            copy = promote(wrap(hot), prefix, record, archive, now=now(), owner=owner)
        except CkptierError as exc:
            event("promote.failed", f"job {item.job} step {item.step}: {exc}", item)
            return _result(item, "failed", str(exc))
        cat.add_copy(
            item.checkpoint_id,
            tier=Tier.ARCHIVE,
            url=copy.url,
            state="present",
            stored_bytes=copy.stored_bytes,
            codec=copy.codec,
            manifest_key=copy.manifest_key,
            verified_at=copy.verified_at,
            now=now(),
            storage_class=copy.storage_class,
        )
        what = "already archived" if copy.already_archived else "archived"
        event(
            "promote.done",
            f"job {item.job} step {item.step}: {what} at {copy.url} ({copy.raw_bytes} → {copy.stored_bytes} bytes)",
            item,
            url=copy.url,
            stored_bytes=copy.stored_bytes,
            raw_bytes=copy.raw_bytes,
        )
        return _result(item, "done", f"{what} at {copy.url}")
    finally:
        cat.release(item.checkpoint_id, owner, gen)


def _delete_one(
    item: PlanItem,
    cat: Any,
    store: Store,
    prefix: str,
    owner: str,
    now: Callable[[], datetime],
    lease_ttl: timedelta,
    dry_run: bool,
    event: Callable[..., None],
    max_missing_fraction: float,
) -> ItemResult:
    claimed_at = now()
    gen = cat.claim(item.checkpoint_id, owner, now=claimed_at, ttl=lease_ttl)
    if gen is None:
        return _result(item, "skipped", "held by another run")
    try:
        record = cat.get_by_id(item.checkpoint_id)
        job_records = cat.checkpoints(job=item.job, with_files=False) if record is not None else []
        why = delete_refusal(item, record, job_records, max_missing_fraction=max_missing_fraction)
        if why is not None:
            if why != "already deleted":
                event("delete.refused", f"job {item.job} step {item.step}: {why}", item)
            return _result(item, "skipped", why)
        assert record is not None
        keys = [hot_file_key(prefix, record, f.relpath) for f in record.files]
        result = DeleteResult()
        for batch in _batches(keys):
            if now() >= claimed_at + lease_ttl:
                event("delete.lease_expired", f"job {item.job} step {item.step}: lease expired mid-delete", item)
                break
            try:
                result.merge(store.delete_many(batch))
            except StoreError as exc:
                partial = getattr(exc, "partial", None)
                if isinstance(partial, DeleteResult):
                    result.merge(partial)
                event(
                    "delete.failed",
                    f"job {item.job} step {item.step}: {exc}; {len(result.deleted)} of {len(keys)} files "
                    f"confirmed deleted, state left unchanged",
                    item,
                    deleted=list(result.deleted),
                )
                detail = f"unavailable: {exc}" if isinstance(exc, Unavailable) else str(exc)
                return _result(item, "failed", detail)
        confirmed = set(result.deleted)
        if dry_run:
            return _result(item, "would", f"would delete {len(confirmed)} files ({item.scope})", freed=record.bytes)
        sizes = {k: f.size for k, f in zip(keys, record.files)}
        freed = sum(sizes[k] for k in confirmed - set(result.markers_only))
        if result.markers_only:
            event(
                "delete.space_not_freed",
                f"job {item.job} step {item.step}: space not freed: versioned bucket {store.url} kept old "
                f"versions of {len(result.markers_only)} files behind delete markers; add a lifecycle rule",
                item,
                keys=list(result.markers_only),
            )
        if confirmed != set(keys):
            missing = sorted(set(keys) - confirmed)
            event(
                "delete.partial",
                f"job {item.job} step {item.step}: {len(confirmed)} of {len(keys)} files deleted; "
                f"not deleted: {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}; state left unchanged, "
                f"the next run resumes",
                item,
                failed=dict(result.failed),
            )
            return _result(item, "partial", f"{len(missing)} of {len(keys)} files not deleted", freed=freed)
        reasons = list(item.reasons)
        if item.scope == "hot-copy":
            # Only the hot copy went; the checkpoint lives on in the archive. The catalog has no
            # fenced "hot copy deleted" call: check the lease is unexpired and still ours (release
            # succeeds only for the holder's generation), then record the copy state.
            fenced_ok = now() < claimed_at + lease_ttl and cat.release(item.checkpoint_id, owner, gen)
            if not fenced_ok:
                event("delete.fenced", f"job {item.job} step {item.step}: lease lost; hot copy state not recorded", item)
                return _result(item, "fenced", "lease was taken over; catalog unchanged", freed=freed)
            gen = -1  # released above
            cat.set_copy_state(item.checkpoint_id, tier=Tier.HOT, url=record.location, state="deleted", now=now())
            event("delete.hot_copy", f"job {item.job} step {item.step}: hot copy deleted; " + "; ".join(reasons), item)
            return _result(item, "done", "hot copy deleted; archive copy remains", freed=freed)
        if not cat.mark_deleted(item.checkpoint_id, owner=owner, generation=gen, now=now(), reasons=reasons):
            event(
                "delete.fenced",
                f"job {item.job} step {item.step}: lease lost to another run; tombstone refused",
                item,
            )
            return _result(item, "fenced", "lease was taken over; catalog unchanged", freed=freed)
        return _result(item, "done", f"deleted {len(keys)} files", freed=freed)
    finally:
        if gen >= 0:
            cat.release(item.checkpoint_id, owner, gen)
