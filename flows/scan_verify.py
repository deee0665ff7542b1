"""Prefect flows: ``scan``, ``verify`` and the scheduled ``scan-verify``.

A verify run that finds corruption fails (so the UI shows it red) and emits
a ``ckptier.corruption.found`` event that an automation can turn into an
alert.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from ckptier.storage.catalog.api import Catalog
from ckptier.storage.errors import CkptierError
from ckptier.tasks.prefect_tasks import scan_task, verify_task
from ckptier.tasks.settings import catalog_url as resolve_catalog_url

from .events import CORRUPTION_FOUND, emit_checkpoint_event
from .runner import resolve_sample


class CorruptionFound(CkptierError):
    """Verification found corrupt checkpoints (the flow run fails with this)."""


def publish_catalog_summary(catalog_url: str | None) -> list[dict[str, Any]]:
    """Table artifact ``catalog-summary``: checkpoints and bytes per job and state."""
    with Catalog.open(catalog_url) as cat:
        rows = cat.summary()
    table = [
        {"job": r["job"], "state": r["state"], "checkpoints": r["count"], "bytes": r["bytes"],
         "newest verified step": r.get("newest_verified_step"), "tiers": ",".join(r.get("tiers") or [])}
        for r in rows
    ]
    create_table_artifact(table, key="catalog-summary", description="Checkpoints per job and state")
    return table


def publish_verification(report: dict[str, Any]) -> None:
    """Table artifact ``verification``: verified / corrupt / errors per job, bytes read vs skipped."""
    per_job: dict[str, dict[str, Any]] = {}
    for row in report["checkpoints"]:
        j = per_job.setdefault(row["job"], {"job": row["job"], "verified": 0, "corrupt": 0, "errors": 0,
                                            "bytes read": 0, "bytes skipped (native checksums)": 0})
        j["verified"] += row["state"] == "verified"
        j["corrupt"] += row["state"] in ("corrupt", "degraded")
        j["errors"] += row["errors"] > 0
        j["bytes read"] += row["bytes_read"]
        j["bytes skipped (native checksums)"] += row["bytes_skipped"]
    create_table_artifact(list(per_job.values()) or [{"job": "-", "verified": 0, "corrupt": 0, "errors": 0}],
                          key="verification", description="Verification results per job")


def corruption_in(report: dict[str, Any], scans: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The corrupt checkpoints (and degraded copies) a verify report holds, plus
    those scans found corrupt (files their manifest lists missing past the grace)."""
    corrupt = [r for r in report["checkpoints"] if r["state"] in ("corrupt", "degraded")]
    return corrupt + [{**c, "tier": "hot"} for scan in scans for c in scan.get("corrupt_found", ())]


def raise_on_corruption(report: dict[str, Any], scans: Sequence[dict[str, Any]] = ()) -> None:
    """Emit an event per corrupt checkpoint (:func:`corruption_in`) and fail the run."""
    corrupt = corruption_in(report, scans)
    if not corrupt:
        return
    for r in corrupt:
        emit_checkpoint_event(CORRUPTION_FOUND, r["job"], r["step"], tier=r.get("tier", "hot"), detail=r["detail"])
    names = ", ".join(f"{r['job']} step {r['step']}" for r in corrupt[:5])
    raise CorruptionFound(f"{len(corrupt)} corrupt checkpoint(s): {names}; see the 'verification' artifact")


@flow(name="scan")
def scan_flow(
    urls: list[str],
    catalog_url: str | None = None,
    config_path: str | None = None,
    inventory: str | None = None,
    full: bool = False,
) -> list[dict[str, Any]]:
    """Catalog every checkpoint under each URL; publishes the ``catalog-summary`` table.

    Args:
        urls: Where checkpoints are written: paths, file:///path or s3://bucket/prefix.
        catalog_url: Catalog SQLAlchemy URL (default: CKPTIER_CATALOG_URL, else the config's [catalog] url, else SQLite in the data dir).
        config_path: ckptier.toml path, read for its [catalog] url (default: CKPTIER_CONFIG or ./ckptier.toml).
        inventory: S3 Inventory report read instead of listing (one s3:// URL only); else ckptier.toml's [[inventory]].
        full: List every local directory, even those unchanged since the last scan.
    """
    catalog_url = resolve_catalog_url(catalog_url, config_path)
    reports = [scan_task(url, catalog_url, inventory=inventory, full=full) for url in urls]
    publish_catalog_summary(catalog_url)
    return reports


@flow(name="verify")
def verify_flow(
    job: str | None = None,
    deep: bool = False,
    sample: str | None = None,
    workers: int = 4,
    catalog_url: str | None = None,
    config_path: str | None = None,
) -> dict[str, Any]:
    """Verify checkpoints; fails the run (and emits an event) when corruption is found.

    Args:
        job: Only this job (default: every job).
        deep: Read every byte even when the store keeps a full-object checksum.
        sample: K/N verifies the K-th of N disjoint slices; auto/N picks tonight's slice.
        workers: Files read in parallel.
        catalog_url: Catalog SQLAlchemy URL (default: CKPTIER_CATALOG_URL, else the config's [catalog] url, else SQLite in the data dir).
        config_path: ckptier.toml path, read for its [catalog] url (default: CKPTIER_CONFIG or ./ckptier.toml).
    """
    catalog_url = resolve_catalog_url(catalog_url, config_path)
    report = verify_task(catalog_url, job, deep, resolve_sample(sample, datetime.now(UTC)), workers)
    publish_verification(report)
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
) -> dict[str, Any]:
    """Scan, then verify: the hourly (and, with ``sample``, nightly) catalog upkeep.

    Args:
        urls: Where checkpoints are written: paths, file:///path or s3://bucket/prefix.
        verify: Verify new and changed checkpoints after scanning.
        deep: Read every byte even when the store keeps a full-object checksum.
        sample: K/N or auto/N: deep-read one slice of the catalog (every byte every N runs).
        workers: Files read in parallel.
        catalog_url: Catalog SQLAlchemy URL (default: CKPTIER_CATALOG_URL, else the config's [catalog] url, else SQLite in the data dir).
        config_path: ckptier.toml path, read for its [catalog] url (default: CKPTIER_CONFIG or ./ckptier.toml).
    """
    catalog_url = resolve_catalog_url(catalog_url, config_path)
    scans = [scan_task(url, catalog_url) for url in urls]
    result: dict[str, Any] = {"scans": scans}
    if verify:
        report = verify_task(catalog_url, None, deep, resolve_sample(sample, datetime.now(UTC)), workers)
        publish_verification(report)
        result["verify"] = report
    # One summary per run, after verification has settled the states.
    publish_catalog_summary(catalog_url)
    raise_on_corruption(result.get("verify", {"checkpoints": []}), scans)
    return result
