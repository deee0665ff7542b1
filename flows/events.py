"""Prefect events ckptier emits, so automations can alert on them."""

from __future__ import annotations

from typing import Any

from prefect.events import emit_event

CORRUPTION_FOUND = "ckptier.corruption.found"
DRILL_FAILED = "ckptier.drill.failed"


def emit_checkpoint_event(event: str, job: str, step: int, **payload: Any) -> None:
    """Emit ``event`` about checkpoint ``job``/``step`` (resource ``ckptier.checkpoint.<job>.<step>``)."""
    emit_event(
        event=event,
        resource={"prefect.resource.id": f"ckptier.checkpoint.{job}.{step}",
                  "prefect.resource.name": f"{job} step {step}", "ckptier.job": job},
        payload={"job": job, "step": step, **payload},
    )
