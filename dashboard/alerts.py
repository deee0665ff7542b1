"""Alerts and the judgements behind the overview: pure functions of catalog facts.

Every alert says what is wrong, where (job, steps) and what to do, in one
line. Times are passed in; nothing here reads the clock or the database.

Kinds, most severe first:

=====================  ========  ==================================================
kind                   severity  when
=====================  ========  ==================================================
``only-copy-at-risk``  critical  an archive copy is degraded and no hot copy holds
                                 the checkpoint any more
``corrupt``            error     a checkpoint's bytes failed verification
``drill-failed``       error     the job's most recent restore drill failed
``environment-drift``  error     a checkpoint passed a drill under one stack and
                                 failed under another (the versions that changed)
``recovery-rate``      warning   fewer than 80% of the job's judged drills passed
                                 over the last 7 days
``degraded``           warning   an archive copy is degraded; the hot copy is intact
``deletion-suspended`` warning   the retention planner's shrink guard holds every
                                 deletion of the job (too many checkpoints missing)
``stale``              warning   no new checkpoint for longer than
                                 :data:`STALE_AFTER_INTERVALS` times the job's usual
                                 interval (the median gap of its newest saves), and
                                 for at least :data:`STALE_AT_LEAST`
=====================  ========  ==================================================
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from ckptier.storage.records import CheckpointRecord, Format, State
from ckptier.tasks.drill_history import RATE_ALERT_BELOW, RATE_ALERT_MIN_JUDGED, Drift, RecoveryRate
from ckptier.tasks.retention import Policy, shrink_guard

SEVERITIES = ("critical", "error", "warning")
#: A job is stale when its newest save is older than this many usual intervals...
STALE_AFTER_INTERVALS = 2.0
#: ...and older than this, so that a job saving every minute does not alert on a pause for evaluation.
STALE_AT_LEAST = timedelta(minutes=10)
#: Saves needed before a job has a "usual" interval (gaps = saves - 1).
MIN_SAVES_FOR_INTERVAL = 3
#: Steps named in an alert before "+N more".
STEPS_SHOWN = 5


@dataclass(frozen=True)
class Alert:
    """One thing an operator must look at."""

    job: str
    kind: str
    severity: str
    message: str
    steps: tuple[int, ...] = ()

    @property
    def rank(self) -> int:
        return SEVERITIES.index(self.severity)


def steps_text(steps: Sequence[int]) -> str:
    """``"steps 1, 2, 3 (+4 more)"`` / ``"step 7"``."""
    shown = ", ".join(str(s) for s in steps[:STEPS_SHOWN])
    more = len(steps) - STEPS_SHOWN
    return ("step " if len(steps) == 1 else "steps ") + shown + (f" (+{more} more)" if more > 0 else "")


def format_age(delta: timedelta | None) -> str:
    """``timedelta(hours=26, minutes=5)`` → ``"1d 2h"``; two units at most; ``"-"`` for None."""
    if delta is None:
        return "-"
    if 0 < abs(delta.total_seconds()) < 1:
        return "<1s"
    seconds = int(delta.total_seconds())
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        n, seconds = divmod(seconds, size)
        if n or (unit == "s" and not parts):
            parts.append(f"{n}{unit}")
        if len(parts) == 2:
            break
    return sign + " ".join(parts)


# ------------------------------------------------------------------ proof


def proof_level(state: str, last_drill_ok: bool | None) -> str:
    """A checkpoint's proof: ``committed`` < ``verified`` (every file's bytes
    matched) < ``drilled`` (verified, and its most recent drill passed); ""
    for incomplete, corrupt and deleted checkpoints, which prove nothing."""
    if state == "committed":
        return "committed"
    if state != "verified":
        return ""
    return "drilled" if last_drill_ok else "verified"


# ------------------------------------------------------------------ problems found by verification


@dataclass(frozen=True)
class Problem:
    """A corrupt checkpoint or a degraded archive copy (``hot``: a hot copy still holds it)."""

    step: int
    problem: str  # "corrupt" | "degraded"
    hot: bool
    detail: str | None = None


def problem_alerts(job: str, problems: Sequence[Problem]) -> list[Alert]:
    """The corrupt / degraded / only-copy-at-risk alerts of one job."""
    alerts: list[Alert] = []
    corrupt = sorted(p.step for p in problems if p.problem == "corrupt")
    if corrupt:
        first = next(p for p in problems if p.problem == "corrupt" and p.step == corrupt[0])
        why = f": {first.detail}" if first.detail and len(corrupt) == 1 else ""
        alerts.append(Alert(job, "corrupt", "error",
                            f"{len(corrupt)} corrupt checkpoint{'s' if len(corrupt) > 1 else ''} ({steps_text(corrupt)}){why}; "
                            "kept as evidence, never resumed from or drilled; restore the files or retrain from an earlier step",
                            tuple(corrupt)))
    only = sorted(p.step for p in problems if p.problem == "degraded" and not p.hot)
    if only:
        alerts.append(Alert(job, "only-copy-at-risk", "critical",
                            f"the only copy of {steps_text(only)} is a damaged archive copy: restore it from elsewhere "
                            "now, then run 'ckptier verify --deep'", tuple(only)))
    backed = sorted(p.step for p in problems if p.problem == "degraded" and p.hot)
    if backed:
        alerts.append(Alert(job, "degraded", "warning",
                            f"{len(backed)} degraded archive cop{'ies' if len(backed) > 1 else 'y'} ({steps_text(backed)}); "
                            "the hot copies are intact: re-run 'ckptier apply' to archive them again", tuple(backed)))
    return alerts


# ------------------------------------------------------------------ deletion suspended


def suspension_alert(job: str, live: int, missing: int, policy: Policy | None) -> Alert | None:
    """The retention planner's own shrink guard, judged from counts.

    ``live``: the job's checkpoints not deleted; ``missing``: how many of
    them a scan no longer finds in hot storage. ``policy``: the job's
    ``[[policy]]`` (None: nothing is ever deleted, so nothing is suspended).
    The verdict and its wording are :func:`ckptier.tasks.retention.shrink_guard`'s.
    """
    if policy is None or live <= 0 or missing <= 0:
        return None
    # shrink_guard only counts; two records stand for the job's rows.
    t0 = datetime(1970, 1, 1, tzinfo=UTC)
    gone = CheckpointRecord(id=0, job=job, step=0, format=Format.GUIDE, state=State.VERIFIED, location="", bytes=0,
                            saved_at=None, first_seen=t0, last_seen=t0, missing_since=t0, verified_at=None,
                            state_reason=None)
    here = CheckpointRecord(id=1, job=job, step=1, format=Format.GUIDE, state=State.VERIFIED, location="", bytes=0,
                            saved_at=None, first_seen=t0, last_seen=t0, missing_since=None, verified_at=None,
                            state_reason=None)
    reason = shrink_guard([gone] * missing + [here] * (live - missing), policy.max_missing_fraction)
    return None if reason is None else Alert(job, "deletion-suspended", "warning", reason)


# ------------------------------------------------------------------ no new checkpoint


def usual_interval(saved: Sequence[datetime]) -> timedelta | None:
    """The median gap between consecutive saves (any order given), None with
    fewer than :data:`MIN_SAVES_FOR_INTERVAL` saves or no positive gap."""
    times = sorted(saved)
    gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
    if len(times) < MIN_SAVES_FOR_INTERVAL or not gaps:
        return None
    ordered = sorted(gaps)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def stale_alert(job: str, newest_step: int | None, newest_saved: datetime | None, interval: timedelta | None,
                *, now: datetime) -> Alert | None:
    """Alert when the newest save is older than :data:`STALE_AFTER_INTERVALS` usual
    intervals and than :data:`STALE_AT_LEAST`."""
    if newest_saved is None or interval is None or newest_step is None:
        return None
    age = now - newest_saved
    if age <= max(interval * STALE_AFTER_INTERVALS, STALE_AT_LEAST):
        return None
    return Alert(job, "stale", "warning",
                 f"no new checkpoint for {format_age(age)} (usual interval {format_age(interval)}; newest is step "
                 f"{newest_step}): is the training job still running and saving?", (newest_step,))


# ------------------------------------------------------------------ drills


def drill_alert(job: str, step: int | None, ok: bool | None, summary: str | None) -> Alert | None:
    """Alert when the job's most recent drill failed."""
    if ok is None or ok:
        return None
    where = f"step {step}" if step is not None else "a checkpoint"
    return Alert(job, "drill-failed", "error",
                 f"the last restore drill ({where}) failed: {summary or 'no detail recorded'}",
                 (step,) if step is not None else ())


def recovery_alerts(job: str, week: RecoveryRate, drift: Sequence[Drift]) -> list[Alert]:
    """``environment-drift`` per checkpoint that passed under one stack and
    failed under another; ``recovery-rate`` when the week's rate is low."""
    out = [Alert(job, "environment-drift", "error", d.text(), (d.step,) if d.step is not None else ()) for d in drift]
    rate = week.rate
    if rate is not None and week.judged >= RATE_ALERT_MIN_JUDGED and rate < RATE_ALERT_BELOW:
        out.append(Alert(job, "recovery-rate", "warning", f"{week.text()}: below {RATE_ALERT_BELOW:.0%}; "
                                                          "see the drill history for what fails"))
    return out


def sort_alerts(alerts: Sequence[Alert]) -> list[Alert]:
    """Most severe first, then by job and kind."""
    return sorted(alerts, key=lambda a: (a.rank, a.job, a.kind))
