"""Run an operation directly, or as a Prefect flow run when an API is configured.

Starting Prefect's temporary local API costs about 10 s per process, so the
command line runs the task code directly unless a Prefect API is configured;
then it goes through the operation's flow so the run shows in the UI
(docs/architecture.md). :func:`dispatch` is the one place that chooses, and
both paths return the operation's own report: a flow run that fails because
of what it found (corruption, a failed drill) still hands back the report it
built (:class:`FailedWithReport`), never a different one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ckptier.storage.errors import CkptierError, ConfigError
from ckptier.tasks.prefect_api import check_prefect_api

from .output import Progress

if TYPE_CHECKING:
    from ckptier.tasks.fanout import Fanout
    from ckptier.tasks.pipeline import DrillOptions, VerifyOptions
    from ckptier.tasks.reports import ApplyRunReport, DrillReport, FetchReport, JanitorRunReport, VerifyReport
    from ckptier.tasks.run import RowClaims, Run
    from ckptier.tasks.scan import ScanReport
    from ckptier.tasks.settings import Settings

R = TypeVar("R")

#: A flow's ``runner`` parameter, a select in the Prefect UI: ``config`` is the ``[runner] kind`` of ckptier.toml.
RunnerChoice = Literal["config", "threads", "dask"]


def runner_kind(choice: str | None) -> str | None:
    """The ``runner`` the tasks take from a flow's :data:`RunnerChoice` (None: the config's ``[runner] kind``)."""
    return None if choice in (None, "config") else choice


class FlowFailed(CkptierError):
    """A Prefect flow run did not complete."""


class FailedWithReport(CkptierError):
    """A flow run failed because of what its operation found, after building
    its report; ``report`` is what the run would have returned (None: none).

    Pickles with its report (Prefect may store a failed run's exception)."""

    def __init__(self, message: str, *, report: Any = None) -> None:
        super().__init__(message)
        self.report = report


def run_flow(flow: Any, **params: Any) -> Any:
    """Call a Prefect flow and unwrap its result. A run that failed with a
    :class:`FailedWithReport` returns that report; any other failed run
    raises a one-line error."""
    check_prefect_api()
    state = flow(**params, return_state=True)
    if state.is_completed():
        return state.result()
    try:
        state.result()
    except FailedWithReport as exc:
        if exc.report is not None:
            return exc.report
        raise
    except CkptierError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported as one line
        raise FlowFailed(f"flow run {flow.name!r} ended {state.name}: {exc}") from exc
    raise FlowFailed(f"flow run {flow.name!r} ended {state.name}")


def dispatch(use_prefect: bool, direct: Callable[[], R], *, flow: str, params: Mapping[str, Any],
             unwrap: Callable[[Any], R] | None = None) -> R:
    """The operation's report: ``direct()`` in this process, or, with
    ``use_prefect``, the result of a run of ``flow`` (``"module:function"``
    under :mod:`ckptier.flows`) called with ``params`` (None values left
    out, so the flow's own defaults apply), passed through ``unwrap`` when
    the flow returns more than the operation's report."""
    if not use_prefect:
        return direct()
    module, _, name = flow.partition(":")
    flow_object = getattr(importlib.import_module(f"ckptier.flows.{module}"), name)
    result = run_flow(flow_object, **{k: v for k, v in params.items() if v is not None})
    return unwrap(result) if unwrap is not None else result


def resolve_sample(sample: str | None, now: datetime | None = None) -> tuple[int, int] | None:
    """``"K/N"`` → (K, N); ``"auto/N"`` → the slice of N for ``now``'s UTC date
    (every byte re-read every N nights); None → None. One-line
    :class:`ConfigError` otherwise."""
    from ckptier.tasks.verify import parse_sample, rotating_slice  # lazy: the command line checks its input before the operations load

    if not sample:
        return None
    head, sep, tail = sample.strip().partition("/")
    if sep and head.strip().lower() == "auto":
        if not tail.strip().isdigit() or int(tail) < 1:
            raise ConfigError(f"--sample {sample!r}: N must be a whole number ≥ 1, e.g. auto/7")
        n = int(tail)
        return rotating_slice((now or datetime.now(UTC)).date(), n), n
    return parse_sample(sample)


def _flow_settings(settings: Settings) -> dict[str, Any]:
    """The flow parameters that name a run's settings: the catalog chosen here and the config file."""
    config_path = settings.config_path
    return {"catalog_url": settings.location.url, "config_path": str(config_path) if config_path else None}


def scan(urls: list[str], *, settings: Settings, use_prefect: bool, progress: bool = True,
         inventory: str | None = None, full: bool = False) -> list[ScanReport]:
    """Scan each URL (``pipeline.run_scan``); one :class:`ScanReport` per URL on both paths."""
    from ckptier.storage.catalog.db import refuse_in_memory  # lazy: as the operations below

    refuse_in_memory(settings.location.url)  # before a flow run starts: open_run refuses it there too
    if inventory is not None and len(urls) != 1:
        raise ConfigError(f"--inventory {inventory} names the report of one bucket; scan one s3:// URL with it, "
                          f"not {len(urls)}")

    def direct() -> list[ScanReport]:
        from ckptier.tasks.pipeline import run_scan  # lazy: the command line checks its input before the operations load
        from ckptier.tasks.run import open_run  # lazy: likewise

        bar = Progress("listing", unit="objects", enabled=None if progress else False)
        try:
            with open_run(settings, create=True) as run:
                return run_scan(run, urls, tick=bar.update, inventories=[(urls[0], inventory)] if inventory else (),
                                full=full)
        finally:
            bar.close()

    return dispatch(use_prefect, direct, flow="scan_verify:scan_flow",
                    params={"urls": urls, **_flow_settings(settings), "inventory": inventory, "full": full or None})


def verify(options: VerifyOptions, *, settings: Settings, use_prefect: bool, progress: bool = True,
           runner: str | None = None, claim_rows: bool = False, since: str | None = None) -> VerifyReport:
    """Verify (``pipeline.run_verify``); the :class:`VerifyReport` on both paths (a flow run
    that found corruption hands back its report, ``by_job`` filled in). ``runner``,
    ``claim_rows`` and ``since`` are the command line's ``--runner``, ``--claim-rows``
    and ``--since`` (``options.claims`` is made from them and ``[runner]``)."""
    def direct() -> VerifyReport:
        from ckptier.tasks.verify_run import run_verify  # lazy: the command line checks its input before the operations load
        from ckptier.tasks.run import open_run  # lazy: likewise

        with open_run(settings, owner="ckptier-cli") as run:  # each job's grace comes from its [[policy]]
            fanout, claims = _fanout(run, runner, claim_rows, since)
            bar = Progress("verifying", unit="bytes", enabled=None if progress else False)
            try:
                return run_verify(run, replace(options, claims=claims), progress=bar.update, fanout=fanout)
            finally:
                bar.close()
                if fanout is not None:
                    fanout.close()

    sample = options.sample
    return dispatch(use_prefect, direct, flow="scan_verify:verify_flow",
                    params={"job": options.job, "deep": options.deep,
                            "sample": f"{sample[0]}/{sample[1]}" if sample else None, "workers": options.workers,
                            **_flow_settings(settings), "runner": runner, "sweep_since": since})


def _fanout(run: Run, runner: str | None, claim_rows: bool = False, since: str | None = None
            ) -> tuple[Fanout | None, RowClaims | None]:
    """The Dask executor (None: threads here) and the row claims (leased as ``run.owner``) for a
    direct run, from ``run.config``'s ``[runner]`` and the command line (``--runner``,
    ``--claim-rows``, ``--since``)."""
    from ckptier.tasks.fanout import open_fanout, runner_settings  # lazy: the command line checks its input before the operations load
    from ckptier.tasks.run import row_claims  # lazy: likewise

    settings = runner_settings(run.config.runner, runner)
    if claim_rows:
        settings = replace(settings, claim_rows=True)
    claims = row_claims(settings, since, owner=run.owner)
    return open_fanout(settings), claims


def apply(*, job: str | None, dry_run: bool, settings: Settings, use_prefect: bool,
          runner: str | None = None) -> ApplyRunReport:
    """Retention carried out (``pipeline.run_apply``), or previewed with ``dry_run``; the Prefect
    path runs the tiering flow and hands back its apply report (failed items included).
    Deletes only under a ``[[policy]]`` someone wrote (checked before anything is done)."""
    from ckptier.tasks.settings import require_written_policy  # lazy: the command line checks its input before the operations load

    def direct() -> ApplyRunReport:
        from ckptier.tasks.pipeline import ApplyOptions, run_apply  # lazy: likewise
        from ckptier.tasks.run import open_run  # lazy: likewise

        with open_run(settings, owner="ckptier-cli", dry_run=dry_run) as run:
            if not dry_run:  # a dry run may preview the default policy
                require_written_policy(run.config, [job] if job else run.catalog.jobs(), settings.config_path)
            fanout, _ = _fanout(run, runner)
            try:
                return run_apply(run, ApplyOptions(job=job), fanout=fanout)
            finally:
                if fanout is not None:
                    fanout.close()

    if use_prefect and not dry_run:  # refused here, before a flow run starts
        from ckptier.storage.catalog.api import Catalog  # lazy: likewise

        with Catalog.open(settings.location.url, create=False) as cat:
            require_written_policy(settings.config, [job] if job else cat.jobs(), settings.config_path)
    return dispatch(use_prefect, direct, flow="tiering:tiering_flow", unwrap=lambda result: result.apply,
                    params={"apply": not dry_run, "job": job, **_flow_settings(settings), "runner": runner})


def fetch(*, job: str, step: int, dest: Path, settings: Settings) -> FetchReport:
    """Restore a checkpoint's files into ``dest`` (``pipeline.run_fetch``), always in this process."""
    from ckptier.tasks.pipeline import run_fetch  # lazy: the command line checks its input before the operations load
    from ckptier.tasks.run import open_run  # lazy: likewise

    with open_run(settings) as run:
        return run_fetch(run, job=job, step=step, dest=dest)


def janitor(*, older_than: timedelta, settings: Settings) -> JanitorRunReport:
    """Clean the archive tiers of what interrupted promotions left (``pipeline.run_janitor``), in this process."""
    from ckptier.tasks.pipeline import run_janitor  # lazy: the command line checks its input before the operations load
    from ckptier.tasks.run import open_run  # lazy: likewise

    with open_run(settings) as run:
        return run_janitor(run, older_than=older_than)


def drill(options: DrillOptions, *, settings: Settings, use_prefect: bool, runner: str | None = None
          ) -> list[DrillReport]:
    """Restore drills (``pipeline.run_drill``), one report per drill; ``runner`` (threads or
    dask) is where the files are fetched (default: ``[runner]``). Failed drills are reports
    (``ok`` false) on both paths; a drill that cannot start raises."""
    def direct() -> list[DrillReport]:
        from ckptier.tasks.pipeline import run_drill  # lazy: the command line checks its input before the operations load
        from ckptier.tasks.run import open_run  # lazy: likewise

        with open_run(settings) as run:
            fanout, _ = _fanout(run, runner)
            try:
                return run_drill(run, options, fanout=fanout)
            finally:
                if fanout is not None:
                    fanout.close()

    return dispatch(use_prefect, direct, flow="drill:restore_drill_flow", unwrap=list,
                    params={"job": options.job, "step": options.step, "model": options.model,
                            "timeout_seconds": options.timeout, **_flow_settings(settings),
                            "allow_globals": list(options.allow_globals) or None, "steps": options.steps,
                            "device": options.device, "world_size": options.world_size, "runner": runner})
