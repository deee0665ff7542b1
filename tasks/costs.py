"""Cost tables for the report: what each job stores where, what it costs, how
far back it can recover and how long a restore takes.

Pure: :func:`cost_tables` is a function of catalog records, drills, the
config (policies and prices) and ``now``, and returns typed rows
(:class:`JobCosts`). Renderers (``ckptier report --costs``, the dashboard)
only format them.

Definitions:

* **stored bytes** per tier and storage class: a hot copy counts the
  checkpoint's bytes; an archive copy its stored (compressed) bytes. The hot
  class is ``STANDARD`` for checkpoints on S3, ``hot`` for local ones; an
  archive copy on S3 is in the policy's ``storage_class`` (STANDARD when
  unset) moved by its ``archive_tiers`` at the copy's age (counted from when
  it was verified, about when it was written) — an estimate from the
  policy, the store is not asked.
* **keep-all**: every checkpoint the catalog ever saw for the job
  (tombstones included), full size, in the hot class.
* **recovery point**: the newest (highest step) checkpoint whose most
  recent drill passed and that still has a copy; its age is ``now`` minus
  when it was saved.
* **expected restore time**: its size over the median fetch throughput the
  job's drills measured from the tier it would be fetched from (hot when it
  still has a hot copy, else archive); unknown until a drill has fetched
  from that tier.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from ckptier.storage.records import CheckpointRecord, State
from ckptier.storage.transitions import DrillLike, latest_drills

from .config import Config
from .prices import Prices
from .retention import Policy, hot_present
from .tiers import HOT, class_at, class_rank, hot_class_of


class CostedDrill(DrillLike, Protocol):
    """What costs read of a drill besides what every rule reads of one
    (:class:`~ckptier.storage.transitions.DrillLike`; the catalog's
    ``DrillRecord`` fits): its job and step, the tier it fetched from and its
    phase timings."""

    @property
    def job(self) -> str: ...
    @property
    def step(self) -> int | None: ...
    @property
    def source_tier(self) -> str | None: ...
    @property
    def timings(self) -> Mapping[str, float]: ...


@dataclass(frozen=True)
class TierCost:
    """Bytes and monthly cost of one job in one tier and storage class."""

    tier: str
    storage_class: str
    checkpoints: int
    bytes: int
    monthly_cost: float
    price_source: str


@dataclass(frozen=True)
class RecoveryPoint:
    """The newest drill-passed checkpoint still held: step, when it was saved,
    its age at ``now`` (seconds), when the drill passed, and the tiers holding it."""

    checkpoint_id: int
    step: int
    saved_at: datetime
    age_s: float
    drilled_at: datetime
    tiers: tuple[str, ...]


@dataclass(frozen=True)
class RestoreEstimate:
    """Expected time to restore the recovery point from ``tier``: ``bytes`` over
    ``throughput_bytes_per_s`` (median of ``drills`` fetches from that tier);
    None when no drill measured that tier (``reason`` says so). ``cost``: what
    reading it back costs at the configured prices (retrieval, requests)."""

    tier: str
    bytes: int
    throughput_bytes_per_s: float | None
    seconds: float | None
    drills: int
    cost: float
    reason: str | None = None


@dataclass(frozen=True)
class JobCosts:
    """One job's row of the cost report (see the module docstring)."""

    job: str
    tiers: tuple[TierCost, ...]
    stored_bytes: int
    monthly_cost: float
    keep_all_checkpoints: int
    keep_all_bytes: int
    keep_all_monthly_cost: float
    savings_monthly: float
    savings_fraction: float
    recovery_point: RecoveryPoint | None
    restore: RestoreEstimate | None
    price_note: str
    prices_assumed: bool
    currency: str


def _saved(c: CheckpointRecord) -> datetime:
    return c.saved_at if c.saved_at is not None else c.first_seen


def archive_class_of(url: str, verified_at: datetime | None, policy: Policy | None, now: datetime) -> str:
    """The (estimated) class of an archive copy at ``url``: ``hot`` for a local
    archive; on S3 the policy's ``storage_class`` moved by its
    ``archive_tiers`` at the copy's age."""
    if not url.startswith("s3://"):
        return HOT
    initial = policy.storage_class if policy else None
    tiers = policy.archive_tiers if policy else ()
    age = now - verified_at if verified_at is not None else timedelta(0)
    return class_at(age, initial, tiers)


def fetch_throughputs(
    drills: Iterable[CostedDrill], sizes: Mapping[int, int]
) -> dict[tuple[str, str], list[float]]:
    """Fetch throughputs (bytes/s) the drills measured, by (job, source tier):
    the drilled checkpoint's bytes (``sizes`` by checkpoint id) over the
    drill's ``fetch_s`` timing. Drills without both are skipped; a failed
    drill whose fetch completed still counts (the fetch was measured)."""
    out: dict[tuple[str, str], list[float]] = {}
    for d in drills:
        seconds = d.timings.get("fetch_s") if d.timings else None
        size = sizes.get(d.checkpoint_id) if d.checkpoint_id is not None else None
        if not seconds or seconds <= 0 or not size or not d.source_tier:
            continue
        out.setdefault((d.job, d.source_tier), []).append(size / seconds)
    return out


def recovery_point(records: Sequence[CheckpointRecord], drills: Iterable[CostedDrill], now: datetime) -> RecoveryPoint | None:
    """The newest checkpoint of ``records`` (one job) whose most recent drill
    passed (:func:`ckptier.storage.transitions.latest_drill`) and that still has a
    present copy, or None."""
    latest = latest_drills(drills)
    held = [
        c for c in records
        if c.state != State.DELETED and c.id in latest and latest[c.id].ok and (hot_present(c) or c.archive_copy() is not None)
    ]
    if not held:
        return None
    best = max(held, key=lambda c: (c.step, _saved(c), c.id))
    d = latest[best.id]
    tiers = tuple(t for t, ok in (("hot", hot_present(best)), ("archive", best.archive_copy() is not None)) if ok)
    return RecoveryPoint(best.id, best.step, _saved(best), (now - _saved(best)).total_seconds(),
                         d.finished_at or d.started_at, tiers)


def cost_tables(
    records: Sequence[CheckpointRecord],
    drills: Iterable[CostedDrill],
    config: Config,
    *,
    now: datetime,
) -> list[JobCosts]:
    """One :class:`JobCosts` per job of ``records``, ordered by job name.

    ``records``: the catalog's checkpoints *including tombstones* (they
    count toward keep-all: ``Catalog.checkpoints(include_deleted=True)``).
    ``drills``: the catalog's drills (``Catalog.drills()``, any jobs).
    ``config``: each job's policy (``policy_for``: its archive's
    ``storage_class`` and ``archive_tiers``) and the prices. Raises
    :class:`~ckptier.storage.errors.ConfigError` when a class in use has no
    price. Pure.
    """
    prices = config.prices
    if now.tzinfo is None:
        raise ValueError(f"now = {now.isoformat()} has no timezone: pass an aware UTC datetime")
    by_job: dict[str, list[CheckpointRecord]] = {}
    for r in records:
        by_job.setdefault(r.job, []).append(r)
    drills = list(drills)
    throughputs = fetch_throughputs(drills, {r.id: r.bytes for r in records})
    out = []
    for job in sorted(by_job):
        cs = by_job[job]
        policy = config.policy_for(job)
        counts: dict[tuple[str, str], list[int]] = {}
        for c in cs:
            if c.state == State.DELETED:
                continue
            if hot_present(c):
                entry = counts.setdefault(("hot", hot_class_of(c)), [0, 0])
                entry[0] += 1
                entry[1] += c.bytes
            copy = c.archive_copy()
            if copy is not None:
                cls = archive_class_of(copy.url, copy.verified_at, policy, now)
                entry = counts.setdefault(("archive", cls), [0, 0])
                entry[0] += 1
                entry[1] += copy.stored_bytes if copy.stored_bytes is not None else c.bytes
        tiers = tuple(
            TierCost(tier, cls, n, b, prices.monthly(b, cls), prices.note([cls]))
            for (tier, cls), (n, b) in sorted(counts.items(), key=lambda kv: (kv[0][0] != "hot", class_rank(kv[0][1])))
        )
        newest = max(cs, key=lambda c: (c.step, c.id))
        keep_all_class = hot_class_of(newest)
        keep_all_bytes = sum(c.bytes for c in cs)
        keep_all_cost = prices.monthly(keep_all_bytes, keep_all_class)
        monthly = sum(t.monthly_cost for t in tiers)
        used = {t.storage_class for t in tiers} | {keep_all_class}
        job_drills = [d for d in drills if d.job == job]
        point = recovery_point(cs, job_drills, now)
        out.append(JobCosts(
            job=job, tiers=tiers, stored_bytes=sum(t.bytes for t in tiers), monthly_cost=monthly,
            keep_all_checkpoints=len(cs), keep_all_bytes=keep_all_bytes, keep_all_monthly_cost=keep_all_cost,
            savings_monthly=keep_all_cost - monthly,
            savings_fraction=(1 - monthly / keep_all_cost) if keep_all_cost else 0.0,
            recovery_point=point,
            restore=_restore(point, cs, policy, throughputs, job, prices, now) if point else None,
            price_note=prices.note(used), prices_assumed=prices.assumed(used), currency=prices.currency,
        ))
    return out


def _restore(point: RecoveryPoint, cs: Sequence[CheckpointRecord], policy: Policy | None,
             throughputs: Mapping[tuple[str, str], list[float]], job: str, prices: Prices, now: datetime) -> RestoreEstimate:
    record = next(c for c in cs if c.id == point.checkpoint_id)
    tier = "hot" if "hot" in point.tiers else "archive"
    if tier == "hot":
        cls, read = hot_class_of(record), record.bytes
    else:
        copy = record.archive_copy()
        assert copy is not None
        cls = archive_class_of(copy.url, copy.verified_at, policy, now)
        read = copy.stored_bytes if copy.stored_bytes is not None else record.bytes
    cost = prices.read_back(read, max(len(record.files), 1), cls)
    measured = throughputs.get((job, tier), [])
    if not measured:
        return RestoreEstimate(tier, record.bytes, None, None, 0, cost,
                               reason=f"no drill of job {job} has fetched from the {tier} tier yet")
    rate = statistics.median(measured)
    return RestoreEstimate(tier, record.bytes, rate, record.bytes / rate, len(measured), cost)
