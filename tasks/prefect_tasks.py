"""Thin Prefect tasks over :mod:`ckptier.tasks.pipeline`.

Each task is handed the flow run's :class:`~ckptier.tasks.run.Run` (the
catalog opened and the config read once per flow run, by the flow), logs,
makes one call and returns the operation's typed report (the flows make
artifacts from it); none is cached (``NO_CACHE``: they act, and a run is
no input to hash). Retries happen only for transient storage errors
(:func:`ckptier.storage.errors.is_transient`); everything else fails at once.
Kept apart from the pure cores so that read-only commands never import
Prefect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, replace
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from ckptier.storage.errors import ConfigError, is_transient

from . import pipeline
from .archive import fetch_work, promote_work
from .config import RunnerSettings
from .fanout import default_workers, runner_settings, settle
from .reports import ApplyRunReport, DrillReport, VerifyReport, verification_by_job
from .retention import render_plan_table
from .run import Run, row_claims
from .scan import ScanReport
from .settings import require_written_policy
from .verify import verify_work


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry only what may succeed next time."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - we classify, not handle
        return is_transient(exc)
    return False


@task(name="scan", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE)
def scan_task(run: Run, url: str, inventory: str | None = None, full: bool = False) -> ScanReport:
    """List one URL and bring ``run``'s catalog in line with it, with the config's ``[[pattern]]``
    rules and each job's grace; from an S3 Inventory report instead (``inventory``, else the
    config's ``[[inventory]]``). Returns the URL's :class:`ScanReport`."""
    log = get_run_logger()
    (report,) = pipeline.run_scan(run, [url], inventories=[(url, inventory)] if inventory else (), full=full)
    log.info("%s: %d objects, %d checkpoints, %d catalog rows written",
             report.url, report.objects, report.checkpoints, report.rows_written)
    return report


@task(name="verify", retries=1, retry_delay_seconds=30, retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE)
def verify_task(run: Run, options: pipeline.VerifyOptions, runner: str | None = None,
                sweep_since: str | None = None) -> VerifyReport:
    """Verify what needs it (or the sample) and record the results; the :class:`VerifyReport`
    of ``pipeline.run_verify`` with ``by_job``, the totals per job, filled in.

    The checkpoints are read by ``verify-checkpoints`` task runs, a batch of
    checkpoints each, on the task runner ``[runner]`` names (``runner``,
    ``threads`` or ``dask``, overrides its kind); this task records every
    result. With ``[runner] claim_rows`` the rows are claimed under leases
    (``options.claims`` is set from it), shared with the other runs of the
    sweep that began at ``sweep_since`` (ISO 8601; default: this run's
    start). The ``verify-progress`` artifact reaches 100% when the run
    ends, also when there was nothing to verify."""
    log = get_run_logger()
    settings = runner_settings(run.config.runner, runner)
    progress = ProgressArtifact("verify-progress", "bytes verified so far")
    options = replace(options, claims=row_claims(settings, sweep_since, owner=run.owner))
    fanout = PrefectFanout(settings, workers=options.workers)
    try:
        report = pipeline.run_verify(run, options, progress=progress, fanout=fanout)
    finally:
        fanout.close()
    progress.finish()
    report = replace(report, by_job=tuple(verification_by_job(report.checkpoints)))
    t = report.totals
    log.info("%d checked: %d verified, %d corrupt, %d with errors; %d bytes read, %d skipped",
             t.checked, t.verified, t.corrupt, t.errors, t.bytes_read, t.bytes_skipped)
    return report


#: The operations' fan-out work functions as Prefect tasks; a failure retries only when transient.
verify_work_task = task(name="verify-checkpoints", retries=2, retry_delay_seconds=5,
                        retry_condition_fn=retry_if_transient)(verify_work)
promote_work_task = task(name="promote-checkpoint", retries=2, retry_delay_seconds=10,
                         retry_condition_fn=retry_if_transient)(promote_work)
fetch_work_task = task(name="fetch-files", retries=2, retry_delay_seconds=5,
                       retry_condition_fn=retry_if_transient)(fetch_work)
WORK_TASKS: dict[Callable[..., Any], Any] = {verify_work: verify_work_task, promote_work: promote_work_task,
                                              fetch_work: fetch_work_task}


class PrefectFanout:
    """A :class:`ckptier.tasks.fanout.Fanout` whose items are Prefect task runs
    (:data:`WORK_TASKS`) on a task runner: ``prefect_dask.DaskTaskRunner`` for
    ``[runner] kind = "dask"`` (the cluster at ``address``, else a local one of
    ``workers`` processes on 127.0.0.1), ``ThreadPoolTaskRunner`` of ``workers``
    threads otherwise. Started on creation, stopped by :meth:`close`."""

    def __init__(self, settings: RunnerSettings, *, workers: int = 4) -> None:
        self._settings, self._workers = settings, workers
        self._runner: Any = None
        if settings.kind == "dask":
            self.name = "prefect-dask"
            self.parallelism = settings.workers or (4 if settings.address else default_workers())
            try:
                import prefect_dask  # noqa: F401 - optional (ckptier[dask]): checked before anything runs
            except ImportError:
                raise ConfigError("runner kind 'dask' needs prefect-dask: pip install 'ckptier[dask]' "
                                  "(or use kind = \"threads\")") from None
        else:
            self.name, self.parallelism = "prefect-threads", workers

    def _start(self) -> Any:
        """The task runner, started on first use (a run with nothing to do starts no cluster)."""
        if self._runner is not None:
            return self._runner
        settings, workers = self._settings, self._workers
        runner: Any
        if settings.kind == "dask":
            try:
                from prefect_dask.task_runners import DaskTaskRunner  # optional: ckptier[dask]
            except ImportError:
                raise ConfigError("runner kind 'dask' needs prefect-dask: pip install 'ckptier[dask]' "
                                  "(or use kind = \"threads\")") from None
            if settings.address is not None:
                runner = DaskTaskRunner(address=settings.address)
            else:
                runner = DaskTaskRunner(cluster_kwargs={"n_workers": self.parallelism, "threads_per_worker": 1,
                                                        "processes": True, "host": "127.0.0.1",
                                                        "dashboard_address": None})
        else:
            runner = ThreadPoolTaskRunner(max_workers=workers)
        self._runner = runner.__enter__()
        return self._runner

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any], *, errors: bool = False) -> Iterator[Any]:
        work = WORK_TASKS[fn]
        runner = self._start()
        futures = [runner.submit(work, {"work": item}) for item in items]
        for f in futures:
            yield settle(f.result, errors)

    def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.__exit__(None, None, None)


class ProgressArtifact:
    """A progress callback ``(done, total)`` that updates a Prefect progress artifact (at most every 2%).

    The artifact is created here, in the task's own thread, so it belongs to
    the run; calls (from verify's reader threads, serialized) only update it
    by id. :meth:`finish` sets 100% at the end of the work, however much
    there was (a run with nothing to verify is done, not stuck at 0%).
    """

    def __init__(self, key: str, description: str) -> None:
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
        update_progress_artifact(self.artifact_id, pct)
        self.last = pct


@task(name="plan-retention", cache_policy=NO_CACHE)
def plan_task(run: Run, job: str | None) -> dict[str, Any]:
    """The retention plan: ``rows`` (job, step, action, scope, reasons, bytes) and ``forecast``,
    the hot bytes carrying it out frees (:class:`ckptier.tasks.reports.FreedForecast`)."""
    plan, forecast = pipeline.plan_with_forecast(run, job=job)
    return {"rows": render_plan_table(plan), "forecast": {**asdict(forecast), "freed_bytes": forecast.freed_bytes}}


@task(name="catalog-summary", cache_policy=NO_CACHE)
def catalog_summary_task(run: Run) -> list[dict[str, Any]]:
    """Every job of the catalog: checkpoints by state, bytes per tier (:class:`ckptier.tasks.reports.JobSummary`)."""
    return [asdict(j) for j in pipeline.catalog_summary(run)]


@task(name="apply-retention", retries=1, retry_delay_seconds=60, retry_condition_fn=retry_if_transient,
      cache_policy=NO_CACHE)
def apply_task(run: Run, job: str | None, runner: str | None = None) -> ApplyRunReport:
    """Promote milestones, then delete what the policy lets go (fenced, batched; short leases kept alive by a heartbeat);
    a dry run (``run.dry_run``) says what it would do.

    The archive copies are made by ``promote-checkpoint`` task runs, several
    at once, on the task runner ``[runner]`` names (``runner`` overrides its
    kind); this task claims, checks and records each. Deletes only under a
    ``[[policy]]`` someone wrote (:func:`ckptier.tasks.settings.require_written_policy`)."""
    log = get_run_logger()
    if not run.dry_run:
        require_written_policy(run.config, [job] if job else run.catalog.jobs())
    fanout = PrefectFanout(runner_settings(run.config.runner, runner))
    try:
        report = pipeline.run_apply(run, pipeline.ApplyOptions(job=job), fanout=fanout)
    finally:
        fanout.close()
    for line in report.lines:
        log.info(line)
    return report


@task(name="drill", cache_policy=NO_CACHE)
def drill_task(run: Run, options: pipeline.DrillOptions, runner: str | None = None) -> list[DrillReport]:
    """Fetch, safely load, train K steps, judge and record (see ``pipeline.run_drill``); one report per drill.

    The checkpoint's files are fetched by ``fetch-files`` task runs, a batch
    of files each, on the task runner ``[runner]`` names (``runner``
    overrides its kind); this task stages, renames and drills them."""
    log = get_run_logger()
    fanout = PrefectFanout(runner_settings(run.config.runner, runner))
    try:
        reports = pipeline.run_drill(run, options, fanout=fanout)
    finally:
        fanout.close()
    for r in reports:
        (log.info if r.ok else log.error)(r.summary)
    return reports
