"""Thin Prefect tasks over :mod:`ckptier.tasks.pipeline`.

Each task logs, opens the catalog, makes one call and returns a JSON-ready
report. Retries happen only for transient storage errors
(:func:`ckptier.storage.errors.is_transient`); everything else fails at once.
Kept apart from the pure cores so that read-only commands never import
Prefect.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefect import task
from prefect.logging import get_run_logger

from ckptier.storage.catalog.api import Catalog
from ckptier.storage.errors import is_transient

from . import pipeline
from .config import load_config
from .reports import verification_by_job
from .retention import render_plan_table
from .settings import catalog_url as resolve_catalog_url
from .settings import require_written_policy


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry only what may succeed next time."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - we classify, not handle
        return is_transient(exc)
    return False


@task(name="scan", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_if_transient)
def scan_task(url: str, catalog_url: str | None, config_path: str | None = None) -> dict[str, Any]:
    """List one URL and bring the catalog in line with it (creating the catalog on first use),
    with the config's ``[[pattern]]`` rules and each job's grace."""
    log = get_run_logger()
    config = load_config(config_path)
    with Catalog.open(resolve_catalog_url(catalog_url, config_path, config=config)) as cat:
        (report,) = pipeline.run_scan([url], cat, now=pipeline.utcnow, patterns=config.patterns, config=config)
    log.info("%s: %d objects, %d checkpoints, %d catalog rows written",
             report["url"], report["objects"], report["checkpoints"], report["rows_written"])
    return report


@task(name="verify", retries=1, retry_delay_seconds=30, retry_condition_fn=retry_if_transient)
def verify_task(catalog_url: str | None, job: str | None, deep: bool, sample: tuple[int, int] | None,
                workers: int, config_path: str | None = None) -> dict[str, Any]:
    """Verify what needs it (or the sample) and record the results; ``by_job`` adds the totals per job.

    The ``verify-progress`` artifact reaches 100% when the run ends, also
    when there was nothing to verify."""
    log = get_run_logger()
    progress = ProgressArtifact("verify-progress", "bytes verified so far")
    with Catalog.open(resolve_catalog_url(catalog_url, config_path), create=False) as cat:
        report = pipeline.run_verify(cat, now=pipeline.utcnow, job=job, deep=deep, sample=sample, workers=workers,
                                     progress=progress)
    progress.finish()
    report["by_job"] = [asdict(j) for j in verification_by_job(report["checkpoints"])]
    t = report["totals"]
    log.info("%d checked: %d verified, %d corrupt, %d with errors; %d bytes read, %d skipped",
             t["checked"], t["verified"], t["corrupt"], t["errors"], t["bytes_read"], t["bytes_skipped"])
    return report


class ProgressArtifact:
    """A progress callback ``(done, total)`` that updates a Prefect progress artifact (at most every 2%).

    The artifact is created here, in the task's own thread, so it belongs to
    the run; calls (from verify's reader threads, serialized) only update it
    by id. :meth:`finish` sets 100% at the end of the work, however much
    there was (a run with nothing to verify is done, not stuck at 0%).
    """

    def __init__(self, key: str, description: str) -> None:
        from prefect.artifacts import create_progress_artifact

        # Called from a sync task: the id itself, never the coroutine of the async variant.
        self.artifact_id: Any = create_progress_artifact(0.0, key=key, description=description)
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        pct = 100.0 if not total else min(100.0, 100.0 * done / total)
        if pct - self.last >= 2.0 or (pct == 100.0 and self.last < 100.0):
            self._set(pct)

    def finish(self) -> None:
        if self.last < 100.0:
            self._set(100.0)

    def _set(self, pct: float) -> None:
        from prefect.artifacts import update_progress_artifact

        update_progress_artifact(self.artifact_id, pct)
        self.last = pct


@task(name="plan-retention")
def plan_task(catalog_url: str | None, config_path: str | None, job: str | None) -> dict[str, Any]:
    """The retention plan: ``rows`` (job, step, action, scope, reasons, bytes) and ``forecast``,
    the hot bytes carrying it out frees (:class:`ckptier.tasks.reports.FreedForecast`)."""
    config = load_config(config_path)
    now = pipeline.utcnow()
    with Catalog.open(resolve_catalog_url(catalog_url, config_path, config=config), create=False) as cat:
        plan, forecast = pipeline.plan_with_forecast(cat, config, job=job, now=now)
    return {"rows": render_plan_table(plan), "forecast": {**asdict(forecast), "freed_bytes": forecast.freed_bytes}}


@task(name="catalog-summary")
def catalog_summary_task(catalog_url: str | None, config_path: str | None = None) -> list[dict[str, Any]]:
    """Every job of the catalog: checkpoints by state, bytes per tier (:class:`ckptier.tasks.reports.JobSummary`)."""
    with Catalog.open(resolve_catalog_url(catalog_url, config_path), create=False) as cat:
        return [asdict(j) for j in pipeline.catalog_summary(cat)]


@task(name="apply-retention", retries=1, retry_delay_seconds=60, retry_condition_fn=retry_if_transient)
def apply_task(catalog_url: str | None, config_path: str | None, job: str | None, dry_run: bool) -> dict[str, Any]:
    """Promote milestones, then delete what the policy lets go (fenced, batched; short leases kept alive by a heartbeat)."""
    log = get_run_logger()
    config = load_config(config_path)
    with Catalog.open(resolve_catalog_url(catalog_url, config_path, config=config), create=False) as cat:
        if not dry_run:
            require_written_policy(config, [job] if job else cat.jobs(), config_path)
        report = pipeline.run_apply(cat, config, now=pipeline.utcnow, owner=pipeline.run_owner(), job=job, dry_run=dry_run)
    for line in report["lines"]:
        log.info(line)
    return report


@task(name="drill")
def drill_task(catalog_url: str | None, config_path: str | None, job: str | None, step: int | None,
               steps: int | None, device: str | None, model: str | None, timeout_seconds: float | None,
               allow_globals: list[str] | None = None) -> list[dict[str, Any]]:
    """Fetch, safely load, train K steps, judge and record (see ``pipeline.run_drill``)."""
    log = get_run_logger()
    config = load_config(config_path)
    with Catalog.open(resolve_catalog_url(catalog_url, config_path, config=config), create=False) as cat:
        reports = pipeline.run_drill(cat, config, now=pipeline.utcnow, job=job, step=step, steps=steps, device=device,
                                     model=model, timeout=timeout_seconds, allow_globals=allow_globals or ())
    for r in reports:
        (log.info if r["ok"] else log.error)(r["summary"])
    return reports
