"""Prefect events ckptier emits, so automations can alert on them.

Each event names what it is about as its resource (a checkpoint
``ckptier.checkpoint.<job>.<step>``, a job ``ckptier.job.<job>``, or
``ckptier.jobs`` for a run over every job) and, inside a flow run, the run
as a related resource (role ``flow-run``); its payload carries
``flow_run_url`` (the run's page in the Prefect UI) and, when
``CKPTIER_DASHBOARD_URL`` is set, ``dashboard_url`` (the job's page on the
ckptier dashboard), which the alert templates in
``deployments/automations.yaml`` link to.
"""

from __future__ import annotations

import os
from typing import Any

from prefect.events import emit_event

from ckptier.tasks.reports import dashboard_job_url

CORRUPTION_FOUND = "ckptier.corruption.found"
DRILL_FAILED = "ckptier.drill.failed"
DRILL_NOT_JUDGED = "ckptier.drill.not-judged"
ENVIRONMENT_DRIFT = "ckptier.drill.drift"


def current_run() -> dict[str, str]:
    """``flow_run_id``, ``flow_run_name`` and ``flow_run_url`` of the flow run this code runs in ({} outside one)."""
    from prefect.runtime import flow_run
    from prefect.utilities.urls import url_for

    run_id = flow_run.get_id()
    if not run_id:
        return {}
    out = {"flow_run_id": str(run_id), "flow_run_name": str(flow_run.get_name() or "")}
    url = url_for("flow-run", obj_id=run_id)  # None when no UI is known (Prefect's temporary local API)
    if url:
        out["flow_run_url"] = url
    return out


def emit_ckptier_event(event: str, job: str | None, step: int | None, **payload: Any) -> None:
    """Emit ``event`` about ``job``/``step`` (either may be None), linked to the current flow run and,
    when ``CKPTIER_DASHBOARD_URL`` is set, to the job's dashboard page."""
    if job is not None and step is not None:
        resource = {"prefect.resource.id": f"ckptier.checkpoint.{job}.{step}",
                    "prefect.resource.name": f"{job} step {step}", "ckptier.job": job}
    elif job is not None:
        resource = {"prefect.resource.id": f"ckptier.job.{job}", "prefect.resource.name": job, "ckptier.job": job}
    else:
        resource = {"prefect.resource.id": "ckptier.jobs", "prefect.resource.name": "every job"}
    run = current_run()
    related = [{"prefect.resource.id": f"prefect.flow-run.{run['flow_run_id']}", "prefect.resource.role": "flow-run",
                "prefect.resource.name": run["flow_run_name"]}] if run else []
    links = {k: v for k, v in run.items() if k in ("flow_run_id", "flow_run_url")}
    dashboard = dashboard_job_url(job, os.environ) if job is not None else None
    if dashboard:
        links["dashboard_url"] = dashboard
    emit_event(event=event, resource=resource, related=related, payload={"job": job, "step": step, **payload, **links})


def emit_checkpoint_event(event: str, job: str, step: int, **payload: Any) -> None:
    """Emit ``event`` about checkpoint ``job``/``step`` (resource ``ckptier.checkpoint.<job>.<step>``)."""
    emit_ckptier_event(event, job, step, **payload)
