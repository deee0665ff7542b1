"""What the drill history says: recovery success rate and environment drift.

Pure functions of the catalog's drill records (:class:`~ckptier.storage.catalog.api.DrillRecord`)
and a time; nothing here reads the clock or the catalog.

* **Recovery success rate**: of the drills that judged a checkpoint
  (``passed`` or ``failed``; ``not judged`` ones do not count) in the last
  7 or 30 days, the fraction that passed; per job and over every job.
* **Environment drift**: a checkpoint that passed a drill under one stack
  (python, torch, CUDA, the format's libraries) and then failed under
  another. The checkpoint's bytes are proven unchanged by verification, so
  what changed is the environment: the report names the versions that did.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from ckptier.storage.catalog.api import DrillRecord

WINDOWS_DAYS = (7, 30)
"""The windows over which the recovery success rate is reported."""

RATE_ALERT_BELOW = 0.8
"""A job whose drills passed less often than this over the last 7 days (at
least :data:`RATE_ALERT_MIN_JUDGED` judged) raises a ``recovery-rate`` alert."""

RATE_ALERT_MIN_JUDGED = 2
"""Judged drills a window needs before its rate can raise an alert (one failed drill alerts as ``drill-failed``)."""

ALL_JOBS = "(all jobs)"
"""The job name of the overall rate."""


@dataclass(frozen=True)
class RecoveryRate:
    """Drills of ``job`` (or :data:`ALL_JOBS`) in the last ``days`` days:
    ``passed`` of ``judged``; ``rate`` None when none judged."""

    job: str
    days: int
    passed: int
    judged: int

    @property
    def rate(self) -> float | None:
        return self.passed / self.judged if self.judged else None

    def text(self) -> str:
        """``3 of 4 judged drills passed in the last 7 days (75%)``."""
        if not self.judged:
            return f"no judged drill in the last {self.days} days"
        return (f"{self.passed} of {self.judged} judged drill{'s' if self.judged > 1 else ''} passed in the last "
                f"{self.days} days ({100 * self.passed / self.judged:.0f}%)")


def _at(d: DrillRecord) -> datetime:
    return d.finished_at or d.started_at


def recovery_rate(drills: Iterable[DrillRecord], *, job: str, days: int, now: datetime) -> RecoveryRate:
    """Passed / judged among ``drills`` that ended in the last ``days`` days (``job``: the name it reports)."""
    since = now - timedelta(days=days)
    judged = [d for d in drills if d.judged and since <= _at(d) <= now]
    return RecoveryRate(job, days, sum(1 for d in judged if d.ok), len(judged))


def recovery_rates(by_job: Mapping[str, Sequence[DrillRecord]], *, now: datetime,
                   windows: Sequence[int] = WINDOWS_DAYS) -> list[RecoveryRate]:
    """Each job's rate per window, in job order, then :data:`ALL_JOBS`' over every job's drills."""
    out = [recovery_rate(drills, job=job, days=days, now=now) for job, drills in sorted(by_job.items()) for days in windows]
    every = [d for drills in by_job.values() for d in drills]
    out += [recovery_rate(every, job=ALL_JOBS, days=days, now=now) for days in windows]
    return out


@dataclass(frozen=True)
class Drift:
    """Checkpoint ``job`` step ``step`` passed at ``passed_at`` and failed at
    ``failed_at`` (its most recent judged drill), and the stack changed in
    between: ``changed`` maps each version that differs to ``(then, now)``."""

    job: str
    step: int | None
    checkpoint_id: int | None
    passed_at: datetime
    failed_at: datetime
    changed: Mapping[str, tuple[str | None, str | None]]
    summary: str

    def text(self) -> str:
        """One line naming the versions that changed."""
        versions = ", ".join(f"{k} {a or 'absent'} -> {b or 'absent'}" for k, (a, b) in sorted(self.changed.items()))
        return (f"step {self.step} passed its drill at {self.passed_at.isoformat()} and failed at "
                f"{self.failed_at.isoformat()} under another stack ({versions}): environment drift, not the "
                "checkpoint; pin the versions it passed under or fix the drill's environment")


def stack_changes(before: Mapping[str, str | None], after: Mapping[str, str | None]) -> dict[str, tuple[str | None, str | None]]:
    """The versions that differ between two stacks, ``name -> (before, after)``; a name only one records is not compared."""
    return {k: (before[k], after[k]) for k in sorted(set(before) & set(after)) if before[k] != after[k]}


def environment_drift(drills: Iterable[DrillRecord]) -> list[Drift]:
    """Checkpoints whose most recent judged drill failed under another stack
    than their most recent passed drill before it; pure. Drills without a
    recorded stack are not compared. Ordered by job, then step."""
    by_checkpoint: dict[int | tuple[str, int | None], list[DrillRecord]] = {}
    for d in drills:
        if d.judged:
            by_checkpoint.setdefault(d.checkpoint_id if d.checkpoint_id is not None else (d.job, d.step), []).append(d)
    out = []
    for history in by_checkpoint.values():
        history.sort(key=lambda d: (d.started_at, d.id or 0))
        last = history[-1]
        if last.ok or not last.stack:
            continue
        passed = next((d for d in reversed(history[:-1]) if d.ok), None)
        if passed is None or not passed.stack:
            continue
        changed = stack_changes(passed.stack, last.stack)
        if changed:
            summary = str(last.verdict.get("summary") or last.error or "") if isinstance(last.verdict, Mapping) else ""
            out.append(Drift(last.job, last.step, last.checkpoint_id, _at(passed), _at(last), changed, summary))
    return sorted(out, key=lambda d: (d.job, d.step if d.step is not None else -1))
