"""Prefect flow ``restore-drill``: prove that recovery really works.

Publishes a markdown report (artifact ``drill-report``); a failed drill fails
its ``drill`` task run (named after the checkpoint, ``drill demo-run@50``, its
state the verdict: :func:`ckptier.tasks.prefect_tasks.drill_state`) and the
flow run, and emits ``ckptier.drill.failed`` so an automation can alert. So
does a drill that cannot start (an unknown job, no drillable checkpoint, a
corrupt step asked for, a model that does not load): its report says why,
and nothing is recorded against a checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Literal

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from ckptier.storage.errors import CkptierError
from ckptier.tasks.config import DEFAULT_DRILL_STEPS, DEFAULT_DRILL_TIMEOUT
from ckptier.tasks.drill_inputs import GPU_POOL_ENV
from ckptier.tasks.pipeline import DrillOptions
from ckptier.tasks.prefect_tasks import drill_task
from ckptier.tasks.reports import DrillReport
from ckptier.tasks.run import open_run
from ckptier.tasks.settings import Settings

from .artifacts import md_code, md_text, publish_catalog_summary, publish_dashboard_links
from .events import DRILL_FAILED, DRILL_NOT_JUDGED, ENVIRONMENT_DRIFT, emit_ckptier_event
from .runner import FailedWithReport, RunnerChoice, runner_kind


class DrillFailed(FailedWithReport):
    """A restore drill did not prove recovery (the flow run fails with this);
    ``report`` holds every drill's report, as the run would have returned."""


class DrillNotStarted(DrillFailed):
    """A restore drill could not start: the reason is the operator's input or the catalog, not a checkpoint."""


def render_not_started(job: str | None, step: int | None, why: str) -> str:
    """The drill report of a drill that could not start (what came from the catalog or the
    operator escaped, :func:`~ckptier.flows.artifacts.md_text`)."""
    what = (f"{md_text(job)} step {step}" if step is not None else md_text(job)) if job else "every job"
    return "\n".join(["# Restore drill", "", f"## {what}: NOT STARTED", "", md_text(why), "",
                      "Nothing was restored and nothing is recorded against any checkpoint.", ""])


def peak_memory_text(report: DrillReport) -> str:
    """``1,234 bytes``, or ``not measured`` when no worker got as far as measuring it (a
    failed or not started drill: never ``0 bytes``)."""
    return f"{report.peak_memory_bytes:,} bytes" if report.peak_memory_bytes else "not measured"


def render_report(reports: Sequence[DrillReport]) -> str:
    """The drill report as markdown: one section per drill, a table of checks and timings;
    everything from the catalog, the checkpoint or the worker escaped (:func:`md_text`)."""
    lines = ["# Restore drill", ""]
    for r in reports:
        mark = "NOT STARTED" if not r.started else r.outcome.upper()
        trained = f", trained steps {r.trained_steps[0]}..{r.trained_steps[1]}" if r.trained_steps else ""
        lines += [f"## {md_text(r.job)} step {r.step}: {mark}", "",
                  *([f"**{md_text(r.device_note)}**", ""] if r.device_note else []), md_text(r.summary), "",
                  f"device {md_code(r.device)}, tier {md_code(r.tier)}, peak memory {peak_memory_text(r)}{trained}", "",
                  *([md_text(r.confinement), ""] if r.confinement else []),
                  "| check | result | detail |", "| --- | --- | --- |"]
        lines += [f"| {md_text(c.name)} | {'ok' if c.ok else '**FAIL**'} | {md_text(c.detail)} |" for c in r.checks]
        lines += _ranks_section(r)
        if r.timings:
            lines += ["", "| phase | seconds |", "| --- | ---: |"]
            lines += [f"| {md_text(k)} | {v:.3f} |" for k, v in r.timings.items() if not k.endswith("_at")]
        lines.append("")
    return "\n".join(lines)


def _ranks_section(report: DrillReport) -> list[str]:
    """Markdown lines for a multi-rank drill: the resharding outcome and one
    row per rank (its files, the bytes its scratch held, its first loss);
    none for a single-rank drill."""
    if not report.ranks:
        return []
    lines = [""]
    if (reshard := report.reshard) is not None:
        lines += [f"Resharding {reshard.from_world} -> {reshard.to_world} ranks: "
                  f"{'resumes' if reshard.resumes else '**does not resume**'} ({md_text(reshard.detail)})", ""]
    lines += ["| rank | result | files | scratch bytes | first loss |", "| ---: | --- | ---: | ---: | ---: |"]
    for rank in report.ranks:
        loss = rank.losses[0] if rank.losses else None
        result = "ok" if rank.ok else f"**FAIL** ({md_text(rank.stage)}: {md_text(rank.error)})"
        lines.append(f"| {rank.rank} | {result} | {len(rank.files)} | {rank.held_bytes or 0:,} | "
                     f"{'-' if loss is None else f'{loss:.6g}'} |")
    return lines


@flow(name="restore-drill")
def restore_drill_flow(
    job: str | None = None,
    step: int | None = None,
    steps: int = DEFAULT_DRILL_STEPS,
    device: Literal["auto", "cpu", "cuda"] = "auto",
    model: str | None = None,
    timeout_seconds: float = DEFAULT_DRILL_TIMEOUT.total_seconds(),
    config_path: str | None = None,
    catalog_url: str | None = None,
    allow_globals: tuple[str, ...] = (),
    world_size: int | None = None,
    runner: RunnerChoice = "config",
) -> list[DrillReport]:
    """Restore a checkpoint, train a few steps and record whether recovery works; one report per drill.

    Args:
        job: Drill only this job. Empty: the newest verified checkpoint of every job.
        step: Drill this step of the job. Empty: the newest verified one.
        steps: Training steps to run from the restored state; left at 10, each job's [[drill]] steps apply.
        device: auto (a GPU when one is visible, else CPU), cpu or cuda; left at auto, each job's [[drill]] device applies. On the ckptier-gpu work pool, auto fails without a visible GPU unless [[drill]] require_gpu = false.
        model: Model factory as module:function. Empty: the job's [[drill]] model in ckptier.toml.
        timeout_seconds: Kill the drill after this many seconds; left at 900, each job's [[drill]] timeout applies.
        config_path: ckptier.toml path. Empty: CKPTIER_CONFIG, else ./ckptier.toml.
        catalog_url: Catalog SQLAlchemy URL. Empty: CKPTIER_CATALOG_URL, else the config's [catalog] url, else SQLite.
        allow_globals: Classes (module.Name) the safe loader may unpickle, besides the [[drill]] allow_globals.
        world_size: Restore into this many ranks and report whether the run resumes on them. Empty: as many as saved the checkpoint.
        runner: Where the checkpoint's files are fetched: threads or dask; config: the [runner] kind of ckptier.toml (threads when unset).
    """
    options = DrillOptions(job=job, step=step, steps=steps, device=device, model=model, timeout=timeout_seconds,
                           allow_globals=tuple(allow_globals), world_size=world_size,
                           gpu_pool=os.environ.get(GPU_POOL_ENV) or None)
    with ExitStack() as stack:
        try:
            run = stack.enter_context(open_run(Settings(catalog_url, config_path)))
            state = drill_task(run, options, runner_kind(runner), return_state=True)
            reports = state.result(raise_on_failure=False)
            if isinstance(reports, BaseException):  # the task raised: nothing was drilled
                raise reports
        except CkptierError as exc:  # nothing could be drilled: say why, alert, fail
            create_markdown_artifact(render_not_started(job, step, str(exc)), key="drill-report",
                                     description="Restore drill report: not started")
            emit_ckptier_event(DRILL_FAILED, job, step, summary=f"drill not started: {exc}", started=False)
            publish_dashboard_links([job] if job else [])
            raise DrillNotStarted(str(exc)) from None
        create_markdown_artifact(render_report(reports), key="drill-report", description="Restore drill report")
        failed = [r for r in reports if not r.ok]
        for r in failed:  # one event per drill: a not judged one stops its job's walk, so one per cause
            emit_ckptier_event(DRILL_FAILED if r.judged else DRILL_NOT_JUDGED, r.job, r.step, summary=r.summary,
                               started=r.started, verdict=r.outcome)
            if r.drift:
                emit_ckptier_event(ENVIRONMENT_DRIFT, r.job, r.step, summary=r.drift)
        summary = publish_catalog_summary(run)
    publish_dashboard_links([job] if job else [j["job"] for j in summary])
    # Any failed attempt fails the run, even when an older checkpoint then passed:
    # the newest ones not restoring (a serialization change, say) is what to hear about.
    if failed:
        raise DrillFailed("; ".join(r.summary for r in failed), report=reports)
    return reports
