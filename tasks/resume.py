"""Resume: the newest checkpoint of a job proven now, and where to load it from.

``ckptier resume`` and :func:`ckptier.resume` answer the question a launcher
asks before training starts again: which checkpoint, at which path, from
which step. The candidates are the ones ``ckptier latest`` would answer, in
its order (:func:`ckptier.storage.transitions.pick_latest`: verified, a copy
present, the most recent drill not failed; newest step first). Each is proven
*now* before it is answered:

* the hot copy's files are looked at (a ``stat`` or HEAD each,
  :func:`ckptier.tasks.prove.prove_record`): one whose files changed since
  its verdict is settled (no longer verified) and passed over;
* ``verify="full"`` (the default) then reads it as ``ckptier verify`` does
  (every byte, or the store's full-object checksums where it keeps them) and
  records the result the same way (:meth:`Catalog.record_verifications`): a
  torn file makes it ``corrupt`` and it is passed over; ``verify="quick"``
  stops at the ``stat``;
* a checkpoint without a readable hot copy is fetched from its archive copy
  into ``dest`` (the fetch checks every byte against the manifest and the
  catalog), or passed over when no ``dest`` was given.

The first candidate that passes is the answer (:class:`Resume`); when none
does, :class:`ResumeError` names every candidate passed over and why. Every
call is recorded as a recovery event (:class:`~ckptier.storage.catalog.api.RecoveryRecord`),
from which :func:`recovery_rates` counts recoveries attempted and succeeded
per job. The decisions (:func:`next_step`, :func:`merged_passed_over`,
:func:`recovery_rates`) are pure; :func:`run_resume` does the I/O. No
Prefect, no torch; a ``quick`` resume that fetches nothing imports neither
the config's parser, the formats, the reading path of ``verify`` nor the
archive codec (it costs what ``ckptier latest`` costs, plus the recovery event).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from ckptier.storage.base import LocalPaths, is_single_file
from ckptier.storage.catalog.api import DrillRecord, ReadBack, RecoveryRecord
from ckptier.storage.errors import CkptierError
from ckptier.storage.records import CheckpointRecord, CopyState, State, Tier

from .prove import ProvenNow, Verdict, prove_record
from .run import Run

__all__ = [
    "Action", "RecoveryRate", "Resume", "ResumeError", "ResumeOptions", "VerifyMode", "merged_passed_over",
    "next_step", "recovery_rates", "run_resume",
]

#: ``full``: the hot copy is read (or checked by the store's checksums) now; ``quick``: a stat or HEAD of each file.
VerifyMode = Literal["full", "quick"]
VERIFY_MODES: tuple[VerifyMode, ...] = ("full", "quick")

#: What to do with a candidate (:func:`next_step`): ``use-hot``: load it where it is (after a full
#: read, with ``verify="full"``); ``fetch-hot``: copy the hot copy into ``dest`` (a remote hot copy,
#: the fetch reads and checks every byte); ``fetch-archive``: decode the archive copy into ``dest``;
#: ``pass``: pass over it, for the reason given.
Action = Literal["use-hot", "fetch-hot", "fetch-archive", "pass"]

#: A recovery event's outcomes.
RESUMED, FAILED = "resumed", "failed"


class ResumeError(CkptierError):
    """No checkpoint of the job can be proven now (or the call itself failed).
    ``passed_over``: the candidates looked at, ``(step, reason)``, newest first."""

    def __init__(self, message: str, *, job: str, passed_over: Sequence[tuple[int, str]] = ()) -> None:
        super().__init__(message)
        self.job = job
        self.passed_over = tuple(passed_over)


@dataclass(frozen=True)
class ResumeOptions:
    """What a resume is asked: the ``job``; ``dest``, where a checkpoint with no
    hot copy to load in place is fetched (into ``dest/{job}/step-{step:08d}``);
    ``verify`` (:data:`VerifyMode`); ``drilled``: only a checkpoint whose most
    recent restore drill passed."""

    job: str
    dest: Path | None = None
    verify: VerifyMode = "full"
    drilled: bool = False

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify={self.verify!r}: give 'full' (read every byte now) or 'quick' (a stat of each file)")

    @property
    def needs_config(self) -> bool:
        """Whether this resume may use the config: a full read (the job's grace for what
        a manifest requires) or a fetch into ``dest`` (the archive's settings). A ``quick``
        resume without ``dest`` never does, so it need not read ``ckptier.toml``."""
        return self.verify == "full" or self.dest is not None


@dataclass(frozen=True)
class Resume:
    """The answer: load ``job`` from ``path`` (a directory, or the file of a
    single-file checkpoint; a URL for a remote hot copy when no ``dest`` was
    given) and resume at ``step``. ``proof``: what the catalog holds of it
    (``verified`` or ``drilled``), now re-proven by ``verify``; ``source``:
    ``hot`` (in place), ``fetched`` (from the hot tier into ``dest``),
    ``archive`` (from the archive copy into ``dest``); ``passed_over``: the
    newer candidates and why, ``(step, reason)``, newest first; ``seconds``:
    how long the call took."""

    job: str
    step: int
    path: str
    proof: str
    verify: VerifyMode
    source: str
    passed_over: tuple[tuple[int, str], ...] = ()
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """What ``resume --json`` prints (and what :func:`ckptier.resume_distributed` sends to every rank)."""
        return {"job": self.job, "step": self.step, "path": self.path, "proof": self.proof, "verify": self.verify,
                "source": self.source, "passed_over": [{"step": s, "reason": r} for s, r in self.passed_over],
                "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Resume:
        """The inverse of :meth:`to_json`."""
        return cls(job=data["job"], step=int(data["step"]), path=data["path"], proof=data["proof"],
                   verify=data["verify"], source=data["source"],
                   passed_over=tuple((int(p["step"]), str(p["reason"])) for p in data["passed_over"]),
                   seconds=float(data["seconds"]))


# ------------------------------------------------------------------ pure decisions


def next_step(hot: Verdict | None, *, archived: bool, have_dest: bool, local: bool) -> tuple[Action, str | None]:
    """What to do with a candidate, given what a look at its hot copy found now
    (``hot``: :data:`~ckptier.tasks.prove.Verdict`, None when it has no hot copy
    to look at), whether it has an archive copy (``archived``), whether a
    ``dest`` was given and whether the hot copy is on this machine (``local``).

    An intact hot copy is used in place when local, else fetched into
    ``dest`` (or named by its URL without one). A changed one is passed over
    (its verdict no longer holds: verify it again). One that cannot be looked
    at, or is gone, or was never there falls to the archive copy, fetched into
    ``dest``; without an archive copy or a ``dest`` it is passed over. The
    reason is None unless the action is ``pass``.
    """
    if hot == "intact":
        return ("use-hot", None) if local or not have_dest else ("fetch-hot", None)
    if hot == "changed":
        return "pass", "verify it again"
    why = {None: "no hot copy", "vanished": "its hot copy is gone (a rescan settles it)",
           "unknown": "its hot copy cannot be looked at now"}[hot]
    if not archived:
        return "pass", f"{why} and no archive copy"
    if not have_dest:
        return "pass", f"{why}; its archive copy needs --dest DIR (dest=) to be fetched into"
    return "fetch-archive", None


def merged_passed_over(mine: Iterable[tuple[int, str]], picked: Iterable[tuple[int, str]]) -> tuple[tuple[int, str], ...]:
    """The candidates a resume passed over: those it proved and rejected
    (``mine``) and those the last :func:`~ckptier.storage.transitions.pick_latest`
    passed over (a failed drill), one entry per step, newest first (pure)."""
    seen: dict[int, str] = {}
    for step, why in [*mine, *picked]:
        seen.setdefault(step, why)
    return tuple(sorted(seen.items(), key=lambda item: item[0], reverse=True))


@dataclass(frozen=True)
class RecoveryRate:
    """Recoveries of ``job`` over the ``days`` before now (None: all time):
    resumes ``attempted`` and ``resumed`` (recovery events), drills that
    judged a checkpoint (``drills``) and ``drills_passed``."""

    job: str
    days: int | None
    attempted: int
    resumed: int
    drills: int
    drills_passed: int

    @property
    def rate(self) -> float | None:
        """Resumes succeeded / attempted (None when none was attempted)."""
        return self.resumed / self.attempted if self.attempted else None

    @property
    def drill_rate(self) -> float | None:
        """Drills passed / judged (None when none judged)."""
        return self.drills_passed / self.drills if self.drills else None

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "days": self.days, "attempted": self.attempted, "resumed": self.resumed,
                "rate": self.rate, "drills": self.drills, "drills_passed": self.drills_passed,
                "drill_rate": self.drill_rate}


#: The windows a recovery rate is shown over, in days (None: all time).
RATE_WINDOWS: tuple[int | None, ...] = (7, 30, None)


def recovery_rates(events: Iterable[RecoveryRecord], drills: Iterable[DrillRecord], *, now: datetime,
                   windows: Sequence[int | None] = RATE_WINDOWS) -> list[RecoveryRate]:
    """Per job (sorted) and window (in ``windows`` order): resumes attempted and
    succeeded, drills judged and passed, counting those started within the
    window's days before ``now`` (inclusive; None: all); pure. A job with
    neither events nor drills has no rows; a drill that could not judge its
    checkpoint counts for neither."""
    evs = list(events)
    drs = [d for d in drills if d.judged]
    jobs = sorted({e.job for e in evs} | {d.job for d in drs})
    out: list[RecoveryRate] = []
    for job in jobs:
        for days in windows:
            since = now - timedelta(days=days) if days is not None else None
            mine = [e for e in evs if e.job == job and (since is None or e.started_at >= since)]
            ds = [d for d in drs if d.job == job and (since is None or d.started_at >= since)]
            out.append(RecoveryRate(job, days, attempted=len(mine), resumed=sum(e.outcome == RESUMED for e in mine),
                                    drills=len(ds), drills_passed=sum(d.ok for d in ds)))
    return out


# ------------------------------------------------------------------ I/O


@dataclass
class _Chosen:
    path: str
    source: str


@dataclass
class _Attempt:
    passed: list[tuple[int, str]] = field(default_factory=list)


def run_resume(run: Run, options: ResumeOptions) -> Resume:
    """The newest checkpoint of ``options.job`` proven now (see the module
    docstring), recorded as a recovery event either way. Raises
    :class:`ResumeError` when no candidate can be proven (the job unknown,
    none verified, every one passed over); a checkpoint fetched earlier into
    the same ``dest`` is checked and used again, and one that no longer
    matches the catalog raises :class:`~ckptier.storage.errors.ConfigError`
    (remove it), never overwritten."""
    started, clock = run.now(), time.monotonic()
    attempt = _Attempt()
    try:
        answer, checkpoint_id = _resolve(run, options, attempt)
    except CkptierError as exc:
        passed = getattr(exc, "passed_over", tuple(attempt.passed))
        run.catalog.record_recovery(RecoveryRecord(
            job=options.job, started_at=started, seconds=time.monotonic() - clock, outcome=FAILED,
            verify=options.verify, passed_over=tuple(passed), error=str(exc)))
        raise
    seconds = round(time.monotonic() - clock, 3)
    answer = replace(answer, seconds=seconds)
    run.catalog.record_recovery(RecoveryRecord(
        job=options.job, started_at=started, seconds=seconds, outcome=RESUMED, verify=options.verify,
        step=answer.step, checkpoint_id=checkpoint_id, source=answer.source,
        path=answer.path, passed_over=answer.passed_over))
    return answer


def _resolve(run: Run, options: ResumeOptions, attempt: _Attempt) -> tuple[Resume, int]:
    """The answer and the chosen checkpoint's id. Each candidate is the one ``latest`` would
    answer once those already passed over are left out (:meth:`Catalog.choose_latest`, read
    fresh each time: a few of the newest rows, never every checkpoint of the job)."""
    catalog, job = run.catalog, options.job
    tried: set[int] = set()
    while True:
        latest = catalog.choose_latest(job, drilled=options.drilled, exclude=tried)
        record = latest.record
        if record is None:
            raise ResumeError(_nothing(run, options, merged_passed_over(attempt.passed, latest.passed_over)),
                              job=job, passed_over=merged_passed_over(attempt.passed, latest.passed_over))
        tried.add(record.id)
        chosen = _prove(run, record, options, attempt)
        if chosen is not None:
            proof = latest.proof.value if latest.proof is not None else State.VERIFIED.value
            return Resume(job=job, step=record.step, path=chosen.path, proof=proof, verify=options.verify,
                          source=chosen.source,
                          passed_over=merged_passed_over(attempt.passed, latest.passed_over)), record.id


def _nothing(run: Run, options: ResumeOptions, passed: Sequence[tuple[int, str]]) -> str:
    job = options.job
    others = run.catalog.checkpoints(job=job, with_files=False)
    if not others:
        why = f"job {job!r}: no checkpoints in the catalog (start from scratch, or scan its directory first)"
    elif options.drilled and not passed:
        why = f"job {job!r}: no verified checkpoint whose most recent drill passed; run 'ckptier drill --job {job}'"
    else:
        states = ", ".join(sorted({c.state.value for c in others}))
        why = (f"job {job!r}: no checkpoint can be proven now ({len(others)} cataloged, states: {states}); "
               f"run 'ckptier verify --job {job}'")
    if passed:
        why += "; passed over: " + "; ".join(f"step {s}: {r}" for s, r in passed)
    return why


def _prove(run: Run, record: CheckpointRecord, options: ResumeOptions, attempt: _Attempt) -> _Chosen | None:
    """Prove ``record`` now and say where to load it from, or pass over it (appending why to ``attempt``)."""
    proven: ProvenNow | None = prove_record(run.catalog, run.stores.for_record, record, now=run.now())
    local = False
    if proven is not None and proven.verdict == "intact":
        store, prefix = run.stores.for_record(record)
        local = isinstance(store, LocalPaths)
    archived = any(c.tier == Tier.ARCHIVE and c.state == CopyState.PRESENT for c in record.copies)
    action, why = next_step(proven.verdict if proven is not None else None, archived=archived,
                            have_dest=options.dest is not None, local=local)
    if action == "pass":
        detail = proven.describe() + "; " if proven is not None and proven.verdict != "intact" else ""
        attempt.passed.append((record.step, detail + (why or "")))
        return None
    if action == "use-hot":
        if options.verify == "full" and not _read_now(run, record, attempt):
            return None
        store, prefix = run.stores.for_record(record)
        path = str(store.local_path(prefix)) if isinstance(store, LocalPaths) else record.location
        return _Chosen(path, "hot")
    assert options.dest is not None  # next_step fetches only into a dest
    return _fetch(run, record, options, attempt, source="fetched" if action == "fetch-hot" else "archive")


def _read_now(run: Run, record: CheckpointRecord, attempt: _Attempt) -> bool:
    """Read the hot copy as ``verify`` does and record the result; False (passed over) unless still verified."""
    from .config import policy_grace  # lazy: the config's and the read path's imports, only for a full read
    from .verify import verify_many

    ((_, outcome),) = list(verify_many(run.stores.for_record, [record], deep=False, workers=4))
    (state,) = run.catalog.record_verifications(
        [ReadBack(record.id, tuple(outcome.results), grace=policy_grace(run.config)(record.job),
                  extra=tuple(outcome.extra))], now=run.now())
    if outcome.ok and state == State.VERIFIED:
        return True
    bad = [f"{r.relpath}: {r.detail or r.status}" for r in outcome.results if r.status != "ok"]
    more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
    attempt.passed.append((record.step, f"failed its proof now ({'; '.join(bad[:3]) + more or 'see verify'}); "
                                        f"recorded as {getattr(state, 'value', state)}"))
    return False


def _fetch(run: Run, record: CheckpointRecord, options: ResumeOptions, attempt: _Attempt, *,
           source: str) -> _Chosen | None:
    assert options.dest is not None
    from ckptier.storage.archive_copies import copy_dir as archive_dir  # lazy: only when something is fetched

    target = Path(options.dest) / archive_dir(record.job, record.step)
    single = is_single_file(record.location.rstrip("/"), record)

    def loadable() -> str:
        return str(target / record.files[0].relpath) if single else str(target)

    if target.exists() and any(target.iterdir()):
        problem = _fetched_problem(target, record, quick=options.verify == "quick")
        if problem is None:
            return _Chosen(loadable(), source)
        from ckptier.storage.errors import ConfigError

        raise ConfigError(f"{target} holds an earlier fetch of {record.job} step {record.step} that does not match "
                          f"the catalog ({problem}); remove it and resume again")
    from .pipeline import fetch_record  # lazy: the archive codec's imports, only when something is fetched

    try:
        fetch_record(record, run.config, dest=target, stores=run.stores)
    except CkptierError as exc:
        attempt.passed.append((record.step, f"could not be fetched into {target}: {' '.join(str(exc).split())}"))
        return None
    return _Chosen(loadable(), source)


def _fetched_problem(target: Path, record: CheckpointRecord, *, quick: bool) -> str | None:
    """Why the files under ``target`` (an earlier fetch) are not ``record``'s, or None:
    sizes only with ``quick``, every byte otherwise."""
    if quick:
        for f in record.files:
            p = target / f.relpath
            size = p.stat().st_size if p.is_file() else None
            if size != f.size:
                return f"{f.relpath}: {'missing' if size is None else f'{size} bytes, cataloged {f.size}'}"
        return None
    from ckptier.storage.url import open_store

    from .verify import verify_checkpoint  # lazy: like the full read

    outcome = verify_checkpoint(open_store(target.as_uri()), "", record, deep=True)
    bad = [f"{r.relpath}: {r.detail or r.status}" for r in outcome.results if r.status != "ok"]
    return "; ".join(bad[:3]) or None
