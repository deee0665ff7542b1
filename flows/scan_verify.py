"""Prefect flows: ``scan``, ``verify`` and the scheduled ``scan-verify``.

A verify run that finds corruption fails (so the UI shows it red) and emits
a ``ckptier.corruption.found`` event that an automation can turn into an
alert.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from ckptier.tasks.pipeline import VerifyOptions
from ckptier.tasks.prefect_tasks import scan_task, verify_task
from ckptier.tasks.reports import FileProblem, VerifyReport, VerifyRow, VerifyTotals
from ckptier.tasks.run import open_run
from ckptier.tasks.scan import ScanReport
from ckptier.tasks.settings import Settings

from .artifacts import md_code, md_text, publish_catalog_summary, publish_dashboard_links
from .events import CORRUPTION_FOUND, emit_checkpoint_event
from .output import human_bytes
from .runner import FailedWithReport, RunnerChoice, resolve_sample, runner_kind


class CorruptionFound(FailedWithReport):
    """Verification found corrupt checkpoints (the flow run fails with this);
    ``report`` is what the run would have returned."""


def _expected_actual(f: FileProblem, side: str) -> str:
    size, sha256, crc = (f.expected_size, f.expected_sha256, f.expected_crc64nvme) if side == "expected" else \
        (f.actual_size, f.actual_sha256, f.actual_crc64nvme)
    parts = [f"{size:,} bytes" if size is not None else None,
             f"sha256 {md_code(sha256)}" if sha256 else None,
             f"crc64nvme {md_code(crc)}" if crc else None]
    return "<br>".join(p for p in parts if p) or "-"


@dataclass(frozen=True)
class Damage:
    """A corrupt checkpoint or degraded archive copy to alert on: a verify row
    (``row``), or a checkpoint a scan found corrupt (``row`` None: files its
    manifest lists were missing past the grace; ``detail`` says which)."""

    job: str
    step: int
    tier: str
    detail: str | None
    row: VerifyRow | None = None

    @property
    def state(self) -> str:
        return self.row.state if self.row is not None else "corrupt"


def render_verification(report: VerifyReport, scans: Sequence[ScanReport] = ()) -> str:
    """The ``verification`` artifact: totals per job, then every corrupt checkpoint and degraded
    archive copy with each bad file's expected and actual size and hashes (and the checkpoints
    ``scans`` found corrupt: files their manifest lists missing past the grace)."""
    t = report.totals
    sample = f" (slice {report.sample[0]}/{report.sample[1]})" if report.sample else ""
    archived = (f"; {t.archive_checked} archive copies read back, {t.archive_degraded} degraded"
                if t.archive_checked else "")
    lines = ["# Verification", "",
             f"{t.checked} checked{sample}: {t.verified} verified, {t.corrupt} corrupt, "
             f"{t.errors} with read errors{archived}; read {human_bytes(t.bytes_read)}, "
             f"skipped {human_bytes(t.bytes_skipped)} (proven by the store's own checksums)", ""]
    if report.by_job:
        lines += ["| job | checked | verified | corrupt | degraded archive copies | read errors | read | skipped |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {md_text(j.job)} | {j.checked} | {j.verified} | {j.corrupt} | {j.degraded} | "
                  f"{j.errors} | {human_bytes(j.bytes_read)} | {human_bytes(j.bytes_skipped)} |"
                  for j in report.by_job]
        lines.append("")
    bad = corruption_in(report, scans)
    if not bad:
        lines.append("Nothing corrupt or degraded." if t.checked or t.archive_checked else "Nothing to verify.")
        return "\n".join(lines) + "\n"
    lines += [f"## Corrupt or degraded: {len(bad)}", ""]
    for d in bad:
        what = "archive copy" if d.tier == "archive" else "hot copy"
        found = "" if d.row is not None else ", found by the scan"
        lines += [f"### {md_text(d.job)} step {d.step}: {d.state} ({what}{found})", ""]
        if d.detail:
            lines += [md_text(d.detail), ""]
        r = d.row
        if r is None:
            continue
        if r.files:
            lines += ["| file | status | expected | actual | detail |", "| --- | --- | --- | --- | --- |"]
            lines += [f"| {md_code(f.relpath)} | {f.status} | {_expected_actual(f, 'expected')} | "
                      f"{_expected_actual(f, 'actual')} | {md_text(f.detail)} |" for f in r.files]
            lines.append("")
        for p in r.problems or ():
            lines.append(f"- {md_text(p)}")
        if r.problems:
            lines.append("")
        if r.extra:
            lines += ["Files the catalog does not know: " + ", ".join(md_code(x) for x in r.extra), ""]
    return "\n".join(lines) + "\n"


#: The report of a run that verified nothing (``scan-verify`` with ``verify=False``).
NOTHING_VERIFIED = VerifyReport(checkpoints=(), totals=VerifyTotals(), by_job=())


def publish_verification(report: VerifyReport, scans: Sequence[ScanReport] = ()) -> None:
    """Markdown artifact ``verification`` (:func:`render_verification`)."""
    t = report.totals
    create_markdown_artifact(render_verification(report, scans), key="verification",
                             description=f"Verification: {t.verified} verified, {t.corrupt} corrupt, "
                                         f"{t.archive_degraded} archive copies degraded")


def corruption_in(report: VerifyReport, scans: Sequence[ScanReport] = ()) -> list[Damage]:
    """The corrupt checkpoints (and degraded copies) a verify report holds, plus
    those scans found corrupt (files their manifest lists missing past the grace)."""
    corrupt = [Damage(r.job, r.step, r.tier, r.detail, r) for r in report.checkpoints
               if r.state in ("corrupt", "degraded")]
    return corrupt + [Damage(job, step, "hot", why) for scan in scans if scan.summary is not None
                      for job, step, why in scan.summary.corrupt_found]


def raise_on_corruption(report: VerifyReport, scans: Sequence[ScanReport] = (), *,
                        result: Any = None) -> None:
    """Emit an event per corrupt checkpoint (:func:`corruption_in`) and fail the run
    with :class:`CorruptionFound` carrying ``result`` (default: ``report``)."""
    corrupt = corruption_in(report, scans)
    if not corrupt:
        return
    for d in corrupt:
        emit_checkpoint_event(CORRUPTION_FOUND, d.job, d.step, tier=d.tier, detail=d.detail,
                              files=[f.relpath for f in (d.row.files if d.row is not None else ())][:20])
    names = ", ".join(f"{d.job} step {d.step}" for d in corrupt[:5])
    raise CorruptionFound(f"{len(corrupt)} corrupt checkpoint(s): {names}; see the 'verification' artifact",
                          report=report if result is None else result)


def _jobs(job: str | None, summary: list[dict[str, Any]]) -> list[str]:
    return [job] if job else [j["job"] for j in summary]


def _scanned_jobs(reports: Sequence[ScanReport]) -> list[str]:
    """The jobs the scans saw, in order (a job once per scan that saw it)."""
    return [j for r in reports if r.summary is not None for j in r.summary.jobs]


@flow(name="scan")
def scan_flow(
    urls: list[str],
    catalog_url: str | None = None,
    config_path: str | None = None,
    inventory: str | None = None,
    full: bool = False,
) -> list[ScanReport]:
    """Catalog every checkpoint under each URL (one :class:`ScanReport` each, in order);
    publishes the ``catalog-summary`` table.

    Args:
        urls: Where checkpoints are written: paths, file:///path or s3://bucket/prefix.
        catalog_url: Catalog SQLAlchemy URL. Empty: CKPTIER_CATALOG_URL, else the config's [catalog] url, else SQLite in the data dir.
        config_path: ckptier.toml path, for its [catalog] url, [[pattern]] rules, each job's grace and [[inventory]] tables. Empty: CKPTIER_CONFIG, else ./ckptier.toml.
        inventory: S3 Inventory report read instead of listing (one s3:// URL only). Empty: ckptier.toml's [[inventory]].
        full: List every local directory, even those unchanged since the last scan.
    """
    with open_run(Settings(catalog_url, config_path), create=True) as run:
        reports = [scan_task(run, url, inventory=inventory, full=full) for url in urls]
        publish_catalog_summary(run)
    publish_dashboard_links(_scanned_jobs(reports))
    return reports


@flow(name="verify")
def verify_flow(
    job: str | None = None,
    deep: bool = False,
    sample: str | None = None,
    workers: int = 4,
    catalog_url: str | None = None,
    config_path: str | None = None,
    runner: RunnerChoice = "config",
    sweep_since: str | None = None,
) -> VerifyReport:
    """Verify checkpoints (the report with ``by_job``); fails the run (and emits an event)
    when corruption is found, with the report (:class:`CorruptionFound`).

    Publishes ``verification`` (every bad file with expected and actual
    hashes), ``verify-progress`` and ``catalog-summary``.

    Args:
        job: Only this job. Empty: every job.
        deep: Read every byte even when the store keeps a full-object checksum.
        sample: K/N verifies the K-th of N disjoint slices; auto/N picks tonight's slice. Empty: no slice, what needs it.
        workers: Files read in parallel.
        catalog_url: Catalog SQLAlchemy URL. Empty: CKPTIER_CATALOG_URL, else the config's [catalog] url, else SQLite in the data dir.
        config_path: ckptier.toml path, for its [catalog] url, each job's grace and [runner]. Empty: CKPTIER_CONFIG, else ./ckptier.toml.
        runner: Where the checkpoints are read: threads or dask; config: the [runner] kind of ckptier.toml (threads when unset).
        sweep_since: With [runner] claim_rows: the ISO 8601 start of the sweep this run shares with others. Empty: now.
    """
    options = VerifyOptions(job=job, deep=deep, sample=resolve_sample(sample, datetime.now(UTC)), workers=workers)
    with open_run(Settings(catalog_url, config_path)) as run:
        report = verify_task(run, options, runner_kind(runner), sweep_since)
        publish_verification(report)
        summary = publish_catalog_summary(run)
    publish_dashboard_links(_jobs(job, summary))
    raise_on_corruption(report)
    return report


@flow(name="scan-verify")
def scan_verify_flow(
    urls: list[str],
    verify: bool = True,
    deep: bool = False,
    sample: str | None = None,
    workers: int = 4,
    catalog_url: str | None = None,
    config_path: str | None = None,
    runner: RunnerChoice = "config",
    sweep_since: str | None = None,
) -> dict[str, Any]:
    """Scan, then verify: the hourly (and, with ``sample``, nightly) catalog upkeep.

    Returns ``{"scans": [ScanReport, ...], "verify": VerifyReport}`` (``verify``
    only when it verified).

    Args:
        urls: Where checkpoints are written: paths, file:///path or s3://bucket/prefix.
        verify: Verify new and changed checkpoints after scanning.
        deep: Read every byte even when the store keeps a full-object checksum.
        sample: K/N or auto/N: deep-read one slice of the catalog (every byte every N runs). Empty: no slice.
        workers: Files read in parallel.
        catalog_url: Catalog SQLAlchemy URL. Empty: CKPTIER_CATALOG_URL, else the config's [catalog] url, else SQLite in the data dir.
        config_path: ckptier.toml path, for its [catalog] url, [[pattern]] rules, each job's grace, [[inventory]] tables and [runner]. Empty: CKPTIER_CONFIG, else ./ckptier.toml.
        runner: Where the checkpoints are read: threads or dask; config: the [runner] kind of ckptier.toml (threads when unset).
        sweep_since: With [runner] claim_rows: the ISO 8601 start of the sweep this run shares with others. Empty: now.
    """
    result: dict[str, Any] = {}
    with open_run(Settings(catalog_url, config_path), create=True) as run:
        scans = [scan_task(run, url) for url in urls]
        result["scans"] = scans
        if verify:
            options = VerifyOptions(deep=deep, sample=resolve_sample(sample, datetime.now(UTC)), workers=workers)
            report = verify_task(run, options, runner_kind(runner), sweep_since)
            publish_verification(report, scans)
            result["verify"] = report
        elif corruption_in(NOTHING_VERIFIED, scans):
            publish_verification(NOTHING_VERIFIED, scans)
        # One summary per run, after verification has settled the states.
        publish_catalog_summary(run)
    publish_dashboard_links(_scanned_jobs(scans))
    raise_on_corruption(result.get("verify", NOTHING_VERIFIED), scans, result=result)
    return result
