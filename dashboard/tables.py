"""Every table the dashboard shows, computed once, with pandas.

The pages, their CSV/JSON downloads and ``ckptier report`` all ask a
:class:`Snapshot` for tables by name; :data:`TABLES` is the registry (adding
a table is one :class:`TableSpec` entry plus its build function). A snapshot
is one read of the catalog at one ``now``: each query runs at most once and
each table is built at most once, however many times it is asked for.

Definitions used throughout:

* **proof level** of a checkpoint: ``committed`` < ``verified`` (every
  file's bytes matched) < ``drilled`` (verified, and its most recent
  restore drill passed); ``incomplete``, ``corrupt`` and ``deleted``
  checkpoints have no proof.
* **recovery point** of a job: the highest-step checkpoint whose most recent
  drill passed, that is still verified and held by some copy; its age is
  ``now`` minus its save time.
* **keep-all bytes**: the logical size of every checkpoint ever cataloged
  (tombstones included) — what keeping everything hot would store;
  **saved** is keep-all minus hot bytes minus archive stored bytes.
* **verification coverage**: verified / (committed + verified) live checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cached_property
from typing import Any, Literal

import pandas as pd

from ckptier.storage.catalog.api import DrillRecord, RecoveryRecord
from ckptier.storage.errors import ConfigError
from ckptier.storage.records import CheckpointRecord, DrillOutcome
from ckptier.storage.transitions import latest_drill
from ckptier.tasks.costs import JobCosts
from ckptier.tasks.drill_history import ALL_JOBS, WINDOWS_DAYS, environment_drift, recovery_rate, recovery_rates
from ckptier.tasks.resume import recovery_rates as resume_rates

from . import alerts as al
from . import queries as q
from .history import from_deltas
from .security import redact
from .source import Source

Scope = Literal["catalog", "job", "checkpoint"]
Kind = Literal["text", "job", "step", "int", "bytes", "time", "age", "ratio", "bool", "verdict", "state", "proof",
               "severity", "mono", "float", "money", "rate"]
#: Drills read per job (newest first) for the overview and the job page.
DRILL_WINDOW = 200
#: Events shown per job.
EVENT_LIMIT = 300
STATES = ("incomplete", "committed", "verified", "corrupt", "deleted")


@dataclass(frozen=True)
class Column:
    """A column: its name (CSV/JSON key), how to show it, and a header."""

    name: str
    kind: Kind
    title: str
    help: str = ""


@dataclass(frozen=True)
class TableSpec:
    """A table of the registry.

    ``scope`` says which filters it needs: ``catalog`` (``job`` optional;
    with it, ``step`` where it makes sense), ``job`` (``job`` required) or
    ``checkpoint`` (both required). ``build`` returns a DataFrame with
    exactly ``columns``, in order.
    """

    name: str
    title: str
    scope: Scope
    columns: tuple[Column, ...]
    build: Callable[[Snapshot], pd.DataFrame]
    description: str

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]


class TableError(ConfigError):
    """A table asked for without the filters it needs, or an unknown table/job/step."""


# ------------------------------------------------------------------ the snapshot


class Snapshot:
    """One read of the catalog at ``now``, optionally narrowed to ``job`` / ``step``."""

    def __init__(self, source: Source, *, now: datetime, job: str | None = None, step: int | None = None) -> None:
        self.source = source
        self.now = now
        self.job = job
        self.step = step
        self._tables: dict[str, pd.DataFrame] = {}

    @property
    def catalog(self) -> Any:
        return self.source.catalog

    def table(self, name: str) -> pd.DataFrame:
        """The table ``name`` (see :data:`TABLES`); built once per snapshot."""
        spec = TABLES.get(name)
        if spec is None:
            raise TableError(f"unknown table {name!r}; choose one of {', '.join(TABLES)}")
        if spec.scope in ("job", "checkpoint") and self.job is None:
            raise TableError(f"table {name!r} is per job: give the job (--job J / ?job=J)")
        if self.step is not None and self.job is None:
            raise TableError(f"a step ({self.step}) needs its job (--job J / ?job=J)")
        if spec.scope == "checkpoint" and self.step is None:
            raise TableError(f"table {name!r} is per checkpoint: give the step too (--step N / ?step=N)")
        if name not in self._tables:
            df = spec.build(self)
            self._tables[name] = df[spec.column_names]
        return self._tables[name]

    # -- raw reads, each at most once ------------------------------------------------

    def _frame(self, stmt: Any) -> pd.DataFrame:
        return q.frame(self.source.engine, stmt)

    @cached_property
    def jobs(self) -> pd.DataFrame:
        df = self._frame(q.jobs(self.job))
        if self.job is not None and df.empty:
            raise TableError(f"job {self.job!r} is not in the catalog; see 'ckptier ls' for the jobs it holds")
        return df

    @cached_property
    def placement(self) -> pd.DataFrame:
        return self._frame(q.placement(self.job))

    @cached_property
    def saves(self) -> pd.DataFrame:
        """The newest :data:`queries.RECENT_SAVES` saves of each job: ``job``, ``step``, ``saved_at``."""
        df = q.frames(self.source.engine, [q.recent_saves(name) for name in self.jobs["job"]], ["job", "step", "saved_at"])
        df["saved_at"] = pd.to_datetime(df["saved_at"], utc=True)
        return df

    @cached_property
    def storage(self) -> pd.DataFrame:
        """Bytes held per tier over time, of ``job`` or of every job (:func:`.history.storage_history`'s
        series, aggregated in the database: :func:`.queries.storage_series`)."""
        return from_deltas(self._frame(q.storage_series(self.job)), now=self.now)

    @cached_property
    def problems(self) -> pd.DataFrame:
        return self._frame(q.problems(self.job))

    @cached_property
    def drills(self) -> dict[str, list[DrillRecord]]:
        """Each job's newest :data:`DRILL_WINDOW` drills, newest first (through :meth:`Catalog.drills`)."""
        return {name: self.catalog.drills(job=name, limit=DRILL_WINDOW) for name in self.jobs["job"]}

    @cached_property
    def recoveries(self) -> dict[str, list[RecoveryRecord]]:
        """Recovery events (``resume`` calls) of the longest rate window, by job, newest first: of
        the snapshot's job, or of every job asked about (a name the catalog does not know too)."""
        since = self.now - timedelta(days=max(WINDOWS_DAYS))
        out: dict[str, list[RecoveryRecord]] = {}
        for e in self.catalog.recoveries(job=self.job, since=since):
            out.setdefault(e.job, []).append(e)
        return out

    @cached_property
    def resumes(self) -> dict[tuple[str, int], tuple[int, int]]:
        """``(attempted, resumed)`` recoveries of each job and window (:data:`WINDOWS_DAYS`), and over
        every job (:data:`ALL_JOBS`), counting events started up to now: the same counts as
        ``ckptier report`` (:func:`ckptier.tasks.resume.recovery_rates`)."""
        events = [e for es in self.recoveries.values() for e in es if e.started_at <= self.now]
        out = {(r.job, int(r.days)): (r.attempted, r.resumed)
               for r in resume_rates(events, (), now=self.now, windows=WINDOWS_DAYS) if r.days is not None}
        for days in WINDOWS_DAYS:
            mine = [v for (_, d), v in out.items() if d == days]
            out[(ALL_JOBS, days)] = (sum(a for a, _ in mine), sum(r for _, r in mine))
        return out

    @cached_property
    def last_drills(self) -> dict[str, dict[int, DrillOutcome]]:
        """Per job shown, the most recent drill of each of its drilled checkpoints (by
        id), over all of the job's drills, not only the :data:`DRILL_WINDOW` the pages
        list: what each record's ``last_drill`` holds and ``latest --drilled`` goes by
        (:meth:`Catalog.last_drills`)."""
        return {name: self.catalog.last_drills(job=name) for name in self.jobs["job"]}

    @cached_property
    def drill_passed(self) -> pd.DataFrame:
        """Checkpoints whose most recent drill passed, with ``job``, ``step``,
        ``state``, ``saved_at`` and ``held`` (1 when a copy holds them)."""
        passed = {cid: name for name, outcomes in self.last_drills.items() for cid, d in outcomes.items() if d.ok}
        if not passed:
            return pd.DataFrame(columns=["id", "step", "state", "saved_at", "held", "job"])
        df = self._frame(q.restorable(sorted(passed)))
        df["job"] = [passed[int(cid)] for cid in df["id"]]
        return df

    @cached_property
    def policies(self) -> dict[str, Any]:
        return {name: self.source.config.policy_for(name) for name in self.jobs["job"]}

    @cached_property
    def record(self) -> CheckpointRecord:
        """The checkpoint ``job``/``step`` (tombstones included)."""
        assert self.job is not None and self.step is not None
        rec = self.catalog.get(self.job, self.step)
        if rec is None:
            raise TableError(f"job {self.job!r} has no step {self.step} in the catalog; see 'ckptier ls --job {self.job} --all'")
        return rec

    @cached_property
    def records(self) -> list[CheckpointRecord]:
        """Every checkpoint of ``job``, tombstones included, with copies (no files)."""
        self.jobs  # noqa: B018 - raises for an unknown job
        return list(self.catalog.checkpoints(job=self.job, include_deleted=True, with_files=False))

    @cached_property
    def plan(self) -> Any:
        """The job's retention plan now (``ckptier plan --job J``), or None when it has no live checkpoint."""
        from ckptier.tasks.pipeline import merge_plans, plans_by_policy
        from ckptier.tasks.run import Run

        try:
            run = Run.of(self.catalog, config=self.source.config, now=lambda: self.now)
            return merge_plans([p for _, p in plans_by_policy(run, job=self.job, records=self.records)])
        except ConfigError:
            return None

    @cached_property
    def costs(self) -> list[JobCosts]:
        """Each job's :class:`~ckptier.tasks.costs.JobCosts` (``ckptier report --costs``): from
        the records (tombstones included), the drills read and the config's policies and prices."""
        from ckptier.tasks.costs import cost_tables

        drills = [d for ds in self.drills.values() for d in ds]
        return cost_tables(self.records, drills, self.source.config, now=self.now)

    def proof(self, record: CheckpointRecord) -> str:
        """The proof level of a checkpoint (:func:`alerts.proof_level`)."""
        drill = record.last_drill
        return al.proof_level(record.state.value, drill.ok if drill is not None else None)


# ------------------------------------------------------------------ helpers


def _age_s(now: datetime, t: Any) -> float | None:
    if t is None or (isinstance(t, float) and math.isnan(t)) or t is pd.NaT:
        return None
    return round((pd.Timestamp(now) - pd.Timestamp(t)).total_seconds(), 3)


def _opt(v: Any) -> Any:
    """None for NaN/NaT, the value otherwise."""
    if v is None or v is pd.NaT:
        return None
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def _records(rows: Iterable[Mapping[str, Any]], spec_name: str) -> pd.DataFrame:
    return pd.DataFrame.from_records(list(rows), columns=TABLES[spec_name].column_names)


def _drill_summary(d: DrillRecord) -> str:
    summary = d.verdict.get("summary") if isinstance(d.verdict, Mapping) else None
    return redact(str(summary or d.error or ("ok" if d.ok else "failed"))) or ""


def _first_loss(d: DrillRecord) -> float | None:
    losses = d.verdict.get("losses") if isinstance(d.verdict, Mapping) else None
    if isinstance(losses, list) and losses and isinstance(losses[0], (int, float)):
        return float(losses[0])
    return None


# ------------------------------------------------------------------ catalog tables


#: Where a live checkpoint's bytes are held, by (hot held, archive held).
_HELD_LABELS = {(1, 0): "hot_only", (1, 1): "hot_and_archive", (0, 1): "archive_only", (0, 0): "no_copy"}


def _per_job(frame: pd.DataFrame, column: str, how: str, names: Sequence[str], *, fill: Any = 0) -> pd.Series:
    """``frame[column]`` aggregated per job (``sum``/``min``/``max``), one value per name in ``names``."""
    if frame.empty:
        return pd.Series([fill] * len(names), index=list(names), dtype=object if fill is None else None)
    agg = frame.groupby("job", sort=False)[column].agg(how)
    return agg.reindex(list(names), fill_value=fill)


def build_jobs(s: Snapshot) -> pd.DataFrame:
    """One row per job: counts by state/proof/tier, bytes, coverage, drills, recovery point, alerts."""
    names = list(s.jobs["job"])
    pl = s.placement
    live = pl[pl["state"] != "deleted"]
    states = (pl.groupby(["job", "state"], sort=False)["count"].sum().unstack(fill_value=0)
              .reindex(index=names, columns=list(STATES), fill_value=0)) if len(pl) else \
        pd.DataFrame(0, index=names, columns=list(STATES))
    where = live.assign(held=[_HELD_LABELS[(int(h), int(a))] for h, a in zip(live["hot"], live["archive"], strict=True)])
    held = (where.groupby(["job", "held"], sort=False)["count"].sum().unstack(fill_value=0)
            .reindex(index=names, columns=list(_HELD_LABELS.values()), fill_value=0)) if len(where) else \
        pd.DataFrame(0, index=names, columns=list(_HELD_LABELS.values()))
    archive_logical = _per_job(pl[pl["archive"] == 1], "bytes", "sum", names)
    passed = s.drill_passed
    is_drilled = [al.proof_level(str(state), True) == "drilled" for state in passed["state"]]
    drilled = _per_job(passed.assign(n=[int(d) for d in is_drilled]), "n", "sum", names)
    held_ok = passed[pd.Series(is_drilled, index=passed.index, dtype=bool) & (passed["held"] == 1)]
    recovery = held_ok.loc[held_ok.groupby("job")["step"].idxmax()].set_index("job") if len(held_ok) else None
    hot_bytes = _per_job(pl, "hot_bytes", "sum", names)
    archive_stored = _per_job(pl, "archive_bytes", "sum", names)
    keep_all = _per_job(pl, "bytes", "sum", names)
    oldest = _per_job(pl[pl["state"] == "verified"], "oldest_verified_at", "min", names, fill=None)
    saves = s.saves
    newest = saves.loc[saves.groupby("job")["step"].idxmax()].set_index("job") if len(saves) else None
    times = {name: [t.to_pydatetime() for t in g["saved_at"].dropna()] for name, g in saves.groupby("job", sort=False)}
    alerts = s.table("alerts")
    n_alerts = alerts.groupby("job", sort=False).size() if len(alerts) else pd.Series(dtype=int)
    worst = alerts.groupby("job", sort=False)["severity"].first() if len(alerts) else pd.Series(dtype=object)
    rows = []
    for name in names:
        verified_all, committed = int(states.at[name, "verified"]), int(states.at[name, "committed"])
        n_drilled = int(drilled[name])
        rec = recovery.loc[name] if recovery is not None and name in recovery.index else None
        top = newest.loc[name] if newest is not None and name in newest.index else None
        interval = al.usual_interval(times.get(name, []))
        last = latest_drill(s.drills.get(name) or [])  # its most recent judged drill (not judged: history only)
        last_at = (last.finished_at or last.started_at) if last else None
        hb, ab, ka = int(hot_bytes[name]), int(archive_stored[name]), int(keep_all[name])
        newest_saved = _opt(top["saved_at"]) if top is not None else None
        rows.append({
            "job": name,
            "checkpoints": int(states.loc[name].sum() - states.at[name, "deleted"]),
            "incomplete": int(states.at[name, "incomplete"]),
            "committed": committed,
            "verified": verified_all - n_drilled,
            "drilled": n_drilled,
            "corrupt": int(states.at[name, "corrupt"]),
            "deleted": int(states.at[name, "deleted"]),
            **{label: int(held.at[name, label]) for label in _HELD_LABELS.values()},
            "hot_bytes": hb,
            "archive_stored_bytes": ab,
            "archive_logical_bytes": int(archive_logical[name]),
            "keep_all_bytes": ka,
            "saved_bytes": ka - hb - ab,
            "saved_fraction": round((ka - hb - ab) / ka, 4) if ka else None,
            "verified_coverage": round(verified_all / (committed + verified_all), 4) if committed + verified_all else None,
            "oldest_verified_at": _opt(oldest[name]),
            "oldest_verification_age_s": _age_s(s.now, _opt(oldest[name])),
            "last_drill_at": last_at,
            "last_drill_age_s": _age_s(s.now, last_at),
            "last_drill_step": last.step if last else None,
            "last_drill_ok": last.ok if last else None,
            **{f"drill_success_{days}d": recovery_rate(s.drills.get(name) or [], job=name, days=days, now=s.now).rate
               for days in (7, 30)},
            **{f"{key}_{days}d": n for days in (7, 30) for key, n in
               zip(("resumes", "resumed"), s.resumes.get((name, days), (0, 0)), strict=True)},
            "recovery_step": int(rec["step"]) if rec is not None else None,
            "recovery_saved_at": _opt(rec["saved_at"]) if rec is not None else None,
            "recovery_age_s": _age_s(s.now, _opt(rec["saved_at"])) if rec is not None else None,
            "newest_step": int(top["step"]) if top is not None else None,
            "newest_saved_at": newest_saved,
            "newest_save_age_s": _age_s(s.now, newest_saved),
            "usual_interval_s": interval.total_seconds() if interval is not None else None,
            "alerts": int(n_alerts.get(name, 0)),
            "worst_alert": worst.get(name),  # alerts come most severe first
        })
    df = _records(rows, "jobs")
    for col in ("last_drill_step", "recovery_step", "newest_step"):
        df[col] = df[col].astype("Int64")
    return df


def build_alerts(s: Snapshot) -> pd.DataFrame:
    """Every alert of every job (or of ``job``), most severe first."""
    found: list[al.Alert] = []
    problems: dict[str, list[al.Problem]] = {}
    for row in s.problems.itertuples(index=False):
        problems.setdefault(row.job, []).append(
            al.Problem(step=int(row.step), problem=str(row.problem), hot=bool(row.hot), detail=redact(_opt(row.detail))))
    pl = s.placement
    live = pl[pl["state"] != "deleted"]
    counts = live.groupby("job")[["count", "missing"]].sum() if len(live) else None
    saves = dict(tuple(s.saves.groupby("job", sort=False)))
    for name in s.jobs["job"]:
        found.extend(al.problem_alerts(name, problems.get(name, [])))
        if counts is not None and name in counts.index:
            a = al.suspension_alert(name, int(counts.loc[name, "count"]), int(counts.loc[name, "missing"]),
                                    s.policies.get(name))
            if a:
                found.append(a)
        sv = saves.get(name)
        if sv is not None and len(sv):
            times = [t.to_pydatetime() for t in sv["saved_at"].dropna()]
            top = sv.loc[sv["step"].idxmax()]
            a = al.stale_alert(name, int(top["step"]), max(times) if times else None, al.usual_interval(times), now=s.now)
            if a:
                found.append(a)
        drills = [d for d in s.drills.get(name, []) if d.judged]  # not judged: history only
        if drills:
            a = al.drill_alert(name, drills[0].step, drills[0].ok, _drill_summary(drills[0]))
            if a:
                found.append(a)
        found.extend(al.recovery_alerts(name, recovery_rate(drills, job=name, days=7, now=s.now),
                                        environment_drift(drills)))
    rows = [{"severity": a.severity, "job": a.job, "kind": a.kind, "steps": ", ".join(map(str, a.steps)),
             "message": redact(a.message), "rank": a.rank} for a in al.sort_alerts(found)]
    return _records(rows, "alerts")


# ------------------------------------------------------------------ job tables


def _shown_copy(copies: Sequence[tuple[str, int | None]]) -> tuple[str, int | None] | None:
    """The copy of one tier a checkpoint's row shows, of its copies there as ``(state, stored_bytes)``
    in the catalog's order: the first that holds the bytes (:data:`queries.HELD`), else the first."""
    for copy in copies:
        if copy[0] in q.HELD:
            return copy
    return copies[0] if copies else None


def build_checkpoints(s: Snapshot) -> pd.DataFrame:
    """Every checkpoint of the job (of ``step`` alone when given), tombstones included, by step.

    Built from the columns the table shows, read straight from the database
    (:func:`.queries.checkpoint_columns` and the copies'
    :func:`.queries.checkpoint_copy_columns`: tuples, no record per row, times
    converted in one vectorized pass), column by column: a reason is redacted
    once per distinct text, the proof level (:func:`alerts.proof_level`) computed once
    per state and drill verdict, the policy asked of every step at once
    (:meth:`Policy.are_milestones`), and each checkpoint's most recent drill is the
    catalog's over all its drills (:attr:`Snapshot.last_drills`, what each record's
    ``last_drill`` holds).
    """
    s.jobs  # noqa: B018 - raises for an unknown job
    assert s.job is not None
    policy = s.policies.get(s.job)
    engine = s.source.engine
    rows = q.tuples(engine, q.checkpoint_columns(s.job, s.step))
    copies: dict[tuple[int, str], list[tuple[str, int | None]]] = {}
    for cid, tier, state, stored in q.tuples(engine, q.checkpoint_copy_columns(s.job, s.step)):
        copies.setdefault((cid, tier), []).append((state, stored))
    drills = s.last_drills.get(s.job, {})
    ids, steps, fmts, states, sizes, reasons, saved, verified, gone = (list(c) for c in zip(*rows, strict=True)) \
        if rows else ([] for _ in range(9))
    oks = [d.ok if (d := drills.get(cid)) is not None else None for cid in ids]
    proofs: dict[tuple[str, bool | None], str] = {}
    for key in zip(states, oks, strict=True):
        if key not in proofs:
            proofs[key] = al.proof_level(*key)
    redacted = {reason: redact(reason) or "" for reason in set(reasons)}
    hot = [_shown_copy(copies.get((cid, "hot"), ())) for cid in ids]
    archive = [_shown_copy(copies.get((cid, "archive"), ())) for cid in ids]
    cols: dict[str, Any] = {
        "job": [s.job] * len(ids), "step": steps, "state": states,
        "proof": [proofs[key] for key in zip(states, oks, strict=True)],
        "last_drill": ["" if ok is None else "passed" if ok else "failed" for ok in oks], "format": fmts, "bytes": sizes,
        "hot": [c[0] if c else "" for c in hot], "archive": [c[0] if c else "" for c in archive],
        "archive_stored_bytes": [c[1] if c is not None and c[0] in q.HELD else None for c in archive],
        "milestone": policy.are_milestones(steps) if policy is not None else [False] * len(ids),
        "reason": [redacted[reason] for reason in reasons],
    }
    for name, values in (("saved_at", saved), ("verified_at", verified), ("missing_since", gone)):
        cols[name] = pd.to_datetime(pd.Series(values, dtype=object), utc=True)
    df = pd.DataFrame(cols, columns=TABLES["checkpoints"].column_names)
    df["archive_stored_bytes"] = df["archive_stored_bytes"].astype("Int64")
    return df


def build_plan(s: Snapshot) -> pd.DataFrame:
    """The retention plan for the job now, with every reason."""
    plan = s.plan
    rows = [] if plan is None else [
        {"job": i.job, "step": i.step, "state": i.state, "action": i.action + (" hot copy" if i.scope == "hot-copy" and i.action == "delete" else ""),
         "bytes": i.bytes, "reasons": redact("; ".join(i.reasons))}
        for i in plan.items if s.step is None or i.step == s.step
    ]
    return _records(rows, "plan")


def build_drills(s: Snapshot) -> pd.DataFrame:
    """Restore drills, newest first: the catalog's newest :data:`EVENT_LIMIT`, or the job's newest
    :data:`DRILL_WINDOW`, or one checkpoint's among those."""
    drills = sorted((d for ds in s.drills.values() for d in ds), key=lambda d: d.started_at, reverse=True)
    if s.job is None:
        drills = drills[:EVENT_LIMIT]
    if s.step is not None:
        rid = s.record.id
        drills = [d for d in drills if d.checkpoint_id == rid]
    rows = [{
        "job": d.job, "step": d.step, "started_at": d.started_at, "finished_at": d.finished_at,
        "seconds": round((d.finished_at - d.started_at).total_seconds(), 3) if d.finished_at else None,
        "ok": d.ok, "outcome": d.verdict_name, "device": d.device or "", "tier": d.source_tier or "", "first_loss": _first_loss(d),
        "peak_memory_bytes": d.peak_memory_bytes, "summary": _drill_summary(d),
    } for d in drills]
    df = _records(rows, "drills")
    df["step"] = df["step"].astype("Int64")
    df["peak_memory_bytes"] = df["peak_memory_bytes"].astype("Int64")
    return df


def _events(s: Snapshot, kinds: Sequence[str] | None) -> pd.DataFrame:
    if s.job is not None:
        s.jobs  # noqa: B018 - raises for an unknown job
    cid = s.record.id if s.step is not None else None
    df = q.frame(s.source.engine, q.events(s.job, checkpoint_id=cid, kinds=kinds, limit=EVENT_LIMIT))
    df["message"] = [redact(m) for m in df["message"]]
    df["job"] = df["job"].fillna("")
    df["step"] = df["step"].astype("Int64")
    return df


def build_verifications(s: Snapshot) -> pd.DataFrame:
    """Verification outcomes (state changes and archive read-backs), newest first (at most :data:`EVENT_LIMIT`)."""
    return _events(s, q.VERIFICATION_EVENT_KINDS)


def build_events(s: Snapshot) -> pd.DataFrame:
    """The event log, newest first (at most :data:`EVENT_LIMIT`)."""
    return _events(s, None)


def build_storage(s: Snapshot) -> pd.DataFrame:
    """Bytes held per tier over time (see :mod:`.history`)."""
    s.jobs  # noqa: B018 - raises for an unknown job
    assert s.job is not None
    return s.storage


def build_costs(s: Snapshot) -> pd.DataFrame:
    """One row per job: stored bytes and monthly cost (hot, archive, total), keep-all and the
    savings against it, the recovery point and the expected time to restore it
    (:func:`ckptier.tasks.costs.cost_tables`)."""
    rows = []
    for c in s.costs:
        by_tier = {t: [x for x in c.tiers if x.tier == t] for t in ("hot", "archive")}
        point, restore = c.recovery_point, c.restore
        rows.append({
            "job": c.job,
            "stored_bytes": c.stored_bytes,
            "monthly_cost": round(c.monthly_cost, 4),
            "hot_bytes": sum(x.bytes for x in by_tier["hot"]),
            "hot_monthly_cost": round(sum(x.monthly_cost for x in by_tier["hot"]), 4),
            "archive_bytes": sum(x.bytes for x in by_tier["archive"]),
            "archive_monthly_cost": round(sum(x.monthly_cost for x in by_tier["archive"]), 4),
            "classes": ", ".join(f"{x.tier} {x.storage_class}" for x in c.tiers),
            "keep_all_checkpoints": c.keep_all_checkpoints,
            "keep_all_bytes": c.keep_all_bytes,
            "keep_all_monthly_cost": round(c.keep_all_monthly_cost, 4),
            "savings_monthly": round(c.savings_monthly, 4),
            "savings_fraction": round(c.savings_fraction, 4),
            "recovery_step": point.step if point else None,
            "recovery_saved_at": point.saved_at if point else None,
            "recovery_age_s": round(point.age_s, 3) if point else None,
            "restore_tier": restore.tier if restore else "",
            "restore_bytes": restore.bytes if restore else None,
            "restore_throughput_bytes_per_s": round(restore.throughput_bytes_per_s, 1)
            if restore and restore.throughput_bytes_per_s else None,
            "restore_seconds": round(restore.seconds, 3) if restore and restore.seconds is not None else None,
            "restore_drills": restore.drills if restore else 0,
            "restore_cost": round(restore.cost, 6) if restore else None,
            "restore_note": (restore.reason or "") if restore else ("" if point else "no drill-passed checkpoint held"),
            "currency": c.currency,
            "prices_assumed": c.prices_assumed,
            "price_note": c.price_note,
        })
    df = _records(rows, "costs")
    for col in ("recovery_step", "restore_bytes"):
        df[col] = df[col].astype("Int64")
    return df


def build_cost_tiers(s: Snapshot) -> pd.DataFrame:
    """One row per job, tier and storage class: checkpoints, bytes and monthly cost."""
    rows = [{"job": c.job, "tier": t.tier, "storage_class": t.storage_class, "checkpoints": t.checkpoints,
             "bytes": t.bytes, "monthly_cost": round(t.monthly_cost, 4), "currency": c.currency,
             "price_source": t.price_source}
            for c in s.costs for t in c.tiers]
    return _records(rows, "cost_tiers")


def build_tonight(s: Snapshot) -> pd.DataFrame:
    """Per job, what the next tiering run (``ckptier apply``) would do if it ran now: the plan's
    promotions and deletions with their bytes, and the hot bytes carrying it out frees
    (:func:`ckptier.tasks.pipeline.plan_with_forecast`, as ``ckptier plan`` and the tiering flow
    forecast it). A job whose plan cannot be made says why in ``note``."""
    from ckptier.tasks.pipeline import plan_with_forecast
    from ckptier.tasks.run import Run

    run = Run.of(s.catalog, config=s.source.config, now=lambda: s.now)
    rows = []
    for name in s.jobs["job"]:
        row: dict[str, Any] = {"job": name, "keep": 0, "promote": 0, "promote_bytes": 0, "delete": 0, "delete_bytes": 0,
                               "freed_bytes": 0, "hot_bytes": 0, "hot_bytes_after": 0, "note": ""}
        try:
            plan, forecast = plan_with_forecast(run, job=name)
        except ConfigError as exc:
            rows.append({**row, "note": redact(str(exc)) or ""})
            continue
        for i in plan.items:
            if i.action in ("keep", "promote", "delete"):
                row[i.action] += 1
            if i.action in ("promote", "delete"):
                row[f"{i.action}_bytes"] += i.bytes
        row.update(freed_bytes=forecast.freed_bytes, hot_bytes=forecast.hot_bytes,
                   hot_bytes_after=forecast.hot_bytes - forecast.freed_bytes)
        if name in plan.refused_jobs:
            row["note"] = redact(plan.refused_jobs[name]) or ""
        elif s.policies.get(name) is None:
            row["note"] = "no [[policy]] matches this job: nothing is deleted"
        rows.append(row)
    return _records(rows, "tonight")


def build_cost_history(s: Snapshot) -> pd.DataFrame:
    """Monthly storage cost over time, of every job (or of ``job``): the bytes each tier held
    (:mod:`.history`) at today's price per byte of that tier (each tier's monthly cost in the
    ``costs`` table over its bytes; one rate per tier across the jobs)."""
    if s.job is not None:
        s.jobs  # noqa: B018 - raises for an unknown job
    history = s.storage
    costs = s.table("costs")
    rates = {}
    for tier in ("hot", "archive"):
        nbytes = float(costs[f"{tier}_bytes"].sum())
        rates[tier] = float(costs[f"{tier}_monthly_cost"].sum()) / nbytes if nbytes else 0.0
    df = pd.DataFrame({"at": history["at"], "hot_bytes": history["hot_bytes"],
                       "archive_stored_bytes": history["archive_stored_bytes"]})
    df["hot_monthly_cost"] = df["hot_bytes"] * rates["hot"]
    df["archive_monthly_cost"] = df["archive_stored_bytes"] * rates["archive"]
    df["monthly_cost"] = df["hot_monthly_cost"] + df["archive_monthly_cost"]
    return df


# ------------------------------------------------------------------ checkpoint tables


def build_files(s: Snapshot) -> pd.DataFrame:
    """The checkpoint's files with sizes, hashes and their last verification."""
    computed = {r.relpath: r for r in q.frame(s.source.engine, q.file_hashes(s.record.id)).itertuples(index=False)}
    rows = []
    for f in s.record.files:
        c = computed.get(f.relpath)
        rows.append({
            "relpath": f.relpath, "size": f.size, "status": f.status or "unverified",
            "sha256_expected": f.sha256_expected or "", "sha256": (_opt(c.sha256) if c is not None else None) or "",
            "crc64nvme": f.crc64nvme or "", "verified_at": _opt(c.verified_at) if c is not None else None,
            "detail": redact(f.detail) or "",
        })
    return _records(rows, "files")


def build_copies(s: Snapshot) -> pd.DataFrame:
    """Where the checkpoint's bytes are: one row per copy and tier."""
    r = s.record
    rows = [{
        "tier": c.tier.value, "state": c.state, "url": redact(c.url), "stored_bytes": c.stored_bytes,
        "ratio": round(r.bytes / c.stored_bytes, 3) if c.stored_bytes else None, "codec": c.codec or "",
        # Catalogs that record the storage class carry it on the copy; older ones do not.
        "storage_class": getattr(c, "storage_class", None) or "",
        "verified_at": c.verified_at,
    } for c in r.copies]
    df = _records(rows, "copies")
    df["stored_bytes"] = df["stored_bytes"].astype("Int64")
    return df


# ------------------------------------------------------------------ the registry

C = Column
TABLES: dict[str, TableSpec] = {}


def register(spec: TableSpec) -> None:
    TABLES[spec.name] = spec


register(TableSpec("jobs", "Jobs", "catalog", (
    C("job", "job", "Job"),
    C("checkpoints", "int", "Live", "checkpoints not deleted"),
    C("incomplete", "int", "Incomplete", "saves in flight or torn"),
    C("committed", "int", "Committed", "complete, bytes not yet proven"),
    C("verified", "int", "Verified", "bytes proven, not (yet) drilled"),
    C("drilled", "int", "Drilled", "verified and the most recent drill passed"),
    C("corrupt", "int", "Corrupt"),
    C("deleted", "int", "Deleted", "tombstones"),
    C("hot_only", "int", "Hot only"),
    C("hot_and_archive", "int", "Hot + archive"),
    C("archive_only", "int", "Archive only"),
    C("no_copy", "int", "No copy", "live checkpoints no copy holds (missing from storage)"),
    C("hot_bytes", "bytes", "Hot"),
    C("archive_stored_bytes", "bytes", "Archive stored", "compressed bytes in the archive tier"),
    C("archive_logical_bytes", "bytes", "Archive logical", "original size of what the archive holds"),
    C("keep_all_bytes", "bytes", "Keep-all", "every checkpoint ever seen, kept hot"),
    C("saved_bytes", "bytes", "Saved", "keep-all minus hot minus archive stored"),
    C("saved_fraction", "ratio", "Saved %"),
    C("verified_coverage", "ratio", "Verified %", "verified / (committed + verified)"),
    C("oldest_verified_at", "time", "Oldest verification"),
    C("oldest_verification_age_s", "age", "Oldest verification age"),
    C("last_drill_at", "time", "Last drill"),
    C("last_drill_age_s", "age", "Last drill age"),
    C("last_drill_step", "step", "Last drill step"),
    C("last_drill_ok", "verdict", "Last drill verdict"),
    C("drill_success_7d", "ratio", "Drills passed 7d", "passed / judged drills over the last 7 days"),
    C("drill_success_30d", "ratio", "Drills passed 30d", "passed / judged drills over the last 30 days"),
    C("resumes_7d", "int", "Resumes 7d", "recoveries attempted ('ckptier resume' calls) over the last 7 days"),
    C("resumed_7d", "int", "Resumed 7d", "recoveries that succeeded (a proven checkpoint answered) over the last 7 days"),
    C("resumes_30d", "int", "Resumes 30d", "recoveries attempted over the last 30 days"),
    C("resumed_30d", "int", "Resumed 30d", "recoveries that succeeded over the last 30 days"),
    C("recovery_step", "step", "Recovery point", "newest checkpoint whose most recent drill passed"),
    C("recovery_saved_at", "time", "Recovery point saved"),
    C("recovery_age_s", "age", "Recovery point age"),
    C("newest_step", "step", "Newest step"),
    C("newest_saved_at", "time", "Newest save"),
    C("newest_save_age_s", "age", "Newest save age"),
    C("usual_interval_s", "age", "Usual interval", "median gap between the newest saves"),
    C("alerts", "int", "Alerts"),
    C("worst_alert", "severity", "Worst alert"),
), build_jobs, "one row per job: checkpoints by state, proof and tier; bytes; coverage; drills; recovery point"))

register(TableSpec("alerts", "Alerts", "catalog", (
    C("severity", "severity", "Severity"),
    C("job", "job", "Job"),
    C("kind", "text", "Kind"),
    C("steps", "text", "Steps"),
    C("message", "text", "Message"),
    C("rank", "int", "Rank", "0 = most severe"),
), build_alerts, "corrupt, degraded and only copies, suspended deletion, stale jobs, failed drills"))

register(TableSpec("checkpoints", "Checkpoints", "job", (
    C("job", "job", "Job"),
    C("step", "step", "Step"),
    C("state", "state", "State"),
    C("proof", "proof", "Proof"),
    C("last_drill", "state", "Last drill"),
    C("format", "text", "Format"),
    C("bytes", "bytes", "Size"),
    C("hot", "state", "Hot copy"),
    C("archive", "state", "Archive copy"),
    C("archive_stored_bytes", "bytes", "Archive stored"),
    C("milestone", "bool", "Milestone"),
    C("saved_at", "time", "Saved"),
    C("verified_at", "time", "Verified"),
    C("missing_since", "time", "Missing since"),
    C("reason", "text", "Reason"),
), build_checkpoints, "every checkpoint of the job, tombstones included"))

register(TableSpec("plan", "Retention plan", "job", (
    C("job", "job", "Job"),
    C("step", "step", "Step"),
    C("state", "state", "State"),
    C("action", "text", "Action"),
    C("bytes", "bytes", "Size"),
    C("reasons", "text", "Reasons"),
), build_plan, "what 'ckptier apply' would do now, with its reasons"))

register(TableSpec("drills", "Restore drills", "catalog", (
    C("job", "job", "Job"),
    C("step", "step", "Step"),
    C("started_at", "time", "Started"),
    C("finished_at", "time", "Finished"),
    C("seconds", "float", "Seconds"),
    C("ok", "verdict", "Verdict"),
    C("outcome", "text", "Outcome", "passed, failed, or not judged (the drill could not judge: history only)"),
    C("device", "text", "Device"),
    C("tier", "text", "From tier"),
    C("first_loss", "float", "First loss"),
    C("peak_memory_bytes", "bytes", "Peak memory"),
    C("summary", "text", "Summary"),
), build_drills, "restore drills, newest first"))

def build_recovery(s: Snapshot) -> pd.DataFrame:
    """Recovery success rate: per job and over every job, over 7 and 30 days, passed / judged
    drills and resumed / attempted recoveries (``ckptier resume`` calls; a job asked about that the
    catalog does not know has a row too, its drills none)."""
    by_job = {**{name: [] for name in s.recoveries}, **s.drills}
    rows = []
    for r in recovery_rates(by_job, now=s.now):
        attempted, resumed = s.resumes.get((r.job, r.days), (0, 0))
        rows.append({"job": r.job, "days": r.days, "passed": r.passed, "judged": r.judged, "rate": r.rate,
                     "resumes": attempted, "resumed": resumed,
                     "resume_rate": round(resumed / attempted, 4) if attempted else None})
    return _records(rows, "recovery")


register(TableSpec("recovery", "Recovery success rate", "catalog", (
    C("job", "job", "Job"),
    C("days", "int", "Days"),
    C("passed", "int", "Passed"),
    C("judged", "int", "Judged", "passed + failed (not judged drills do not count)"),
    C("rate", "ratio", "Rate"),
    C("resumes", "int", "Resumes", "recoveries attempted: 'ckptier resume' calls (and the Python API's)"),
    C("resumed", "int", "Resumed", "recoveries that succeeded: a checkpoint proven and returned"),
    C("resume_rate", "ratio", "Resume rate", "resumed / resumes"),
), build_recovery, "drills passed / judged and recoveries resumed / attempted over 7 and 30 days, per job and over "
   "every job"))

register(TableSpec("verifications", "Verification history", "catalog", (
    C("at", "time", "At"),
    C("job", "job", "Job"),
    C("step", "step", "Step"),
    C("kind", "state", "Outcome"),
    C("message", "text", "Message"),
), build_verifications, "verification outcomes (state changes, archive read-backs), newest first"))

register(TableSpec("events", "Events", "catalog", (
    C("at", "time", "At"),
    C("job", "job", "Job"),
    C("step", "step", "Step"),
    C("kind", "text", "Kind"),
    C("message", "text", "Message"),
), build_events, "the event log, newest first"))

register(TableSpec("storage", "Storage over time", "job", (
    C("at", "time", "At"),
    C("hot_bytes", "bytes", "Hot"),
    C("archive_stored_bytes", "bytes", "Archive stored"),
    C("archive_logical_bytes", "bytes", "Archive logical"),
), build_storage, "bytes held per tier over time"))

register(TableSpec("files", "Files", "checkpoint", (
    C("relpath", "mono", "File"),
    C("size", "bytes", "Size"),
    C("status", "state", "Status"),
    C("sha256_expected", "mono", "sha256 expected"),
    C("sha256", "mono", "sha256 computed"),
    C("crc64nvme", "mono", "CRC64NVME"),
    C("verified_at", "time", "Verified"),
    C("detail", "text", "Detail"),
), build_files, "the checkpoint's files with sizes and hashes"))

register(TableSpec("copies", "Copies", "checkpoint", (
    C("tier", "text", "Tier"),
    C("state", "state", "State"),
    C("url", "mono", "URL"),
    C("stored_bytes", "bytes", "Stored"),
    C("ratio", "float", "Ratio", "logical / stored"),
    C("codec", "text", "Codec"),
    C("storage_class", "text", "Storage class"),
    C("verified_at", "time", "Verified"),
), build_copies, "the checkpoint's copies per tier"))


register(TableSpec("costs", "Costs", "catalog", (
    C("job", "job", "Job"),
    C("stored_bytes", "bytes", "Stored", "hot bytes plus archive stored bytes"),
    C("monthly_cost", "money", "Monthly cost", "storage per month at the configured prices"),
    C("hot_bytes", "bytes", "Hot"),
    C("hot_monthly_cost", "money", "Hot / month"),
    C("archive_bytes", "bytes", "Archive", "stored (compressed) bytes"),
    C("archive_monthly_cost", "money", "Archive / month"),
    C("classes", "text", "Tiers and classes", "archive classes are estimated from the policy's archive_tiers"),
    C("keep_all_checkpoints", "int", "Keep-all checkpoints", "every checkpoint ever seen"),
    C("keep_all_bytes", "bytes", "Keep-all", "every checkpoint ever seen, kept hot"),
    C("keep_all_monthly_cost", "money", "Keep-all / month"),
    C("savings_monthly", "money", "Saved / month", "keep-all's monthly cost minus this one"),
    C("savings_fraction", "ratio", "Saved %"),
    C("recovery_step", "step", "Recovery point", "newest checkpoint whose most recent drill passed, still held"),
    C("recovery_saved_at", "time", "Recovery point saved"),
    C("recovery_age_s", "age", "Recovery point age"),
    C("restore_tier", "text", "Restore from"),
    C("restore_bytes", "bytes", "Restore size"),
    C("restore_throughput_bytes_per_s", "rate", "Fetch rate", "median fetch throughput the job's drills measured"),
    C("restore_seconds", "age", "Expected restore", "restore size over the measured fetch rate"),
    C("restore_drills", "int", "Drills measured"),
    C("restore_cost", "money", "Restore cost", "retrieval and requests to read it back once"),
    C("restore_note", "text", "Restore note"),
    C("currency", "text", "Currency"),
    C("prices_assumed", "bool", "List prices", "yes: some figure is a built-in list-price assumption"),
    C("price_note", "text", "Prices"),
), build_costs, "bytes and monthly cost per tier, savings against keep-all, recovery point and expected restore time"))

register(TableSpec("cost_tiers", "Costs per tier and class", "catalog", (
    C("job", "job", "Job"),
    C("tier", "text", "Tier"),
    C("storage_class", "text", "Storage class"),
    C("checkpoints", "int", "Checkpoints"),
    C("bytes", "bytes", "Stored"),
    C("monthly_cost", "money", "Monthly cost"),
    C("currency", "text", "Currency"),
    C("price_source", "text", "Prices"),
), build_cost_tiers, "bytes and monthly cost per job, tier and storage class"))


register(TableSpec("tonight", "Tonight's plan", "catalog", (
    C("job", "job", "Job"),
    C("keep", "int", "Keep"),
    C("promote", "int", "Promote", "milestones the run copies to the archive tier"),
    C("promote_bytes", "bytes", "Promote size"),
    C("delete", "int", "Delete", "checkpoints (or hot copies) the run deletes"),
    C("delete_bytes", "bytes", "Delete size"),
    C("freed_bytes", "bytes", "Frees", "hot bytes freed: the deletions, and promoted milestones' hot copies let go"),
    C("hot_bytes", "bytes", "Hot now"),
    C("hot_bytes_after", "bytes", "Hot after"),
    C("note", "text", "Note"),
), build_tonight, "what the next tiering run ('ckptier apply') would promote, delete and free if it ran now"))

register(TableSpec("cost_history", "Cost over time", "catalog", (
    C("at", "time", "At"),
    C("hot_bytes", "bytes", "Hot"),
    C("archive_stored_bytes", "bytes", "Archive stored"),
    C("hot_monthly_cost", "money", "Hot / month"),
    C("archive_monthly_cost", "money", "Archive / month"),
    C("monthly_cost", "money", "Monthly cost"),
), build_cost_history, "monthly storage cost over time at today's price per byte of each tier"))
