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
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ckptier.storage.errors import CkptierError, ConfigError
from ckptier.tasks.prefect_api import check_prefect_api

from .output import Progress

if TYPE_CHECKING:
    from ckptier.tasks.reports import ApplyRunReport, DrillReport, FetchReport, JanitorRunReport, VerifyReport
    from ckptier.tasks.scan import ScanReport

R = TypeVar("R")


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


def _open(catalog_url: str | None, *, create: bool = False) -> Any:
    """The catalog at ``catalog_url`` (None: the default); only ``scan`` creates one."""
    from ckptier.storage.catalog.api import Catalog

    return Catalog.open(catalog_url, create=create)


def resolve_sample(sample: str | None, now: datetime | None = None) -> tuple[int, int] | None:
    """``"K/N"`` → (K, N); ``"auto/N"`` → the slice of N for ``now``'s UTC date
    (every byte re-read every N nights); None → None. One-line
    :class:`ConfigError` otherwise."""
    from ckptier.tasks.verify import parse_sample, rotating_slice

    if not sample:
        return None
    head, sep, tail = sample.strip().partition("/")
    if sep and head.strip().lower() == "auto":
        if not tail.strip().isdigit() or int(tail) < 1:
            raise ConfigError(f"--sample {sample!r}: N must be a whole number ≥ 1, e.g. auto/7")
        n = int(tail)
        return rotating_slice((now or datetime.now(UTC)).date(), n), n
    return parse_sample(sample)


def why_nothing_to_verify(catalog_url: str, *, job: str | None, deep: bool, sample: tuple[int, int] | None) -> str:
    """Words for a verify run that checked nothing (the catalog is only read)."""
    with _open(catalog_url) as cat:
        records = cat.checkpoints(job=job, with_files=False)
    if not records:
        return "the catalog holds no checkpoints yet; run 'ckptier scan URL' first"
    if sample is not None:
        return f"slice {sample[0]}/{sample[1]} holds none of the {len(records)} cataloged checkpoints"
    if deep:
        return f"none of the {len(records)} cataloged checkpoints has a copy to read (states: " + \
            ", ".join(sorted({c.state.value for c in records})) + ")"
    waiting = sum(1 for c in records if c.state.value == "incomplete")
    return (f"every one of the {len(records)} cataloged checkpoints is already verified or still being written"
            + (f" ({waiting} incomplete)" if waiting else "") + "; --deep re-reads every byte")


def scan(urls: list[str], *, catalog_url: str | None, use_prefect: bool, progress: bool = True,
         config_path: str | None = None, inventory: str | None = None, full: bool = False) -> list[ScanReport]:
    """Scan each URL (``pipeline.run_scan``); one :class:`ScanReport` per URL on both paths."""
    if inventory is not None and len(urls) != 1:
        raise ConfigError(f"--inventory {inventory} names the report of one bucket; scan one s3:// URL with it, "
                          f"not {len(urls)}")

    def direct() -> list[ScanReport]:
        from ckptier.tasks.pipeline import run_scan
        from ckptier.tasks.run import open_run
        from ckptier.tasks.settings import Settings

        bar = Progress("listing", unit="objects", enabled=None if progress else False)
        try:
            with open_run(Settings(catalog_url, config_path), create=True) as run:
                return run_scan(urls, run.catalog, now=run.now, tick=bar.update, patterns=run.config.patterns,
                                config=run.config, inventories=[(urls[0], inventory)] if inventory else (), full=full)
        finally:
            bar.close()

    return dispatch(use_prefect, direct, flow="scan_verify:scan_flow",
                    params={"urls": urls, "catalog_url": catalog_url, "config_path": config_path,
                            "inventory": inventory, "full": full or None})


def verify(*, job: str | None, deep: bool, sample: tuple[int, int] | None, workers: int,
           catalog_url: str | None, use_prefect: bool, progress: bool = True, config_path: str | None = None,
           runner: str | None = None, claim_rows: bool = False, since: str | None = None) -> VerifyReport:
    """Verify (``pipeline.run_verify``); the :class:`VerifyReport` on both paths (a flow run
    that found corruption hands back its report, ``by_job`` filled in)."""
    def direct() -> VerifyReport:
        from ckptier.tasks.pipeline import run_verify
        from ckptier.tasks.run import open_run
        from ckptier.tasks.settings import Settings

        fanout, claims = _fanout(config_path, runner, claim_rows, since)
        bar = Progress("verifying", unit="bytes", enabled=None if progress else False)
        try:
            with open_run(Settings(catalog_url, config_path)) as run:  # each job's grace comes from its [[policy]]
                return run_verify(run.catalog, now=run.now, job=job, deep=deep, sample=sample, workers=workers,
                                  progress=lambda done, total: bar.update(done, total), stores=run.stores,
                                  config=run.config, fanout=fanout, claims=claims)
        finally:
            bar.close()
            if fanout is not None:
                fanout.close()

    return dispatch(use_prefect, direct, flow="scan_verify:verify_flow",
                    params={"job": job, "deep": deep, "sample": f"{sample[0]}/{sample[1]}" if sample else None,
                            "workers": workers, "catalog_url": catalog_url, "config_path": config_path,
                            "runner": runner, "sweep_since": since})


def _fanout(config_path: str | None, runner: str | None, claim_rows: bool = False, since: str | None = None) -> Any:
    """The Dask executor (None: threads here) and the row claims for a direct run, from
    ``[runner]`` and the command line (``--runner``, ``--claim-rows``, ``--since``)."""
    from dataclasses import replace

    from ckptier.tasks.config import load_config
    from ckptier.tasks.fanout import open_fanout, runner_settings
    from ckptier.tasks.run import row_claims, run_owner

    settings = runner_settings(load_config(config_path).runner, runner)
    if claim_rows:
        settings = replace(settings, claim_rows=True)
    claims = row_claims(settings, since, owner=run_owner("ckptier-cli"))
    return open_fanout(settings), claims


def apply(*, job: str | None, dry_run: bool, config_path: str | None, catalog_url: str | None,
          use_prefect: bool, runner: str | None = None) -> ApplyRunReport:
    """Retention carried out (``pipeline.run_apply``), or previewed with ``dry_run``; the Prefect
    path runs the tiering flow and hands back its apply report (failed items included)."""
    if not dry_run:  # deletes only under a [[policy]] someone wrote; a dry run may preview the default
        _check_policy_written(job, config_path, catalog_url)

    def direct() -> ApplyRunReport:
        from ckptier.tasks.pipeline import run_apply
        from ckptier.tasks.run import open_run
        from ckptier.tasks.settings import Settings

        fanout, _ = _fanout(config_path, runner)
        try:
            with open_run(Settings(catalog_url, config_path), owner="ckptier-cli", dry_run=dry_run) as run:
                return run_apply(run.catalog, run.config, now=run.now, owner=run.owner, job=job, dry_run=run.dry_run,
                                 stores=run.stores, fanout=fanout)
        finally:
            if fanout is not None:
                fanout.close()

    return dispatch(use_prefect, direct, flow="tiering:tiering_flow", unwrap=lambda result: result.apply,
                    params={"apply": not dry_run, "job": job, "config_path": config_path, "catalog_url": catalog_url,
                            "runner": runner})


def _check_policy_written(job: str | None, config_path: str | None, catalog_url: str | None) -> None:
    """Raise ``NoPolicyWritten`` when a job to act on has no ``[[policy]]`` the user wrote."""
    from ckptier.tasks.config import load_config
    from ckptier.tasks.settings import require_written_policy

    config = load_config(config_path)
    with _open(catalog_url) as cat:
        require_written_policy(config, [job] if job else cat.jobs(), config_path)


def fetch(*, job: str, step: int, dest: Path, catalog_url: str | None, config_path: str | None) -> FetchReport:
    """Restore a checkpoint's files into ``dest`` (``pipeline.run_fetch``), always in this process."""
    from ckptier.tasks.pipeline import run_fetch
    from ckptier.tasks.run import open_run
    from ckptier.tasks.settings import Settings

    with open_run(Settings(catalog_url, config_path)) as run:
        return run_fetch(run.catalog, run.config, job=job, step=step, dest=dest, stores=run.stores)


def janitor(*, config_path: str | None, older_than: timedelta, catalog_url: str | None) -> JanitorRunReport:
    from ckptier.tasks.pipeline import run_janitor
    from ckptier.tasks.run import open_run
    from ckptier.tasks.settings import Settings

    with open_run(Settings(catalog_url, config_path)) as run:
        return run_janitor(run.catalog, run.config, now=run.now(), older_than=older_than, stores=run.stores)


def drill(*, job: str | None, step: int | None, steps: int | None, device: str | None, model: str | None,
          timeout: float | None, config_path: str | None, catalog_url: str | None, use_prefect: bool,
          allow_globals: list[str] | None = None, world_size: int | None = None,
          runner: str | None = None) -> list[DrillReport]:
    """Restore drills (``pipeline.run_drill``), one report per drill; ``allow_globals`` are extra
    ``module.Name`` classes the safe loader may unpickle; ``world_size``
    restores into that many ranks; ``runner`` (threads or dask) where the
    files are fetched (default: ``[runner]``). Failed drills are reports
    (``ok`` false) on both paths; a drill that cannot start raises."""
    def direct() -> list[DrillReport]:
        from ckptier.tasks.pipeline import DrillOptions, run_drill
        from ckptier.tasks.run import open_run
        from ckptier.tasks.settings import Settings

        options = DrillOptions(job=job, step=step, steps=steps, device=device, model=model, timeout=timeout,
                               allow_globals=tuple(allow_globals or ()), world_size=world_size)
        fanout, _ = _fanout(config_path, runner)
        try:
            with open_run(Settings(catalog_url, config_path)) as run:
                return run_drill(run, options, fanout=fanout)
        finally:
            if fanout is not None:
                fanout.close()

    return dispatch(use_prefect, direct, flow="drill:restore_drill_flow", unwrap=list,
                    params={"job": job, "step": step, "model": model, "timeout_seconds": timeout,
                            "config_path": config_path, "catalog_url": catalog_url,
                            "allow_globals": list(allow_globals) if allow_globals else None,
                            "steps": steps, "device": device, "world_size": world_size, "runner": runner})
