"""The operations as plain functions: what the CLI runs directly and what
the Prefect tasks wrap.

Each operation takes one :class:`~ckptier.tasks.run.Run` (the open catalog,
the config, the stores, the clock, the owner, dry-run; assembled once per
command or flow run by :func:`~ckptier.tasks.run.open_run`) and, where it
is asked more than a few things, one small frozen options object
(:class:`VerifyOptions`, :class:`ApplyOptions`, :class:`DrillOptions`); verify's
live in :mod:`ckptier.tasks.verify_run`, re-exported here. It
does its I/O through the run's stores, records the outcome in the catalog,
and returns a typed report (a dataclass of
:mod:`ckptier.tasks.reports` or :mod:`ckptier.tasks.scan`) whose
``to_json()`` is made only at the edges (``--json``, artifacts, events).
No Prefect here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptier.storage.base import StorageClasses, Store
from ckptier.storage.catalog.api import Catalog
from ckptier.storage.errors import CkptierError, ConfigError
from ckptier.storage.records import CheckpointRecord, State
from ckptier.storage.url import canonical_url

from .apply import ApplyContext, ApplyReport, apply_plan
from .backup import backup_after_apply
from .archive import archive_dir, archive_root, check_layout, fetch, janitor, prefix_from_location, promoter
from .config import Config, DrillSettings, check_archive_locations, policy_grace
from .fanout import Fanout
from .forget import archive_places, forget_candidates, still_stored
from .leases import DEFAULT_TTL as DEFAULT_LEASE_TTL
from .prove import prove_record
from .reports import (
    NOTHING_FREED,
    ApplyRunReport,
    Check,
    DrillReport,
    FetchReport,
    ForgetOutcome,
    ForgetReport,
    ForgetRow,
    FreedForecast,
    ItemResult,
    JanitorReport,
    JanitorRunReport,
    JobSummary,
    Proof,
    drill_outcome,
    forecast_freed,
    hot_bytes,
    summarize_jobs,
    tiering_outcome,
)
from .retention import Plan, PlanItem, Policy, drill_passed, plan_retention
from .run import Clock, Run, StoreCache, unknown_job
from .scan import ScanReport, scan_url
from .verify_run import RECORD_BATCH as RECORD_BATCH  # re-exported: verify is one of the operations
from .verify_run import RECORD_BATCH_BYTES as RECORD_BATCH_BYTES
from .verify_run import VerifyOptions as VerifyOptions
from .verify_run import nothing_verified as nothing_verified
from .verify_run import recording_batches as recording_batches
from .verify_run import run_verify as run_verify
from .verify_run import with_archive_copy as with_archive_copy

if TYPE_CHECKING:
    from .drill import Expected
    from .drill_trajectory import Trajectory

# -------------------------------------------------------------------- scan


def run_scan(
    run: Run,
    urls: Sequence[str],
    *,
    tick: Callable[[int], None] | None = None,
    inventories: Mapping[str, str] | Sequence[tuple[str, str]] = (),
    full: bool = False,
) -> list[ScanReport]:
    """Scan each URL in turn into ``run.catalog``; returns one :class:`ScanReport` per URL, in order
    (:meth:`ScanReport.to_json` is what ``scan --json`` prints).

    ``run.config`` gives the ``[[pattern]]`` rules (tried on files no
    built-in format claims), each job's grace (default 2 h) and the
    ``[[inventory]]`` tables. ``inventories`` maps more URLs (any spelling)
    to the S3 Inventory report their scan reads instead of listing
    (``--inventory``); ``full`` lists local directories even where their
    stamps are unchanged. ``tick(n)`` is told how many objects were listed.
    """
    config = run.config
    pairs = [*config.inventories, *(inventories.items() if isinstance(inventories, Mapping) else inventories)]
    by_url = {canonical_url(u): r for u, r in pairs}
    return [
        scan_url(url, run.catalog, now=run.now(), tick=tick, patterns=config.patterns, grace_for=policy_grace(config),
                 full=full, inventory=by_url.get(canonical_url(url)))
        for url in urls
    ]


# -------------------------------------------------------------------- plan


def _keep_unmanaged(records: Iterable[CheckpointRecord]) -> list[PlanItem]:
    return [
        PlanItem(job=c.job, step=c.step, checkpoint_id=c.id, action="keep", bytes=c.bytes, state=c.state.value,
                 reasons=("no [[policy]] in ckptier.toml matches this job: nothing is deleted",))
        for c in records
    ]


def plans_by_policy(run: Run, *, job: str | None = None,
                    records: Sequence[CheckpointRecord] | None = None) -> list[tuple[Policy | None, Plan]]:
    """One retention plan per ``[[policy]]`` of ``run.config`` that matches some job
    (``None``: jobs no policy matches), at ``run.now()``.

    Reads the catalog (checkpoints, tombstones without their files, and the
    drill history for ``min_drilled``), changes nothing. Jobs no
    ``[[policy]]`` matches are kept whole. ``records``: the checkpoints of
    ``job`` (of every job when None), tombstones included, already read by
    the caller (the planner needs no files): they are not read again.
    """
    groups, passed = _policy_groups(run.catalog, run.config, job=job, records=records)
    now = run.now()
    out: list[tuple[Policy | None, Plan]] = []
    for policy, cs in groups:
        if policy is None:
            out.append((None, Plan(items=_keep_unmanaged([c for c in cs if c.state != State.DELETED]))))
        else:
            out.append((policy, plan_retention(cs, policy, now=now, drill_passed=passed)))
    return out


def _policy_groups(catalog: Catalog, config: Config, *, job: str | None,
                   records: Sequence[CheckpointRecord] | None = None,
                   ) -> tuple[list[tuple[Policy | None, list[CheckpointRecord]]], dict[int, datetime]]:
    """The checkpoints (tombstones without files included) grouped by the policy that
    governs them, and the drill history ``min_drilled`` needs. ``records``: see
    :func:`plans_by_policy`."""
    if records is None:
        live = catalog.checkpoints(job=job, include_deleted=False)
        # Tombstones only let the plan say when a milestone passes over one; they are never planned.
        tombstones = catalog.checkpoints(job=job, states=[State.DELETED], with_files=False)
    else:
        live = [c for c in records if c.state != State.DELETED]
        tombstones = [c for c in records if c.state == State.DELETED]
    if job and not live:
        raise unknown_job(job)
    passed = _drill_passed(catalog, config, job)
    groups: dict[int, tuple[Policy | None, list[CheckpointRecord]]] = {}
    policies: dict[str, Policy | None] = {}  # a job's policy matched once, not once per checkpoint
    for c in [*live, *tombstones]:
        if c.job not in policies:
            policies[c.job] = config.policy_for(c.job)
        policy = policies[c.job]
        groups.setdefault(id(policy), (policy, []))[1].append(c)
    return list(groups.values()), passed


def plan_with_forecast(run: Run, *, job: str | None = None) -> tuple[Plan, FreedForecast]:
    """:func:`make_plan`, and the hot bytes carrying it out frees
    (:func:`ckptier.tasks.reports.forecast_freed`, over every policy; the
    checkpoints no policy governs count in ``hot_bytes`` only). Reads only."""
    groups, passed = _policy_groups(run.catalog, run.config, job=job)
    now = run.now()
    plans: list[Plan] = []
    total = NOTHING_FREED
    for policy, cs in groups:
        if policy is None:
            plans.append(Plan(items=_keep_unmanaged([c for c in cs if c.state != State.DELETED])))
            total += FreedForecast(hot_bytes(cs), 0, 0)
            continue

        def planner(rs: Sequence[CheckpointRecord], policy: Policy = policy) -> Plan:
            return plan_retention(rs, policy, now=now, drill_passed=passed)

        plans.append(planner(cs))
        total += forecast_freed(cs, planner, now=now, first=plans[-1])
    return merge_plans(plans), total


def catalog_summary(run: Run) -> list[JobSummary]:
    """Every job of the catalog: checkpoints by state and bytes per tier (:func:`ckptier.tasks.reports.summarize_jobs`)."""
    return summarize_jobs(run.catalog.checkpoints(include_deleted=True, with_files=False))


#: Drills read back for ``min_drilled``: far more than any catalog holds (one a night per job).
DRILL_HISTORY = 1_000_000


def _drill_passed(catalog: Catalog, config: Config, job: str | None) -> dict[int, datetime]:
    """Checkpoint id -> when its most recent drill passed; read only when some policy sets ``min_drilled``."""
    if not any(p.min_drilled for p in config.policies):
        return {}
    return drill_passed([d for d in catalog.drills(job=job, limit=DRILL_HISTORY) if d.judged])  # not judged: history only


def make_plan(run: Run, *, job: str | None = None) -> Plan:
    """The retention plan for every job (or ``job``), each under its own policy, at ``run.now()``."""
    return merge_plans([plan for _, plan in plans_by_policy(run, job=job)])


def merge_plans(plans: Sequence[Plan]) -> Plan:
    """Combine per-policy plans (disjoint jobs) into one, ordered by (job, step, id)."""
    items = sorted((i for p in plans for i in p.items), key=lambda i: (i.job, i.step, i.checkpoint_id))
    refused_jobs = {j: r for p in plans for j, r in p.refused_jobs.items()}
    return Plan(
        items=items,
        refused="; ".join(refused_jobs.values()) or None,
        refused_jobs=refused_jobs,
        excluded=tuple(sorted(x for p in plans for x in p.excluded)),
        missing=tuple(sorted(x for p in plans for x in p.missing)),
        stale=tuple(sorted(x for p in plans for x in p.stale)),
        warnings=tuple(sorted(w for p in plans for w in p.warnings)),
    )


# ------------------------------------------------------------------- apply


@dataclass(frozen=True)
class ApplyOptions:
    """What ``ckptier apply`` (and the tiering flow) is asked to carry out:
    ``job`` (None: every job) and the length of the leases it holds
    (``lease_ttl``; a heartbeat renews them while the run lives)."""

    job: str | None = None
    lease_ttl: timedelta = DEFAULT_LEASE_TTL


def run_apply(run: Run, options: ApplyOptions = ApplyOptions(), *, fanout: Fanout | None = None) -> ApplyRunReport:
    """Plan and carry out retention for every job (or ``options.job``): promote, prove, then delete.

    ``run`` gives the catalog, the policies (``run.config``), the stores,
    the clock, the owner named in the leases and ``dry_run`` (say what would
    happen, change nothing). ``fanout`` (a :class:`ckptier.tasks.fanout.Fanout`) makes the archive
    copies of a pass's promotions there, several at once (compress, upload,
    read back); this process claims, checks and records each.

    Each policy's plan goes through :func:`ckptier.tasks.apply.apply_plan`
    (canary, leases with a heartbeat, read-back, keepers proven again,
    fenced deletes). Refuses (:class:`ConfigError`) a policy whose archive
    equals, contains or lies inside a hot location the catalog knows.
    Returns an :class:`~ckptier.tasks.reports.ApplyRunReport`: ``items``
    (:class:`~ckptier.tasks.apply.ItemResult`), ``lines`` (per item, then
    each policy's summary), ``bytes_freed``, ``failed`` (True when any item
    failed: re-running resumes), ``held`` (lines naming the other live runs
    that hold checkpoints this run skipped), ``proofs`` (every copy proven
    again before a deletion: :class:`~ckptier.tasks.apply.Proof`) and
    ``outcome`` (what was carried out, per tier and storage class:
    :class:`~ckptier.tasks.reports.TieringOutcome`; empty in a dry run).
    """
    catalog, dry_run = run.catalog, run.dry_run
    check_archive_locations(run.config, catalog.hot_locations())
    done = _Applied()
    lines, items = done.lines, done.items
    failed = False
    freed = 0
    proofs: list[Proof] = []
    # A second pass lets hot copies of milestones promoted in the first one go
    # in the same run (the plan is made anew from the catalog each pass).
    passes = 1 if dry_run else 2
    for n in range(passes):
        promoted = False
        for policy, plan in plans_by_policy(run, job=options.job):
            if policy is None:
                if n == 0:
                    lines.extend(f"{i.job} step {i.step}: kept ({i.reasons[0]})" for i in plan.items)
                continue
            if n > 0 and not any(i.action == "delete" for i in plan.items):
                continue
            report = _apply_one(run, policy, plan, options=options, done=done, fanout=fanout)
            proofs.extend(report.proofs)
            promoted |= bool(report.promoted)
            failed |= not report.ok
            freed += report.bytes_freed
        if not promoted or failed:
            break
    if not dry_run:  # what storage cannot tell goes to the archive tier too (ckptier rebuild reads it)
        lines.extend(backup_after_apply(catalog, run.config, run.stores.store, now=run.now(), job=options.job))
    held = tuple(f"{i.job} step {i.step}: {i.action} {i.detail}" for i in items if i.outcome == "held")
    promoted_ids = {i.checkpoint_id for i in items if i.action == "promote" and i.outcome == "done"}
    touched = {i.checkpoint_id: catalog.get_by_id(i.checkpoint_id) for i in items
               if i.checkpoint_id in promoted_ids or (i.action == "delete" and i.freed)}
    outcome = tiering_outcome(items, {k: v for k, v in touched.items() if v is not None})
    return ApplyRunReport(dry_run=dry_run, items=tuple(items), lines=tuple(lines), bytes_freed=freed, failed=failed,
                          held=held, proofs=tuple(proofs), outcome=outcome)


@dataclass
class _Applied:
    """What a run's passes have done so far: report ``lines``, the ``items`` carried out,
    and the keepers ``proven`` (by id; a keeper is proven once per run, by either pass)."""

    lines: list[str] = field(default_factory=list)
    items: list[ItemResult] = field(default_factory=list)
    proven: set[int] = field(default_factory=set)


def _apply_one(run: Run, policy: Policy, plan: Plan, *, options: ApplyOptions, done: _Applied,
               fanout: Fanout | None = None) -> ApplyReport:
    """Carry out one policy's plan in ``run`` (its :class:`~ckptier.tasks.apply.ApplyContext`
    made here from the run and the policy), adding its report lines and item results to ``done``."""
    lines, items = done.lines, done.items
    archive_store = archive_store_for(run.stores, policy)
    promote_many = None
    if fanout is not None and policy.archive:
        promote_many = promoter(fanout, archive_url=policy.archive, storage_class=policy.storage_class, now=run.now,
                                owner=run.owner)
    context = ApplyContext(
        catalog=run.catalog, hot_for=run.stores.for_record, archive_for=lambda _job: archive_store, owner=run.owner,
        now=run.now, lease_ttl=options.lease_ttl, dry_run=run.dry_run, policy_for=run.config.policy_for,
        promote_many=promote_many,
    )
    report = apply_plan(plan, context, policy=str(policy), max_missing_fraction=policy.max_missing_fraction,
                        proven=done.proven)
    for p in report.proofs:
        if not p.ok:
            lines.append(f"{p.job} step {p.step}: keeper failed its proof ({p.tier} copy): {p.detail}")
    for r in report.items:
        if r.action == "keep" and r.outcome == "skipped":
            continue
        items.append(r)
        lines.append(f"{r.job} step {r.step}: {r.action}{' hot copy' if r.scope == 'hot-copy' else ''} "
                     f"{r.outcome}: {r.detail}")
    for store_url, why in report.canary_failures.items():
        lines.append(f"canary failed on {store_url}: {why}")
    if report.refused:
        lines.append(f"deletion suspended: {report.refused}")
    lines.append(f"[policy {policy.jobs}] {report.summary()}")
    return report


def archive_store_for(stores: StoreCache, policy: Policy) -> Store | None:
    """The archive tier of ``policy`` (None without one), its writes going to the policy's
    ``storage_class``. Raises ``ConfigError`` when a class is set for a store without classes."""
    if not policy.archive:
        return None
    store = stores.store(policy.archive)
    if policy.storage_class is None:
        return store
    if not isinstance(store, StorageClasses):
        raise ConfigError(f"storage_class {policy.storage_class!r}: archive {policy.archive} has no storage "
                          f"classes; they apply to s3:// archives only")
    return store.in_class(policy.storage_class)


def run_fetch(run: Run, *, job: str, step: int, dest: Path) -> FetchReport:
    """Restore job/step's original files into ``dest`` from the hot or archive tier, verified;
    the report says from which tier and source, how many files and bytes, and how long it took."""
    record = run.catalog.get(job, step)
    if record is None:
        raise ConfigError(f"job {job!r} step {step}: not in the catalog; see 'ckptier ls --job {job}'")
    # The hot copy is trusted only if its files are still the ones verified (a stat each).
    proven = prove_record(run.catalog, run.stores.for_record, record, now=run.now())
    if proven is not None and proven.verdict == "changed":
        record = run.catalog.get_by_id(record.id) or record
    return fetch_record(record, run.config, dest=dest, stores=run.stores)


def fetch_record(record: CheckpointRecord, config: Config, *, dest: Path, stores: StoreCache,
                 fanout: Fanout | None = None) -> FetchReport:
    """Restore ``record``'s original files into ``dest`` (see :func:`ckptier.tasks.archive.fetch`;
    ``fanout``: where the files are read, default here), as a :class:`FetchReport`."""
    hot, prefix = _hot_store(stores, record)
    archive = _archive_store(stores, config, record)
    result = fetch(record, hot=hot, archive=archive, dest=dest, hot_prefix=prefix, fanout=fanout)
    return FetchReport(job=record.job, step=record.step, tier=result.tier, source=result.source, dest=str(result.dest),
                       files=len(result.paths), bytes=result.bytes, seconds=round(result.seconds, 3),
                       notes=tuple(result.notes))


def _hot_store(stores: StoreCache, record: CheckpointRecord) -> tuple[Store | None, str | None]:
    try:
        return stores.for_record(record)
    except ConfigError:
        return None, None


def _archive_store(stores: StoreCache, config: Config, record: CheckpointRecord) -> Store | None:
    """The store holding the record's archive copy (from the catalog, else the job's policy)."""

    copy = record.archive_copy()
    if copy is not None:
        return stores.store(archive_root(copy.url, record))
    policy = config.policy_for(record.job)
    return stores.store(policy.archive) if policy is not None and policy.archive else None


def run_janitor(run: Run, *, older_than: timedelta) -> JanitorRunReport:
    """Clean every archive tier named by a policy of ``run.config`` of what interrupted
    promotions left ``older_than`` ago (at ``run.now()``).

    Only ckptier's own objects go (those an upload marker names, and local
    temporary files); anything else is reported, never removed. Copies the
    catalog holds as present are never removed, even when their manifest is
    gone: that is reported as damage instead. Refuses (:class:`ConfigError`)
    an archive that equals, contains or lies inside a hot location the
    catalog knows, before touching anything. Returns a
    :class:`~ckptier.tasks.reports.JanitorRunReport`: per archive URL its
    :class:`~ckptier.tasks.archive.JanitorReport`, and the run in ``lines``.
    """
    catalog, config, stores, now = run.catalog, run.config, run.stores, run.now()
    check_archive_locations(config, catalog.hot_locations())
    lines: list[str] = []
    reports: dict[str, JanitorReport] = {}
    records = catalog.checkpoints(include_deleted=True, with_files=False)
    for url in sorted({p.archive for p in config.policies if p.archive}):
        store = stores.store(url)
        cataloged = {
            archive_dir(c.job, c.step)
            for c in records
            if (cp := c.archive_copy()) is not None and archive_root(cp.url, c) == store.url
        }
        r = janitor(store, now=now, older_than=older_than, cataloged=cataloged)
        reports[url] = r
        lines.append(f"{url}: aborted {len(r.aborted_uploads)} uploads, removed {len(r.removed_dirs)} copies without "
                     f"manifest ({len(r.removed_keys)} objects) and {len(r.removed_temp_files)} stale temporary files, "
                     f"left {len(r.young_dirs)} young ones and {len(r.not_ours)} objects ckptier did not write, "
                     f"{len(r.failed)} failures")
        lines.extend(f"{url}/{k}: not written by ckptier (no commit or upload marker names it); left in place"
                     for k in r.not_ours[:20])
        lines.extend(f"{url}/{d}: cataloged archive copy has lost its manifest; left in place, check it"
                     for d in r.unexpected)
    if not reports:
        lines.append("no [[policy]] names an archive tier: nothing to clean")
    return JanitorRunReport(archives=reports, lines=tuple(lines))


# ------------------------------------------------------------------- drill

#: Worker failures that mean "this checkpoint does not restore": try the next one.
LOAD_STAGES = frozenset({"load", "restore", "fetch"})


@dataclass(frozen=True)
class DrillOptions:
    """What to drill and how, as ``ckptier drill`` and the restore-drill flow are asked.

    ``job`` (None: every job) and ``step`` (None: the newest verified one);
    ``steps`` training steps, ``device``, ``model`` factory (``module:function``
    or ``path.py:function``) and ``timeout`` (seconds): None takes the job's
    ``[[drill]]`` setting, else :class:`ckptier.tasks.config.DrillSettings`'
    default. ``allow_globals``: extra classes the safe loader may unpickle
    (``--allow-global``), besides the job's ``[[drill]] allow_globals``.
    ``world_size``: restore into that many ranks (None: as many as saved the
    checkpoint). ``scratch_root``: where the scratch directories go (None:
    the system's temporary directory). ``gpu_pool``: the GPU work pool the
    drill runs on (None: none), where device ``auto`` needs a GPU unless the
    job's ``[[drill]] require_gpu`` is false
    (:func:`ckptier.tasks.drill_inputs.decide_device`). ``steps``, ``device``
    and ``timeout`` at their built-in values take the job's ``[[drill]]``
    ones (:func:`ckptier.tasks.config.drill_values`).
    """

    job: str | None = None
    step: int | None = None
    steps: int | None = None
    device: str | None = None
    model: str | None = None
    timeout: float | None = None
    allow_globals: tuple[str, ...] = ()
    world_size: int | None = None
    scratch_root: Path | None = None
    gpu_pool: str | None = None


def run_drill(run: Run, options: DrillOptions, *, fanout: Any = None) -> list[DrillReport]:
    """Restore-drill the newest verified checkpoint of each job (or of ``options.job``).

    ``run`` gives the catalog, the config (each job's ``[[drill]]``), the
    stores and the clock; ``options`` what to drill and how
    (:class:`DrillOptions`).

    A checkpoint saved by N ranks is drilled by N workers, each fetching only
    its own rank's files (:mod:`ckptier.tasks.drill_launch`), a single-rank
    one by one worker (the same engine at world size 1); with
    ``world_size`` M it is restored into M ranks and compared with a
    same-size restore (the report's ``reshard`` says whether the run resumes
    on M ranks). A checkpoint whose ranks cannot be drilled yet
    (partitioned) gets a report that says so (``stage`` ``unsupported``,
    not recorded as a failed drill).

    For each job: fetch the best candidate into a fresh scratch directory
    (hot tier, else archive, verified), run the isolated worker (safe load,
    strict restore, K training steps twice), judge, record the drill in the
    catalog, remove the scratch directory. When a candidate fails to fetch or
    load, the failure is recorded and the next verified checkpoint is tried.
    When the model factory does not load in the worker (the operator's
    error, not the checkpoint's), nothing is recorded: the job's report says
    why (``stage`` ``not-started``, ``recorded`` False) and its other
    candidates are not tried.
    Returns one :class:`~ckptier.tasks.reports.DrillReport` per drill
    attempted, in order (job, step, ok, summary, checks, timings, ...;
    ``to_json()`` for JSON). Raises ``ConfigError`` when there is
    nothing to drill (:func:`nothing_to_drill` says why), or when an ``allow_globals`` entry is malformed or
    unsafe (checked before anything is fetched). The safe loader may unpickle
    the job's ``[[drill]] allow_globals`` plus ``allow_globals`` (the command
    line's ``--allow-global``), nothing else beyond its built-in allowlist.
    With ``fanout`` (:class:`ckptier.tasks.fanout.Fanout`) the files of each
    fetch, every rank's included, are read on it; the drill is the same.
    """
    import shutil
    import tempfile

    from ckptier.formats.names import allow_global_problem
    from .drill import DEFAULT_LOSS_TOLERANCE, Expected, choose_candidates, factory_needed
    from .config import drill_values
    from .drill_inputs import DeviceChoice, check_drill_inputs, decide_device
    from .drill_launch import cuda_device_count
    from .drill_trajectory import DEFAULT_TRAJECTORY_RTOL

    catalog, config, stores, now = run.catalog, run.config, run.stores, run.now
    job, step, steps, device, model = options.job, options.step, options.steps, options.device, options.model
    timeout, allow_globals, world_size = options.timeout, options.allow_globals, options.world_size
    for name in allow_globals:
        if (problem := allow_global_problem(name)) is not None:
            raise ConfigError(f"--allow-global {name!r}: {problem}")
    if world_size is not None and world_size < 1:
        raise ConfigError(f"--world-size {world_size}: a drill runs on at least 1 rank; give e.g. --world-size 2")
    check_drill_inputs(model=model, device=device, steps=steps, timeout=timeout)  # before anything slow

    cataloged = catalog.checkpoints(job=job)
    candidates = choose_candidates(cataloged, job=job, step=step)
    if not candidates:
        raise nothing_to_drill(cataloged, job=job, step=step,
                               known=bool(cataloged) or bool(job and catalog.checkpoints(job=job, include_deleted=True)))
    by_job: dict[str, list[CheckpointRecord]] = {}
    for c in candidates:
        by_job.setdefault(c.job, []).append(c)
    gpus: int | None = None
    devices: dict[str, DeviceChoice] = {}
    for job_name, records in by_job.items():  # each job's [[drill]] model and device, before any fetch
        settings = config.drill_for(job_name)
        check_drill_inputs(settings, model=model, device=device)
        table = settings or DrillSettings()
        asked = drill_values(table, steps=steps, device=device, timeout=timeout)[1]
        if asked != "cpu" and gpus is None:
            gpus = cuda_device_count()
        devices[job_name] = decide_device(asked, require_gpu=table.require_gpu, gpu_pool=options.gpu_pool,
                                          gpus=gpus or 0, environ=os.environ)
        if not (model or (settings.model if settings else None)) and (why := factory_needed(records[0])):
            raise ConfigError(f"job {job_name!r} step {records[0].step}: no drill model given: {why}; pass --model "
                              "module:function (or set model = \"module:function\" in the job's [[drill]] table of "
                              "ckptier.toml), a function returning DrillSpec(model, optimizer, batch, loss) built as in training")
    _check_allowed_classes(config, by_job, allow_globals, options.scratch_root)
    reports: list[DrillReport] = []
    for job_name, records in by_job.items():
        settings = config.drill_for(job_name) or DrillSettings()  # no [[drill]]: the defaults
        factory = model or settings.model or None
        k, _, limit = drill_values(settings, steps=steps, device=device, timeout=timeout)
        dev, fallback = devices[job_name].device, devices[job_name].fallback
        tolerance = settings.loss_tolerance or DEFAULT_LOSS_TOLERANCE
        rtol = settings.trajectory_rtol if settings.trajectory_rtol is not None else DEFAULT_TRAJECTORY_RTOL
        allowed = tuple(dict.fromkeys([*settings.allow_globals, *allow_globals]))
        unfit: tuple[CheckpointRecord, DrillReport] | None = None  # a newest checkpoint the factory did not fit
        for index, record in enumerate(records):
            from .prove import prove_record

            proven = prove_record(catalog, stores.for_record, record, now=now())
            if proven is not None and proven.verdict == "changed":  # no longer what was verified: not blamed
                reports.append(_not_started(record, f"{proven.describe()}; verify it again", now(), now()))
                continue
            started = now()
            expected = Expected(_recorded_losses(record, cataloged, stores, steps=k), rtol)
            scratch = Path(tempfile.mkdtemp(prefix="ckptier-drill-", dir=options.scratch_root))
            try:
                report = _drill_checkpoint(record, config, stores, scratch, started=started, now=now, factory=factory,
                                           steps=k, device=dev, timeout=limit, tolerance=tolerance,
                                           allow_globals=allowed, world_size=world_size, fanout=fanout,
                                           trajectory=expected)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            if fallback is not None:  # a GPU was expected: the report and its recorded summary say it ran on CPU
                report = replace(report, device_note=fallback, summary=f"{report.summary} ({fallback})")
            if report.stage == "not-started":  # the operator's factory does not load: nothing recorded
                reports.append(report)
                break
            if unfit is not None:
                first, first_report = unfit
                unfit = None
                if report.stage == "fit" and report.error == first_report.error:
                    # The same mismatch on the next checkpoint too: the factory does not fit this job. One
                    # drill, not judged, for the job; the older checkpoints would only repeat it.
                    note = replace(first_report, summary=f"{first_report.summary} (step {record.step} too)")
                    _record_drill(catalog, first, note, started=note.started_at, finished=note.finished_at,
                                  tier=note.tier)
                    reports.append(note)
                    break
                # Only the newest differs from the job, which the factory fits: that checkpoint is wrong.
                blamed = replace(first_report, stage="restore", summary=(
                    f"{first.job} step {first.step}: drill failed: restore: {first_report.error}; the factory fits "
                    f"the job's step {record.step}"))
                _record_drill(catalog, first, blamed, started=blamed.started_at, finished=blamed.finished_at,
                              tier=blamed.tier)
                reports.append(_with_drift(catalog, first, blamed, now()))
            if report.stage == "fit" and index + 1 < len(records):
                unfit = (record, report)  # the factory's fault, or this checkpoint's? The next one tells
                continue
            _record_drill(catalog, record, report, started=started, finished=now(), tier=report.tier)
            if report.outcome == "failed":
                report = _with_drift(catalog, record, report, now())
            reports.append(report)
            if report.ok or not report.judged or report.stage not in LOAD_STAGES:
                break  # not judged: the same cause would stop every older checkpoint of the job too
        if unfit is not None:  # no later checkpoint could tell (the rest changed since they were verified)
            first, first_report = unfit
            _record_drill(catalog, first, first_report, started=first_report.started_at,
                          finished=first_report.finished_at, tier=first_report.tier)
            reports.append(first_report)
    return reports


def _with_drift(catalog: Catalog, record: CheckpointRecord, report: DrillReport, at: datetime) -> DrillReport:
    """``report`` with its ``drift`` set (and a ``drill.drift`` event logged)
    when ``record`` passed an earlier drill under another stack."""
    from .drill_history import environment_drift

    found = [d for d in environment_drift(catalog.drills(job=record.job, limit=DRILL_HISTORY))
             if d.checkpoint_id == record.id]
    if not found:
        return report
    text = found[0].text()
    catalog.log_event("drill.drift", f"{record.job} {text}", now=at, job=record.job, checkpoint_id=record.id)
    return replace(report, drift=text)


def _recorded_losses(record: CheckpointRecord, cataloged: Sequence[CheckpointRecord], stores: StoreCache, *,
                     steps: int) -> Trajectory | None:
    """What the run recorded after ``record``'s step (a
    :class:`~ckptier.tasks.drill_trajectory.Trajectory`, or None), read from
    its store: the job's ``losses.jsonl`` and the format's own logs; a
    source that cannot be read is passed over."""
    from ckptier.storage.base import read_bytes
    from ckptier.storage.errors import StoreError

    from .drill_trajectory import recorded_trajectory

    def read(location: str) -> bytes | None:
        try:
            store, key = stores.locate(location)
            return read_bytes(store, key, limit=LOSS_LOG_LIMIT)
        except (StoreError, ValueError, OSError):
            return None

    return recorded_trajectory(record, cataloged, read, steps=steps)


#: The largest loss log a drill reads (a line per step of a long run is a few MB).
LOSS_LOG_LIMIT = 64 << 20


def _drill_checkpoint(record: CheckpointRecord, config: Config, stores: StoreCache, scratch: Path, *, started: datetime,
                      now: Clock, factory: str | None, steps: int, device: str, timeout: float, tolerance: float,
                      allow_globals: Sequence[str], world_size: int | None, fanout: Any = None,
                      trajectory: Expected | None = None) -> DrillReport:
    """The drill of ``record`` on as many ranks as saved it (or ``world_size``),
    as a report: ``stage`` ``fetch`` when its files could not be fetched,
    ``unsupported`` when its ranks cannot be drilled yet, ``not-started``
    when the model factory does not load in the workers."""
    from dataclasses import replace

    from .drill_launch import Fetched, UnsupportedDrill, run_ranked_drill

    def fetch(relpaths: Sequence[str], dest: Path) -> Fetched:
        wanted = set(relpaths)
        part = replace(record, files=tuple(f for f in record.files if f.relpath in wanted))
        got = fetch_record(part, config, dest=dest, stores=stores, fanout=fanout)
        return Fetched(got.tier, float(got.seconds), int(got.bytes))

    relpaths = [f.relpath for f in record.files]
    single = len(relpaths) == 1 and record.location.rstrip("/").rsplit("/", 1)[-1] == relpaths[0]
    try:
        check_layout(record)  # the ranks fetch parts of it: the whole must fit one tree
        drill = run_ranked_drill(record.format, relpaths, {f.relpath: f.size for f in record.files}, fetch=fetch,
                                 scratch=scratch, factory=factory, steps=steps, device=device, timeout=timeout,
                                 world_size=world_size, allow_globals=allow_globals, loss_tolerance=tolerance,
                                 single=single, step=record.step, trajectory=trajectory)
    except UnsupportedDrill as exc:
        return replace(_drill_failure(record, started, now(), stage="unsupported", error=str(exc)),
                       summary=f"{record.job} step {record.step}: not judged: {exc}",
                       checks=(Check("supported", False, str(exc)),))
    except ConfigError:
        raise
    except CkptierError as exc:  # a fetch failure is this candidate's verdict
        return _drill_failure(record, started, now(), stage="fetch", error=str(exc))
    finished = now()
    report = drill.report(job=record.job, step=record.step, device=device, started_at=started, finished_at=finished)
    if report.stage == "factory":  # the operator's factory does not load: says nothing about this checkpoint
        return _not_started(record, f"drill model {factory!r} does not load: {report.error}", started, finished)
    if not report.judged:  # the drill could not judge: say why, not "failed"
        why = drill_outcome(report.ok, report.stage)[1]
        detail = report.error or ""
        detail = detail.split(": ", 1)[1] if detail.startswith("rank ") and ": " in detail else detail
        report = replace(report, summary=f"{record.job} step {record.step}: not judged: {why}: {detail}")
    return report


def _check_allowed_classes(config: Config, jobs: Iterable[str], cli: Sequence[str], workdir: Path | None) -> None:
    """Refuse (ConfigError) any class allowed for these drills that is not a
    plain data class, before anything is fetched; the user's own modules are
    imported only in a confined, credential-free child process."""
    from .allowlist import check_allow_globals, refuse_unsafe

    where = {name: "--allow-global" for name in cli}
    for job_name in jobs:
        settings = config.drill_for(job_name)
        for name in settings.allow_globals if settings else ():
            where.setdefault(name, f"[[drill]] allow_globals (job {job_name!r}) entry")
    refuse_unsafe(check_allow_globals(where, workdir=workdir), where)


def nothing_to_drill(records: Sequence[CheckpointRecord], *, job: str | None, step: int | None,
                     known: bool) -> ConfigError:
    """Why no checkpoint can be drilled, as the one-line error ``run_drill`` raises (pure).

    ``records``: the live checkpoints considered; ``known``: whether the
    catalog has ever seen ``job`` (tombstones included)."""
    if job and not known:
        return unknown_job(job)
    if job and step is not None:
        record = next((c for c in records if c.job == job and c.step == step), None)
        if record is None:
            return ConfigError(f"job {job!r} step {step}: not in the catalog (or deleted); see 'ckptier ls --job {job}' "
                               "for the steps there are, or leave --step out for the newest verified one")
        if record.state == State.CORRUPT:
            why = f" ({record.state_reason})" if record.state_reason else ""
            return ConfigError(f"job {job!r} step {step} is corrupt{why}: drills never restore a corrupt checkpoint; "
                               "drill another step, or leave --step out for the newest verified one")
        if record.state == State.INCOMPLETE:
            return ConfigError(f"job {job!r} step {step} is incomplete (a save in flight, or torn): nothing to restore "
                               "yet; drill another step, or scan again once the save has finished")
    what = f"job {job!r}" + (f" step {step}" if step is not None else "") if job else "any job"
    return ConfigError(f"no verified or committed checkpoint of {what} to drill; run 'ckptier scan' and 'ckptier verify' first")


def _not_started(record: CheckpointRecord, why: str, started: datetime, finished: datetime) -> DrillReport:
    """The report of a drill that did not start for a reason that is not the checkpoint's (never recorded)."""
    return DrillReport(job=record.job, step=record.step, ok=False, stage="not-started", error=why,
                       summary=f"{record.job} step {record.step}: drill not started: {why}", recorded=False,
                       checks=(Check("started", False, why),), started_at=started, finished_at=finished)


def _drill_failure(record: CheckpointRecord, started: datetime, finished: datetime, *, stage: str, error: str) -> DrillReport:
    """The report of a drill that failed at ``stage`` before any worker ran (a fetch, say)."""
    return DrillReport(job=record.job, step=record.step, ok=False, stage=stage, error=error,
                       summary=f"{record.job} step {record.step}: drill failed at {stage}: {error}",
                       checks=(Check("completed", False, f"{stage}: {error}"),), started_at=started,
                       finished_at=finished)


def _record_drill(catalog: Catalog, record: CheckpointRecord, report: DrillReport, *, started: datetime,
                  finished: datetime, tier: str | None) -> None:
    from ckptier.storage.catalog.api import DrillRecord

    catalog.record_drill(DrillRecord(
        job=record.job, step=record.step, checkpoint_id=record.id, started_at=started, finished_at=finished,
        ok=report.ok, device=report.device, source_tier=tier, verdict=report.verdict_json(),
        timings=dict(report.timings), peak_memory_bytes=report.peak_memory_bytes, error=report.error,
        outcome=report.outcome, stack=dict(report.stack),
    ))
    kind = {"passed": "drill.ok", "failed": "drill.failed"}.get(report.outcome, "drill.not_judged")
    catalog.log_event(kind, report.summary, now=finished, job=record.job, checkpoint_id=record.id)


# ------------------------------------------------------------------ forget


def run_forget(run: Run, *, job: str, older_than: timedelta | None = None) -> ForgetReport:
    """Tombstone ``job``'s rows that a scan found missing and storage confirms gone from every tier.

    Candidates: live rows with ``missing_since`` set (saved more than
    ``older_than`` ago, when given). Each is looked up in storage now (hot
    location, every archive copy the catalog records, the archive tier of
    the job's policy); only a row with nothing left anywhere is tombstoned
    (:meth:`Catalog.forget`, which a concurrent rescan or lease wins
    against). Rows still present somewhere, or whose tiers could not be
    checked, are kept and reported. ``run.dry_run`` looks but writes nothing.
    Idempotent. Returns a :class:`~ckptier.tasks.reports.ForgetReport`:
    ``rows`` (:class:`~ckptier.tasks.reports.ForgetRow`: job, step,
    outcome, detail), ``lines``, and counts ``forgotten``, ``kept``,
    ``unchecked``.
    """
    catalog, config, stores, now, dry_run = run.catalog, run.config, run.stores, run.now, run.dry_run
    records = catalog.checkpoints(job=job)
    if not records and not catalog.checkpoints(job=job, include_deleted=True):
        raise unknown_job(job)
    policy = config.policy_for(job)
    rows: list[ForgetRow] = []
    for c in forget_candidates(records, now=now(), older_than=older_than):
        archives = []
        for url in archive_places(c):
            store = stores.store(archive_root(url, c))
            archives.append((store, prefix_from_location(store, url)))
        if policy is not None and policy.archive:
            store = stores.store(policy.archive)
            if all(s.url != store.url for s, _ in archives):
                archives.append((store, archive_dir(c.job, c.step)))
        found = still_stored(c, hot=stores.for_record, archives=archives)
        assert c.missing_since is not None  # forget_candidates chose these
        outcome: ForgetOutcome
        if found.present:
            outcome, detail = "kept", "still stored at " + ", ".join(found.present) + "; rescan it"
        elif found.unknown:
            outcome, detail = "unchecked", "could not check " + "; ".join(found.unknown)
        elif dry_run:
            outcome, detail = "would forget", "gone from every tier"
        else:
            reason = (f"forgotten: missing from hot storage since {c.missing_since.isoformat()} and confirmed "
                      f"gone from every tier at {now().isoformat()}")
            done = catalog.forget(c.id, missing_since=c.missing_since, now=now(), reason=reason)
            outcome, detail = ("forgotten", "gone from every tier") if done else (
                "kept", "changed meanwhile (a scan saw it again, or a run holds it); run forget again")
        rows.append(ForgetRow(job=c.job, step=c.step, outcome=outcome, detail=detail))
    counts = {k: sum(r.outcome == k for r in rows) for k in ("forgotten", "would forget", "kept", "unchecked")}
    lines = [f"{r.job} step {r.step}: {r.outcome}: {r.detail}" for r in rows]
    lines.append(
        f"job {job}: {counts['would forget'] if dry_run else counts['forgotten']} "
        f"{'would be ' if dry_run else ''}forgotten, {counts['kept']} still stored, {counts['unchecked']} not checked"
        + ("" if rows else " (no checkpoint is missing from hot storage)")
    )
    return ForgetReport(job=job, dry_run=dry_run, rows=tuple(rows), lines=tuple(lines), forgotten=counts["forgotten"],
                        kept=counts["kept"], unchecked=counts["unchecked"])
