"""Prefect flow ``tiering``: plan retention, then (only when asked) carry it out.

Deployments run it with ``apply=False`` by default: a dry run that publishes
the plan, until the user turns ``apply`` on in the UI.

At most one tiering run per job at a time: a run holds the Prefect global
concurrency limit ``ckptier-tiering-<job>`` (limit 1, created on first use)
of its job, or of every cataloged job when it covers them all; a second run
waits for it (up to ``lease_minutes``) instead of racing it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

from ckptier.tasks.prefect_tasks import apply_task, plan_task
from ckptier.tasks.reports import ApplyRunReport
from ckptier.tasks.run import open_run
from ckptier.tasks.settings import Settings, require_written_policy

from .artifacts import md_code, md_text, publish_catalog_summary, publish_dashboard_links
from .output import human_bytes
from .runner import FailedWithReport, RunnerChoice, runner_kind



TIERING_LOCK_PREFIX = "ckptier-tiering-"


def tiering_lock_name(job: str) -> str:
    """The global concurrency limit that serialises tiering of ``job`` (a valid Prefect name, unique per job)."""
    safe = re.sub(r"[^A-Za-z0-9_.\-]", "_", job)
    if safe != job or len(safe) > 80:
        safe = f"{safe[:60]}-{hashlib.sha256(job.encode()).hexdigest()[:12]}"
    return TIERING_LOCK_PREFIX + safe


def tiering_lock_names(job: str | None, cataloged_jobs: Iterable[str]) -> list[str]:
    """Limits a run holds: its job's, or every cataloged job's (sorted) when ``job`` is None."""
    return sorted({tiering_lock_name(j) for j in ([job] if job else cataloged_jobs)})


@contextmanager
def hold_job_locks(names: list[str], timeout_seconds: float) -> Iterator[None]:
    """Hold one slot of each named limit (created with limit 1 when missing), acquired all at once."""
    if not names:
        yield
        return
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                try:
                    client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
                except PrefectHTTPStatusError as exc:  # another run created it first
                    if exc.response.status_code != 409:
                        raise
    with concurrency(names, occupy=1, timeout_seconds=timeout_seconds, strict=True):
        yield


def publish_plan(plan: dict[str, Any]) -> None:
    """Table artifact ``retention-plan``; its description says how many hot bytes carrying it out frees.

    ``plan`` is ``plan_task``'s result: the rows and the forecast (the
    plan's deletions plus the hot copies of the milestones it promotes,
    which the same run then deletes), out of the hot bytes held now."""
    rows, f = plan["rows"], plan["forecast"]
    table = [{"job": r["job"], "step": r["step"], "state": r["state"], "action": r["action"], "scope": r["scope"],
              "size": human_bytes(r["bytes"]), "reasons": "; ".join(r["reasons"])} for r in rows]
    if not f["hot_bytes"]:
        description = "Retention plan: nothing in hot storage"
    else:
        after = (f" ({human_bytes(f['after_promotion_bytes'])} of it hot copies of milestones once their archive "
                 f"copy is verified)") if f["after_promotion_bytes"] else ""
        description = (f"Retention plan: {human_bytes(f['freed_bytes'])} of {human_bytes(f['hot_bytes'])} hot bytes "
                       f"can be freed ({f['freed_bytes'] / f['hot_bytes']:.0%}){after}")
    create_table_artifact(table or [{"job": "-", "step": "-", "action": "-", "reasons": "no checkpoints"}],
                          key="retention-plan", description=description)


def render_outcome(report: ApplyRunReport) -> str:
    """The ``tiering-result`` artifact: what the run did per tier and storage class, then per checkpoint."""
    o = report.outcome
    lines = ["# Tiering: what was done", "",
             f"Promoted {len(o.promoted)} checkpoint(s), deleted {len(o.deleted)} hot copies or checkpoints; "
             f"hot bytes freed: {human_bytes(o.hot_freed_bytes)}.", ""]
    if o.tiers:
        lines += ["| tier | storage class | copies written | written (stored) | logical | copies deleted | freed |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {md_text(t.tier)} | {md_text(t.storage_class)} | {t.written} | {human_bytes(t.written_bytes)} | "
                  f"{human_bytes(t.logical_bytes)} | {t.deleted} | {human_bytes(t.freed_bytes)} |"
                  for t in o.tiers]
        lines.append("")
    if o.promoted:
        lines += ["## Promoted", "", "| job | step | size | stored | storage class | archive copy |",
                  "| --- | ---: | ---: | ---: | --- | --- |"]
        lines += [f"| {md_text(p.job)} | {p.step} | {human_bytes(p.bytes)} | {human_bytes(p.stored_bytes)} | "
                  f"{md_text(p.storage_class)} | {md_code(p.url)} |" for p in o.promoted]
        lines.append("")
    if o.deleted:
        lines += ["## Deleted", "", "| job | step | what | size | freed | storage class |",
                  "| --- | ---: | --- | ---: | ---: | --- |"]
        lines += [f"| {md_text(d.job)} | {d.step} | {'hot copy' if d.scope == 'hot-copy' else 'checkpoint'} | "
                  f"{human_bytes(d.bytes)} | {human_bytes(d.freed_bytes)} | {md_text(d.storage_class)} |"
                  for d in o.deleted]
        lines.append("")
    undone = [i for i in report.items if i.outcome in ("held", "deferred", "failed", "partial", "fenced")]
    if undone:
        lines += ["## Not done (a later run resumes)", "", "| job | step | action | outcome | detail |",
                  "| --- | ---: | --- | --- | --- |"]
        lines += [f"| {md_text(i.job)} | {i.step} | {md_text(i.action)} | {md_text(i.outcome)} | {md_text(i.detail)} |"
                  for i in undone]
        lines.append("")
    return "\n".join(lines)


def publish_outcome(report: ApplyRunReport) -> None:
    """Markdown artifact ``tiering-result`` (:func:`render_outcome`); published by runs with ``apply`` only."""
    o = report.outcome
    create_markdown_artifact(render_outcome(report), key="tiering-result",
                             description=f"Tiering done: {len(o.promoted)} promoted, {len(o.deleted)} deleted, "
                                         f"{human_bytes(o.hot_freed_bytes)} of hot storage freed")


@dataclass(frozen=True)
class TieringRun:
    """What a ``tiering`` flow run returns: the retention ``plan`` (its table rows),
    the ``forecast`` of hot bytes carrying it out frees, and the ``apply`` report
    (a dry run's when the flow ran without ``apply``)."""

    plan: list[dict[str, Any]]
    forecast: dict[str, Any]
    apply: ApplyRunReport

    def to_json(self) -> dict[str, Any]:
        """The run as JSON-ready values: the plan rows, the forecast and the apply report."""
        return {"plan": self.plan, "forecast": self.forecast, "apply": self.apply.to_json()}


class TieringFailed(FailedWithReport):
    """Some items of a tiering run failed (the flow run fails with this);
    ``report`` is the :class:`TieringRun` it would have returned."""


@flow(name="tiering")
def tiering_flow(
    apply: bool = False,
    job: str | None = None,
    config_path: str | None = None,
    catalog_url: str | None = None,
    lease_minutes: int = 60,
    runner: RunnerChoice = "config",
) -> TieringRun:
    """Plan retention and, with ``apply``, promote milestones and delete rolling checkpoints.

    Returns a :class:`TieringRun`; a run where some items failed fails with
    :class:`TieringFailed`, which carries it (re-running resumes).

    Args:
        apply: Carry out the plan. Off (the default) is a dry run that only publishes the plan.
        job: Only this job. Empty: every job.
        config_path: ckptier.toml with the [[policy]] tables. Empty: CKPTIER_CONFIG, else ./ckptier.toml.
        catalog_url: Catalog SQLAlchemy URL. Empty: CKPTIER_CATALOG_URL, else the config's [catalog] url, else SQLite.
        lease_minutes: How long this run waits for another tiering run of the same job to finish
            (checkpoint leases themselves are short and kept alive while the run lives).
        runner: Where archive copies are made: threads or dask; config: the [runner] kind of ckptier.toml (threads when unset).
    """
    with open_run(Settings(catalog_url, config_path), dry_run=not apply) as run:
        jobs = [job] if job else run.catalog.jobs()
        if apply:  # deletes only under a [[policy]] someone wrote; a dry run may preview the default
            require_written_policy(run.config, jobs, config_path)
        locks = tiering_lock_names(job, jobs)
        with hold_job_locks(locks, timeout_seconds=lease_minutes * 60.0):
            plan = plan_task(run, job)
            publish_plan(plan)
            report = apply_task(run, job, runner_kind(runner))
        if apply:
            publish_outcome(report)
        summary = publish_catalog_summary(run)
    publish_dashboard_links([job] if job else [j["job"] for j in summary])
    result = TieringRun(plan=plan["rows"], forecast=plan["forecast"], apply=report)
    if report.failed:
        raise TieringFailed("tiering: some items failed; re-run to resume: " + "; ".join(report.lines[-3:]),
                            report=result)
    return result
