"""The operations as plain functions: what the CLI runs directly and what
the Prefect tasks wrap.

Each function takes an open :class:`Catalog`, a clock (``now`` or a
callable) and plain settings, does its I/O through stores, records the
outcome in the catalog, and returns a JSON-ready report. No Prefect here.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from ckptier.storage.base import Store
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.errors import ConfigError
from ckptier.storage.model import CheckpointRecord, State
from ckptier.storage.url import open_store, parse_url

from .config import Config
from .retention import Plan, PlanItem, plan_retention
from .scan import ScanReport, scan_url

Clock = Callable[[], datetime]


class StoreCache:
    """Opens each store once and maps a catalog location URL to ``(store, prefix)``.

    S3 locations share one store per bucket (``prefix`` is the key within
    the bucket); a local location is served by a store rooted at its parent
    directory (``prefix`` is the last path component), which works for
    checkpoint directories and single-file checkpoints alike. Thread-safe.
    """

    def __init__(self, opener: Callable[[str], Store] = open_store) -> None:
        self._opener = opener
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()

    def store(self, url: str) -> Store:
        with self._lock:
            if url not in self._stores:
                self._stores[url] = self._opener(url)
            return self._stores[url]

    def locate(self, location: str) -> tuple[Store, str]:
        parsed = parse_url(location)
        if parsed.scheme == "s3":
            return self.store(f"s3://{parsed.bucket}"), parsed.prefix
        parent, name = posixpath.split(parsed.path.rstrip("/"))
        return self.store(parent or "/"), name

    def for_record(self, record: CheckpointRecord) -> tuple[Store, str]:
        return self.locate(record.location)


# -------------------------------------------------------------------- scan


def scan_report_json(r: ScanReport) -> dict[str, Any]:
    s = r.summary
    return {
        "url": r.url,
        "objects": r.objects,
        "checkpoints": r.checkpoints,
        "committed": r.committed,
        "incomplete": r.incomplete,
        "rows_written": r.rows_written,
        "new": s.new if s else 0,
        "changed": s.changed if s else 0,
        "vanished": s.vanished if s else 0,
        "jobs": list(s.jobs) if s else [],
        "unrecognised": [{"key": u.key, "reason": u.reason} for u in r.unrecognised],
    }


def run_scan(
    urls: Sequence[str],
    catalog: Catalog,
    *,
    now: Clock,
    tick: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """Scan each URL in turn into ``catalog``; returns one report per URL."""
    return [scan_report_json(scan_url(url, catalog, now=now(), tick=tick)) for url in urls]


# ------------------------------------------------------------------ verify


def run_verify(
    catalog: Catalog,
    *,
    now: Clock,
    job: str | None = None,
    deep: bool = False,
    sample: tuple[int, int] | None = None,
    workers: int = 4,
    progress: Callable[[int, int], None] | None = None,
    stores: StoreCache | None = None,
) -> dict[str, Any]:
    """Verify the checkpoints that need it and record the results.

    Candidates are committed, verified and corrupt checkpoints present in
    the hot tier (``job`` restricts them; ``sample=(k, n)`` keeps the k-th
    of n disjoint slices). A checkpoint already verified is re-read only
    with ``deep`` or a sample (a periodic deep read), or when its files
    changed since (a rescan put it back to ``committed``). Returns a report
    with one row per checkpoint and totals; ``totals['corrupt']`` > 0 means
    corruption was found.
    """
    from .verify import select_sample, verify_many

    stores = stores or StoreCache()
    states = (State.COMMITTED, State.VERIFIED, State.CORRUPT)
    records = [c for c in catalog.checkpoints(job=job, states=states) if c.missing_since is None]
    if job and not records and not catalog.checkpoints(job=job):
        raise ConfigError(f"job {job!r}: no checkpoints in the catalog; run 'ckptier scan URL' first or check the name")
    if sample is not None:
        records = select_sample(records, *sample)
    elif not deep:
        records = [c for c in records if c.state == State.COMMITTED]
    rows: list[dict[str, Any]] = []
    totals = {"checked": 0, "verified": 0, "corrupt": 0, "errors": 0, "bytes_read": 0, "bytes_skipped": 0}
    # Verify against the store's checksum unless a deep read was asked for.
    for record, outcome in verify_many(stores.for_record, records, deep=deep or sample is not None,
                                       workers=workers, progress=progress):
        state = catalog.record_verification(record.id, outcome.results, now=now())
        errors = outcome.count("error")
        detail = "; ".join(
            [f"{r.relpath}: {r.detail}" for r in outcome.results if r.status != "ok" and r.detail][:3]
            + [f"extra file {x}" for x in outcome.extra[:3]]
            + outcome.notes
        )
        rows.append({
            "job": record.job, "step": record.step, "state": state.value,
            "bytes_read": outcome.bytes_read, "bytes_skipped": outcome.bytes_skipped,
            "errors": errors, "extra": outcome.extra, "detail": detail or None,
        })
        totals["checked"] += 1
        totals["verified"] += state == State.VERIFIED
        totals["corrupt"] += state == State.CORRUPT
        totals["errors"] += errors > 0
        totals["bytes_read"] += outcome.bytes_read
        totals["bytes_skipped"] += outcome.bytes_skipped
    return {"checkpoints": rows, "totals": totals, "sample": f"{sample[0]}/{sample[1]}" if sample else None}


# -------------------------------------------------------------------- plan


def _keep_unmanaged(records: Iterable[CheckpointRecord]) -> list[PlanItem]:
    return [
        PlanItem(job=c.job, step=c.step, checkpoint_id=c.id, action="keep", bytes=c.bytes, state=c.state.value,
                 reasons=("no [[policy]] in ckptier.toml matches this job: nothing is deleted",))
        for c in records
    ]


def make_plan(catalog: Catalog, config: Config, *, job: str | None, now: datetime) -> Plan:
    """The retention plan for every job (or ``job``), each under its own policy.

    Jobs no ``[[policy]]`` matches are kept whole. Pure apart from reading
    the catalog; nothing is changed.
    """
    records = catalog.checkpoints(job=job, include_deleted=False)
    if job and not records:
        raise ConfigError(f"job {job!r}: no checkpoints in the catalog; run 'ckptier scan URL' first or check the name")
    by_policy: dict[int, list[CheckpointRecord]] = {}
    unmanaged: list[CheckpointRecord] = []
    policies = {}
    for c in records:
        policy = config.policy_for(c.job)
        if policy is None:
            unmanaged.append(c)
        else:
            policies[id(policy)] = policy
            by_policy.setdefault(id(policy), []).append(c)
    plans = [plan_retention(cs, policies[k], now=now) for k, cs in by_policy.items()]
    return merge_plans(plans, extra_items=_keep_unmanaged(unmanaged))


def merge_plans(plans: Sequence[Plan], *, extra_items: Sequence[PlanItem] = ()) -> Plan:
    """Combine per-policy plans (disjoint jobs) into one, ordered by (job, step, id)."""
    items = sorted([i for p in plans for i in p.items] + list(extra_items), key=lambda i: (i.job, i.step, i.checkpoint_id))
    refused_jobs = {j: r for p in plans for j, r in p.refused_jobs.items()}
    return Plan(
        items=items,
        refused="; ".join(refused_jobs.values()) or None,
        refused_jobs=refused_jobs,
        excluded=tuple(sorted(x for p in plans for x in p.excluded)),
        missing=tuple(sorted(x for p in plans for x in p.missing)),
        stale=tuple(sorted(x for p in plans for x in p.stale)),
    )


def with_items(plan: Plan, items: list[PlanItem]) -> Plan:
    return replace(plan, items=items)
