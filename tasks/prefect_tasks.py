"""Thin Prefect tasks over :mod:`ckptier.tasks.pipeline`.

Each task is handed the flow run's :class:`~ckptier.tasks.run.Run` (the
catalog opened and the config read once per flow run, by the flow), logs,
makes one call and returns the operation's typed report (the flows make
artifacts from it); none is cached (``NO_CACHE``: they act, and a run is
no input to hash). Retries happen only for transient storage errors
(:func:`ckptier.storage.errors.is_transient`); everything else fails at once.
Kept apart from the pure cores so that read-only commands never import
Prefect.

Every task run is named after what it acts on (``verify llama-7b@12000``,
``drill demo-run@50``, ``fetch demo-run@50 (2 files)``, ``scan s3://b/p``:
:func:`run_name`), and the drill task's state is its verdict
(:func:`drill_state`): Completed when every drill passed, Failed with the
failed drill's summary otherwise, and a Failed state named ``Not judged``
when no drill failed but one could not judge its checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.logging import get_run_logger
from prefect.client.schemas.objects import State
from prefect.states import Completed, Failed
from prefect.task_runners import ThreadPoolTaskRunner

from ckptier.storage.errors import ConfigError, is_transient

from . import pipeline
from .archive import FetchBatch, PromoteWork, fetch_work, promote_work
from .config import RunnerSettings
from .fanout import default_workers, runner_settings, settle
from .reports import ApplyRunReport, DrillReport, VerifyReport, verification_by_job
from .retention import render_plan_table
from .run import Run, row_claims
from .scan import ScanReport
from .settings import require_written_policy
from .verify import VerifyWork, verify_work


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry only what may succeed next time."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - we classify, not handle
        return is_transient(exc)
    return False


def checkpoint_label(job: str, step: int | None) -> str:
    """``llama-7b@12000``: how a task run names a checkpoint (``@newest`` without a step)."""
    return f"{job}@{'newest' if step is None else step}"


def _several(labels: Sequence[str]) -> str:
    """``a@1``, ``a@1, b@2``, or ``a@1 and 4 more``."""
    if len(labels) <= 2:
        return ", ".join(labels) or "nothing"
    return f"{labels[0]} and {len(labels) - 1} more"


def run_name(verb: str, parameters: Mapping[str, Any]) -> str:
    """The name of a ``verb`` task run from its parameters: the checkpoints, job or URL it acts on. Pure."""
    work = parameters.get("work")
    if isinstance(work, VerifyWork):
        return f"{verb} {_several([checkpoint_label(r.job, r.step) for r in work.records])}"
    if isinstance(work, PromoteWork):
        return f"{verb} {checkpoint_label(work.record.job, work.record.step)}"
    if isinstance(work, FetchBatch):
        files = f"{len(work.files)} file{'s' if len(work.files) != 1 else ''}"
        return f"{verb} {work.label} ({files})" if work.label else f"{verb} {files} from {work.store_url}"
    if "url" in parameters:
        return f"{verb} {parameters['url']}"
    options = parameters.get("options")
    job = getattr(options, "job", None) if options is not None else parameters.get("job")
    if job is None:
        return f"{verb} every job"
    step = getattr(options, "step", None)
    return f"{verb} {checkpoint_label(job, step) if verb == 'drill' else job}"


def _named(verb: str) -> Any:
    """A ``task_run_name`` callable: :func:`run_name` of ``verb`` (Prefect passes the parameters
    to a callable with a ``parameters`` argument; typed Any: Prefect's protocol for it also
    demands a classmethod no function has)."""
    def name(parameters: dict[str, Any]) -> str:
        return run_name(verb, parameters)

    return name


@task(name="scan", task_run_name=_named("scan"), retries=2, retry_delay_seconds=10, retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE)
def scan_task(run: Run, url: str, inventory: str | None = None, full: bool = False) -> ScanReport:
    """List one URL and bring ``run``'s catalog in line with it, with the config's ``[[pattern]]``
    rules and each job's grace; from an S3 Inventory report instead (``inventory``, else the
    config's ``[[inventory]]``). Returns the URL's :class:`ScanReport`."""
    log = get_run_logger()
    (report,) = pipeline.run_scan(run, [url], inventories=[(url, inventory)] if inventory else (), full=full)
    log.info("%s: %d objects, %d checkpoints, %d catalog rows written",
             report.url, report.objects, report.checkpoints, report.rows_written)
    return report


@task(name="verify", task_run_name=_named("verify"), retries=1, retry_delay_seconds=30, retry_condition_fn=retry_if_transient, cache_policy=NO_CACHE)
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
verify_work_task = task(name="verify-checkpoints", task_run_name=_named("verify"), retries=2, retry_delay_seconds=5,
                        retry_condition_fn=retry_if_transient)(verify_work)
promote_work_task = task(name="promote-checkpoint", task_run_name=_named("promote"), retries=2,
                         retry_delay_seconds=10, retry_condition_fn=retry_if_transient)(promote_work)
fetch_work_task = task(name="fetch-files", task_run_name=_named("fetch"), retries=2, retry_delay_seconds=5,
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


@task(name="plan-retention", task_run_name=_named("plan"), cache_policy=NO_CACHE)
def plan_task(run: Run, job: str | None) -> dict[str, Any]:
    """The retention plan: ``rows`` (job, step, action, scope, reasons, bytes) and ``forecast``,
    the hot bytes carrying it out frees (:class:`ckptier.tasks.reports.FreedForecast`)."""
    plan, forecast = pipeline.plan_with_forecast(run, job=job)
    return {"rows": render_plan_table(plan), "forecast": {**asdict(forecast), "freed_bytes": forecast.freed_bytes}}


@task(name="catalog-summary", task_run_name="catalog summary", cache_policy=NO_CACHE)
def catalog_summary_task(run: Run) -> list[dict[str, Any]]:
    """Every job of the catalog: checkpoints by state, bytes per tier (:class:`ckptier.tasks.reports.JobSummary`)."""
    return [asdict(j) for j in pipeline.catalog_summary(run)]


@task(name="apply-retention", task_run_name=_named("apply"), retries=1, retry_delay_seconds=60, retry_condition_fn=retry_if_transient,
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


def drill_state(reports: Sequence[DrillReport]) -> State:
    """The drill task run's final state, its verdict over ``reports`` (carried as its data). Pure.

    Completed (message: the summaries) when every drill passed; Failed with the
    failed drills' summaries when any failed; otherwise, when one could not judge
    its checkpoint (the factory does not fit, ranks not supported, ...), a Failed
    state named ``Not judged``: nothing was proven, and the flow run fails too, so
    a green task inside a red run would mislead."""
    failed = [r for r in reports if not r.ok and r.judged]
    unjudged = [r for r in reports if not r.judged]
    if failed:
        return Failed(message="; ".join(r.summary for r in failed + unjudged), data=list(reports))
    if unjudged:
        return Failed(name="Not judged", message="; ".join(r.summary for r in unjudged), data=list(reports))
    return Completed(message="; ".join(r.summary for r in reports), data=list(reports))


@task(name="drill", task_run_name=_named("drill"), cache_policy=NO_CACHE)
def drill_task(run: Run, options: pipeline.DrillOptions, runner: str | None = None) -> State:
    """Fetch, safely load, train K steps, judge and record (see ``pipeline.run_drill``); the task
    run ends in :func:`drill_state` of the reports (one per drill), which its result holds:
    call it with ``return_state=True`` and read ``state.result(raise_on_failure=False)``.

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
    return drill_state(reports)
