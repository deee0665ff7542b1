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
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from ckptier.storage.catalog.api import Catalog
from ckptier.tasks.config import load_config
from ckptier.tasks.prefect_tasks import apply_task, plan_task
from ckptier.tasks.settings import catalog_url as resolve_catalog_url
from ckptier.tasks.settings import require_written_policy



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
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

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


def cataloged_jobs(catalog_url: str | None, config_path: str | None) -> list[str]:
    config = load_config(config_path)
    with Catalog.open(resolve_catalog_url(catalog_url, config_path, config=config), create=False) as cat:
        return cat.jobs()


def publish_plan(rows: list[dict[str, Any]]) -> None:
    """Table artifact ``retention-plan`` with a bytes-saved summary in its description."""
    deleted = sum(r["bytes"] for r in rows if r["action"] == "delete")
    total = sum(r["bytes"] for r in rows)
    table = [{"job": r["job"], "step": r["step"], "state": r["state"], "action": r["action"], "scope": r["scope"],
              "bytes": r["bytes"], "reasons": "; ".join(r["reasons"])} for r in rows]
    create_table_artifact(
        table or [{"job": "-", "step": "-", "action": "-", "reasons": "no checkpoints"}],
        key="retention-plan",
        description=f"Retention plan: {deleted:,} of {total:,} hot bytes can be freed ({deleted / total:.0%})" if total
        else "Retention plan: nothing cataloged",
    )


@flow(name="tiering")
def tiering_flow(
    apply: bool = False,
    job: str | None = None,
    config_path: str | None = None,
    catalog_url: str | None = None,
    lease_minutes: int = 60,
) -> dict[str, Any]:
    """Plan retention and, with ``apply``, promote milestones and delete rolling checkpoints.

    Args:
        apply: Carry out the plan. Off (the default) is a dry run that only publishes the plan.
        job: Only this job (default: every job).
        config_path: ckptier.toml with the [[policy]] tables (default: CKPTIER_CONFIG or ./ckptier.toml).
        catalog_url: Catalog SQLAlchemy URL (default: CKPTIER_CATALOG_URL, else the config's [catalog] url, else SQLite).
        lease_minutes: How long this run waits for another tiering run of the same job to finish
            (checkpoint leases themselves are short and kept alive while the run lives).
    """
    catalog_url = resolve_catalog_url(catalog_url, config_path)
    jobs = [job] if job else cataloged_jobs(catalog_url, config_path)
    if apply:  # deletes only under a [[policy]] someone wrote; a dry run may preview the default
        require_written_policy(load_config(config_path), jobs, config_path)
    locks = tiering_lock_names(job, jobs)
    with hold_job_locks(locks, timeout_seconds=lease_minutes * 60.0):
        rows = plan_task(catalog_url, config_path, job)
        publish_plan(rows)
        report = apply_task(catalog_url, config_path, job, not apply)
    if report["failed"]:
        raise RuntimeError("tiering: some items failed; re-run to resume: " + "; ".join(report["lines"][-3:]))
    return {"plan": rows, "apply": report}
