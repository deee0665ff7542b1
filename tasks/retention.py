"""Retention: which checkpoints to keep, promote to the archive, or delete.

Pure code, no I/O and no clock: :func:`plan_retention` takes the catalog's
records, a :class:`Policy` and ``now`` and returns a :class:`Plan` with a
reason for every decision. Deleting and promoting happen elsewhere; they
carry out a plan, they never decide.

A policy is a handful of small rules (restic/Orbax style); a checkpoint is
kept when *any* rule keeps it. On top of the rules the plan enforces safety
invariants that no policy can switch off, each one a small named stage
applied in order after the rules vote (:func:`stages`, as Orbax composes its
preservation policies), each giving its own reason:

* the newest verified checkpoint of a job (highest step) is never deleted;
* at least ``min_verified`` verified checkpoints keep a hot copy;
* saves in flight (incomplete, younger than ``grace``) are kept and never
  counted; stale incomplete ones are kept for review unless the policy sets
  ``delete_stale_incomplete``;
* committed-but-unverified checkpoints are kept until verification proves
  their bytes; corrupt ones are kept as evidence;
* a milestone is never deleted without a verified archive copy, and then
  only its hot copy (``scope="hot-copy"``);
* with ``min_drilled`` = N, the N newest checkpoints whose most recent
  restore drill passed keep their hot copy (the drilled recovery point; a
  checkpoint is self-contained, so nothing older is needed to reach it);
* archive copies are never deleted by retention;
* checkpoints missing from the hot store are never planned for deletion
  (there is nothing to delete) and are reported;
* when too many of a job's checkpoints are missing from the hot store (a
  listing that shrank: wrong prefix, wrong bucket), every deletion of that
  job is suspended and :attr:`Plan.refused` says why.

Checkpoints in state ``deleted`` (tombstones) are excluded from the plan.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, tzinfo, UTC
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from ckptier.storage.errors import ConfigError
from ckptier.storage.records import CheckpointRecord, CopyState, State, Tier
from ckptier.storage.transitions import DrillLike, latest_drills
from ckptier.tasks.durations import Span, format_duration
from ckptier.tasks.durations import parse_duration  # noqa: F401 - re-exported for older imports
from ckptier.tasks.tiers import ArchiveTier

Action = Literal["keep", "promote", "delete"]
Scope = Literal["checkpoint", "hot-copy"]
HotAfterArchive = Literal["delete", "keep"]
MilestoneMatch = Literal["at_or_after", "exact"]
ArchiveWhen = Literal["immediately", "leaving_hot"]
#: The shrink guard's default: refuse a job's deletions when more than this
#: fraction (0..1) of its verified checkpoints went missing from a listing.
DEFAULT_MAX_MISSING_FRACTION = 0.5

MILESTONE_MATCHES: tuple[MilestoneMatch, ...] = ("at_or_after", "exact")
ARCHIVE_WHENS: tuple[ArchiveWhen, ...] = ("immediately", "leaving_hot")

def is_log_milestone(step: int) -> bool:
    """True for the 1-2-5 series: 1, 2, 5, 10, 20, 50, 100, 200, 500, ..."""
    if step <= 0:
        return False
    while step % 10 == 0:
        step //= 10
    return step in (1, 2, 5)


def _time_of(c: CheckpointRecord) -> datetime:
    """When a checkpoint was saved: ``saved_at``, else when first seen."""
    return c.saved_at if c.saved_at is not None else c.first_seen


def _newest_first(cs: Iterable[CheckpointRecord]) -> list[CheckpointRecord]:
    """Order by step, then save time, then id, newest first (deterministic)."""
    return sorted(cs, key=lambda c: (c.step, _time_of(c), c.id), reverse=True)


def _verified(cs: Iterable[CheckpointRecord]) -> list[CheckpointRecord]:
    return [c for c in cs if c.state == State.VERIFIED]


# --------------------------------------------------------------------------- rules

#: The ``[[policy]]`` keys that state a retention rule, in the order plans list them.
RULE_NAMES = ("keep_last", "keep_best", "milestones", "keep_within", "keep_hourly", "keep_daily",
              "keep_weekly", "keep_monthly", "keep_yearly", "pinned")


@runtime_checkable
class Rule(Protocol):
    """One retention rule.

    ``keeps`` receives the live (not ``deleted``) checkpoints of ONE job in
    any order and returns ``{checkpoint id: reason}`` for those it keeps. It
    is pure: same input, same answer; ``now`` is the only notion of time.
    """

    def keeps(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> dict[int, str]: ...


@runtime_checkable
class Warns(Protocol):
    """A rule that can tell, from one job's live checkpoints, why it will keep
    far more or less than it seems to (one line, or None). Pure."""

    def warning(self, checkpoints: Sequence[CheckpointRecord]) -> str | None: ...


@dataclass(frozen=True)
class _KeepN:
    """A rule keeping up to ``n`` checkpoints (``n = 0`` keeps nothing), named
    by its config key."""

    n: int
    key: ClassVar[str]
    example: ClassVar[int]

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ConfigError(f"{self.key} = {self.n}: must be ≥ 0, e.g. {self.key} = {self.example}")

    def __str__(self) -> str:
        return f"{self.key} {self.n}"


@dataclass(frozen=True)
class KeepLast(_KeepN):
    """Keep the ``n`` newest (highest step) *verified* checkpoints."""

    key = "keep_last"
    example = 3

    def keeps(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> dict[int, str]:
        chosen = _newest_first(_verified(checkpoints))[: self.n]
        return {c.id: f"keep_last {self.n}: #{i + 1} newest verified" for i, c in enumerate(chosen)}


@dataclass(frozen=True)
class Milestones:
    """Keep checkpoints that hold milestone steps, long term.

    Exactly one of: ``log=True`` (the 1-2-5 series 1, 2, 5, 10, 20, 50, ...),
    ``every`` (steps that are multiples of ``every``, step 0 included, as
    Orbax's ``EveryNSteps`` keeps it), ``steps`` (an explicit set) or
    ``interval`` (one per interval of save time, below). Milestones are what
    gets promoted to the archive. ``max_to_keep`` (Orbax's
    ``EveryNSteps(max_to_keep)``) holds only the newest that many: an older
    holder gives its milestone up for good (its hot copy may then go; an
    archive copy stays, as retention never deletes one).

    Step 0 is a milestone of ``every`` held only by a save at step 0 itself
    (the run's initial state): a run whose first save is at step 1,200 did
    not save its initial state, and that save does not stand in for it.

    ``match`` says which checkpoint holds a milestone step M:

    * ``"at_or_after"`` (the default): the first checkpoint of the job, in
      step order, at or after M that is verified. Trainers rarely save on
      the series' round numbers (every 1,200 steps never hits 1,000 or
      5,000), so an exact match would keep nothing. "First" is judged on the
      catalog as it stands, and is sticky: a verified holder keeps its
      milestone whatever happened to its copies (its hot copy deleted after
      archiving, or missing from a listing), so a milestone never slides to
      a later save behind the archive's back. A ``committed`` checkpoint
      that comes first holds it *pending* verification (later saves do not
      take the milestone meanwhile). Only a corrupt or incomplete
      checkpoint, or a tombstone (``deleted``: gone from every tier), is
      passed over; the next holder's reason names what was passed over.
    * ``"exact"``: only a verified checkpoint whose step is M itself.

    ``interval`` milestones cut save time into intervals of that length,
    aligned to midnight of 1 January 1970 on the wall clock of ``timezone``
    (so 6-hour intervals start at 00:00, 06:00, 12:00 and 18:00 there): the
    first save of each interval holds it (Orbax's ``EveryNSeconds`` keeps the
    first save at least that long after the last one kept; fixed intervals
    make the choice sticky as new saves arrive). Corrupt, incomplete and
    deleted saves are passed over, as above; an interval none of whose saves
    is verified or committed has no milestone.
    """

    steps: tuple[int, ...] = ()
    log: bool = False
    every: int | None = None
    match: MilestoneMatch = "at_or_after"
    interval: timedelta | None = None
    timezone: str = "UTC"
    max_to_keep: int | None = None

    def __post_init__(self) -> None:
        given = sum([bool(self.steps), self.log, self.every is not None, self.interval is not None])
        if given != 1:
            raise ConfigError(
                f"milestones: give exactly one of log, every_n_steps, every or steps (got {given}); "
                f"e.g. milestones = \"log\""
            )
        if self.every is not None and self.every <= 0:
            raise ConfigError(f"milestones every_n_steps = {self.every}: must be > 0, e.g. 10000")
        if self.interval is not None and self.interval < timedelta(seconds=1):
            raise ConfigError(f"milestones every = {format_duration(self.interval)!r}: must be at least 1s, e.g. \"6h\"")
        if self.interval is not None and self.match != "at_or_after":
            raise ConfigError("milestones every: a save time never falls exactly on an interval's start; "
                              "remove milestone_match = \"exact\"")
        if self.max_to_keep is not None and (isinstance(self.max_to_keep, bool) or self.max_to_keep < 1):
            raise ConfigError(f"milestones max_to_keep = {self.max_to_keep!r}: must be ≥ 1, e.g. max_to_keep = 10")
        zone(self.timezone)
        if any(s < 0 for s in self.steps):
            raise ConfigError(f"milestones steps {list(self.steps)}: steps must be ≥ 0")
        if self.match not in MILESTONE_MATCHES:
            raise ConfigError(
                f"milestone_match = {self.match!r}: must be \"at_or_after\" or \"exact\""
            )

    def __str__(self) -> str:
        if self.log:
            text = "milestones log (1-2-5 series)"
        elif self.every is not None:
            text = f"milestones every {self.every} steps"
        elif self.interval is not None:
            text = f"milestones every {format_duration(self.interval)} of save time"
        else:
            text = "milestones at steps " + ", ".join(str(s) for s in sorted(set(self.steps)))
        cap = f", max_to_keep {self.max_to_keep}" if self.max_to_keep is not None else ""
        return text + (" (exact match)" if self.match == "exact" else "") + cap

    def is_milestone(self, step: int) -> bool:
        """True when ``step`` is one of the milestone steps themselves (never for ``interval``)."""
        if self.log:
            return is_log_milestone(step)
        if self.every is not None:
            return step >= 0 and step % self.every == 0
        return step in self.steps

    def between(self, lo: int, hi: int) -> tuple[int, int, int] | None:
        """The milestone steps M with ``lo < M <= hi``: ``(smallest, largest, count)``, or None."""
        if hi <= lo or hi < 0 or self.interval is not None:
            return None
        if self.every is not None:
            if hi == 0:  # step 0: held by a save at step 0 only (see the class docstring)
                return (0, 0, 1)
            n = self.every
            first = (max(lo, 0) // n + 1) * n
            last = hi // n * n
            return (first, last, (last - first) // n + 1) if first <= last else None
        series = _LOG_SERIES if self.log else self._sorted_steps()
        # the milestones M with lo < M <= hi, by bisection: planning calls this once per save
        first, end = bisect.bisect_right(series, lo), bisect.bisect_right(series, hi)
        return (series[first], series[end - 1], end - first) if first < end else None

    def _sorted_steps(self) -> tuple[int, ...]:
        return _sorted_unique(self.steps)

    def keeps(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> dict[int, str]:
        """As :class:`Rule`; ``checkpoints`` may also hold the job's tombstones, which
        never hold a milestone but are named when a milestone passes over them."""
        if self.interval is not None:
            out = self._interval_keeps(checkpoints)
        elif self.match == "exact":
            out = {
                c.id: f"{self}: step {c.step} is a milestone"
                for c in _verified(checkpoints)
                if self.is_milestone(c.step)
            }
        else:
            out = self._at_or_after_keeps(checkpoints)
        if self.max_to_keep is None or len(out) <= self.max_to_keep:
            return out
        by_id = {c.id: c for c in checkpoints}
        newest = sorted(out, key=lambda cid: (by_id[cid].step, _time_of(by_id[cid]), cid), reverse=True)
        return {cid: f"{out[cid]} (#{i + 1} of the newest {self.max_to_keep} held)"
                for i, cid in enumerate(newest[: self.max_to_keep])}

    def _interval_keeps(self, checkpoints: Sequence[CheckpointRecord]) -> dict[int, str]:
        assert self.interval is not None
        tz, size = zone(self.timezone), int(self.interval.total_seconds())
        out: dict[int, str] = {}
        held: set[int] = set()
        passed: list[CheckpointRecord] = []  # corrupt / incomplete / deleted in the current interval
        current = None
        for c in sorted(checkpoints, key=lambda c: (_time_of(c), c.step, c.id)):
            local = _time_of(c).astimezone(tz).replace(tzinfo=None)
            index = int((local - _EPOCH).total_seconds()) // size
            if index != current:
                current, passed = index, []
            if index in held:
                continue
            if c.state not in (State.VERIFIED, State.COMMITTED):
                passed.append(c)
                continue
            held.add(index)
            start = (_EPOCH + timedelta(seconds=index * size)).strftime("%Y-%m-%d %H:%M")
            note = ""
            if passed:
                shown = "; ".join(f"step {p.step} is {p.state.value}" for p in passed[:3])
                note = f" ({shown}{f' (+{len(passed) - 3} more)' if len(passed) > 3 else ''})"
            what = f"the interval from {start} ({self.timezone})"
            if c.state == State.COMMITTED:
                out[c.id] = f"{self}: will hold {what} once verified: its first save, step {c.step}{note}"
            else:
                out[c.id] = f"{self}: holds {what}: its first save, step {c.step}{note}"
        return out

    def _at_or_after_keeps(self, checkpoints: Sequence[CheckpointRecord]) -> dict[int, str]:
        out: dict[int, str] = {}
        held_up_to = -1  # every milestone at or below this step has its holder
        passed: list[CheckpointRecord] = []  # corrupt / incomplete since then
        for c in sorted(checkpoints, key=lambda c: (c.step, c.id)):
            if c.state not in (State.VERIFIED, State.COMMITTED):
                passed.append(c)
                continue
            held = self.between(held_up_to, c.step)
            held_up_to = c.step
            skipped, passed = [p for p in passed if held is not None and p.step >= held[0]], []
            if held is None:
                continue
            out[c.id] = self._reason(c, held, skipped)
        return out

    def _reason(self, c: CheckpointRecord, held: tuple[int, int, int], skipped: Sequence[CheckpointRecord]) -> str:
        smallest, largest, count = held
        note = ""
        if skipped:
            shown = "; ".join(f"step {p.step} is {p.state.value}" for p in skipped[:3])
            more = f" (+{len(skipped) - 3} more)" if len(skipped) > 3 else ""
            note = f" ({shown}{more})"
        if c.state == State.COMMITTED:
            what = f"milestone {largest}" if count == 1 else f"milestones {smallest} to {largest} ({count})"
            return f"{self}: will hold {what} once verified: first save at or after it, step {c.step}{note}"
        if largest == c.step:
            if not skipped:
                return f"{self}: step {c.step} is a milestone"
            earlier = f"milestone {smallest}" if count == 2 else f"{count - 1} earlier milestones from {smallest}"
            return f"{self}: step {c.step} is a milestone; also holds {earlier}: first save at or after it{note}"
        below = f" (also holds {count - 1} smaller milestone{'s' if count > 2 else ''})" if count > 1 else ""
        return f"{self}: holds milestone {largest}: first save at or after it, step {c.step}{below}{note}"

    def cadence_warning(self, checkpoints: Sequence[CheckpointRecord]) -> str | None:
        """Why this rule can never (or only rarely) hold a milestone at the job's save cadence, or None.

        The cadence is read from the steps in the catalog: saves every ``d``
        steps (the gcd of the gaps between steps) at offset ``r``. Pure;
        None when fewer than two saves or no regular cadence is seen.
        """
        steps = sorted({c.step for c in checkpoints if c.state != State.DELETED})
        if len(steps) < 2:
            return None
        d = 0
        for a, b in zip(steps, steps[1:], strict=False):
            d = math.gcd(d, b - a)
        if d <= 1:
            return None
        if self.interval is not None:
            return None
        r = steps[0] % d
        saves = f"saves come every {d} steps" + (f" (at step {r} mod {d})" if r else "")
        if self.match != "exact":
            if self.every is not None and self.every <= d:
                return (f"{self}: {saves}, so every save holds a milestone and none is ever deleted; "
                        f"set every_n_steps above {d}")
            return None
        fix = 'use milestone_match = "at_or_after" (the default) to keep the first save at or after each'
        if self.every is not None:
            g = math.gcd(self.every, d)
            if r % g:
                return f"{self}: {saves}, so no milestone ever falls on a save; {fix}"
            period = self.every // g * d
            if period != self.every:
                return (f"{self}: {saves}, so only one milestone in {period // self.every} "
                        f"(every {period} steps) can be kept; {fix}")
            return None
        if self.log:
            first = next((m for m in _LOG_SERIES if m % d == r), None)  # every step a catalog can hold
            if first is None:
                return f"{self}: {saves} and no step of the 1-2-5 series falls on a save, so no milestone is ever kept; {fix}"
            series = [m for m in _log_series(steps[-1]) if m >= steps[0]]
            on_saves = [m for m in series if m % d == r]
            if len(on_saves) == len(series):
                return None
            which = (f"only step{'s' if len(on_saves) > 1 else ''} {', '.join(map(str, on_saves[:3]))} "
                     f"fall{'' if len(on_saves) > 1 else 's'} on a save") if on_saves else f"the first that can is step {first}"
            return (f"{self}: {saves}, so {len(series) - len(on_saves)} of the {len(series)} milestones from step "
                    f"{steps[0]} to {steps[-1]} can never be kept ({which}); {fix}")
        never = sorted(m for m in set(self.steps) if m % d != r)
        if never:
            shown = ", ".join(str(m) for m in never[:5]) + (f" (+{len(never) - 5} more)" if len(never) > 5 else "")
            many = len(never) > 1
            return (f"{self}: {saves}, so milestone step{'s' if many else ''} {shown} "
                    f"never fall{'' if many else 's'} on a save; {fix}")
        return None


    def warning(self, checkpoints: Sequence[CheckpointRecord]) -> str | None:
        """See :meth:`cadence_warning`."""
        return self.cadence_warning(checkpoints)


_EPOCH = datetime(1970, 1, 1)


def _log_series(upto: int) -> list[int]:
    """The 1-2-5 series up to ``upto``, ascending."""
    out: list[int] = []
    scale = 1
    while scale <= upto:
        out.extend(m for m in (scale, 2 * scale, 5 * scale) if m <= upto)
        scale *= 10
    return out


#: The whole 1-2-5 series a catalog's steps (signed 64-bit) can reach.
_LOG_SERIES = tuple(_log_series(2**63 - 1))


@functools.lru_cache(maxsize=256)
def _sorted_unique(steps: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(set(steps)))


@dataclass(frozen=True)
class KeepWithin:
    """Keep every verified checkpoint saved within ``duration`` before ``now``.

    ``duration`` may hold calendar months and years (a :class:`Span`, as
    ``keep_within = "6mo"`` parses); those are counted back on the calendar
    of ``timezone``.
    """

    duration: timedelta | Span
    timezone: str = "UTC"

    def __post_init__(self) -> None:
        zone(self.timezone)
        if not Span.of(self.duration).is_positive():
            raise ConfigError(f"keep_within = {format_duration(self.duration)!r}: must be > 0, e.g. '36h'")

    def __str__(self) -> str:
        return f"keep_within {format_duration(self.duration)}"

    def keeps(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> dict[int, str]:
        cutoff = Span.of(self.duration).before(now, zone(self.timezone))
        name = str(self)  # once: a keep-all window keeps every checkpoint
        return {
            c.id: f"{name}: saved {_time_of(c).isoformat()}"
            for c in _verified(checkpoints)
            if _time_of(c) >= cutoff
        }


@functools.lru_cache(maxsize=64)
def zone(name: str) -> tzinfo:
    """The time zone named ``name`` (an IANA name such as ``"Europe/Berlin"``, or ``"UTC"``).

    Raises :class:`ConfigError` for a name the time zone database does not know.
    """
    if name == "UTC":
        return UTC
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ConfigError(
            f"timezone = {name!r}: not a time zone the system knows; write an IANA name such as "
            f"\"UTC\", \"Europe/Berlin\" or \"America/New_York\""
        ) from None


@dataclass(frozen=True)
class _KeepBuckets(_KeepN):
    """The newest verified checkpoint of each of the newest ``n`` calendar
    buckets (hours, days, weeks, months, years of ``timezone``) that have
    one, newest first, as restic's ``forget --keep-*`` decides: and when
    fewer than ``n`` buckets have a checkpoint, the oldest verified
    checkpoint is kept as well (restic's rule: as much history as the
    counts allow)."""

    timezone: str = "UTC"
    unit: ClassVar[str]

    def __post_init__(self) -> None:
        super().__post_init__()
        zone(self.timezone)

    def bucket(self, local: datetime) -> str:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def keeps(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> dict[int, str]:
        tz = zone(self.timezone)
        out: dict[int, str] = {}
        seen: set[str] = set()
        ordered = sorted(_verified(checkpoints), key=lambda c: (_time_of(c), c.step, c.id), reverse=True)
        for c in ordered:
            if len(seen) >= self.n:
                break
            b = self.bucket(_time_of(c).astimezone(tz))
            if b not in seen:
                seen.add(b)
                out[c.id] = f"{self.key} {self.n}: newest of {b} ({self.timezone})"
        if ordered and len(seen) < self.n and ordered[-1].id not in out:
            oldest = ordered[-1]
            b = self.bucket(_time_of(oldest).astimezone(tz))
            out[oldest.id] = (f"{self.key} {self.n}: oldest verified, of {b} ({self.timezone}): kept while only "
                              f"{len(seen)} of {self.n} {self.unit}s have a checkpoint")
        return out


@dataclass(frozen=True)
class KeepHourly(_KeepBuckets):
    """Keep the newest verified checkpoint of each of the last ``n`` hours (of ``timezone``) that have one."""

    key = "keep_hourly"
    example = 24
    unit = "hour"

    def bucket(self, local: datetime) -> str:
        return local.strftime("%Y-%m-%d %H:00")


@dataclass(frozen=True)
class KeepDaily(_KeepBuckets):
    """Keep the newest verified checkpoint of each of the last ``n`` days (of ``timezone``) that have one."""

    key = "keep_daily"
    example = 7
    unit = "day"

    def bucket(self, local: datetime) -> str:
        return local.strftime("%Y-%m-%d")


@dataclass(frozen=True)
class KeepWeekly(_KeepBuckets):
    """Keep the newest verified checkpoint of each of the last ``n`` ISO weeks (of ``timezone``) that have one."""

    key = "keep_weekly"
    example = 4
    unit = "week"

    def bucket(self, local: datetime) -> str:
        y, w, _ = local.isocalendar()
        return f"{y}-W{w:02d}"


@dataclass(frozen=True)
class KeepMonthly(_KeepBuckets):
    """Keep the newest verified checkpoint of each of the last ``n`` months (of ``timezone``) that have one."""

    key = "keep_monthly"
    example = 12
    unit = "month"

    def bucket(self, local: datetime) -> str:
        return local.strftime("%Y-%m")


@dataclass(frozen=True)
class KeepYearly(_KeepBuckets):
    """Keep the newest verified checkpoint of each of the last ``n`` years (of ``timezone``) that have one."""

    key = "keep_yearly"
    example = 5
    unit = "year"

    def bucket(self, local: datetime) -> str:
        return f"{local.year:04d}"


BestMode = Literal["min", "max"]
BEST_MODES: tuple[BestMode, ...] = ("min", "max")


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``n`` verified checkpoints with the best recorded ``metric``:
    the lowest with ``mode = "min"`` (a loss), the highest with ``"max"`` (an
    accuracy), as Orbax's ``BestN``, Lightning's ``save_top_k`` and the HF
    Trainer's ``metric_for_best_model`` choose.

    * **Ties**: checkpoints with equal values rank newest (highest step)
      first, so exactly ``n`` are ranked best and a newer save of an equal
      score replaces an older one.
    * **Missing metrics**: a verified checkpoint that recorded no value for
      ``metric`` (or a NaN or infinite one) is neither best nor worst: it
      takes no place among the ``n`` and pushes none out. With
      ``keep_without_metric`` (the default, as Orbax's
      ``keep_checkpoints_without_metrics``) this rule keeps it, saying so;
      set it false to leave such checkpoints to the other rules.

    The values come from the catalog (``CheckpointRecord.metrics``, read at
    scan time), so the rule is pure and ``n log n``.
    """

    metric: str
    mode: BestMode = "min"
    n: int = 1
    keep_without_metric: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric.strip():
            raise ConfigError(f"keep_best metric = {self.metric!r}: name the metric, e.g. metric = \"eval_loss\"")
        if self.mode not in BEST_MODES:
            raise ConfigError(f"keep_best mode = {self.mode!r}: must be \"min\" (a loss) or \"max\" (an accuracy)")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"keep_best n = {self.n!r}: must be a whole number ≥ 1, e.g. n = 3")

    def __str__(self) -> str:
        return f"keep_best {self.n} by {self.metric} ({self.mode})"

    def ranked(self, checkpoints: Sequence[CheckpointRecord]) -> list[tuple[CheckpointRecord, float]]:
        """The verified checkpoints with a finite ``metric``, best first (ties: newest first)."""
        scored = [(c, v) for c in _verified(checkpoints) if (v := _finite(c.metric(self.metric))) is not None]
        sign = 1.0 if self.mode == "min" else -1.0
        scored.sort(key=lambda cv: (sign * cv[1], -cv[0].step, -cv[0].id))
        return scored

    def best(self, checkpoints: Sequence[CheckpointRecord]) -> list[tuple[CheckpointRecord, float]]:
        """The ``n`` best, best first."""
        return self.ranked(checkpoints)[: self.n]

    def keeps(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> dict[int, str]:
        ranked = self.ranked(checkpoints)
        steps_of: dict[float, list[int]] = {}
        for c, v in ranked:
            steps_of.setdefault(v, []).append(c.step)
        out: dict[int, str] = {}
        for i, (c, v) in enumerate(ranked[: self.n]):
            ties = [s for s in steps_of[v] if s != c.step]
            tie = f" (tied with step {ties[0]}{'' if len(ties) == 1 else f' and {len(ties) - 1} more'}: " \
                  f"newer steps rank first)" if ties else ""
            out[c.id] = f"{self}: best {i + 1} of {self.n}, {self.metric} = {v:.6g}{tie}"
        if self.keep_without_metric:
            for c in _verified(checkpoints):
                if _finite(value := c.metric(self.metric)) is None:
                    what = f"no {self.metric} recorded" if value is None else f"{self.metric} = {value} is no score"
                    out[c.id] = f"{self}: {what}, so neither best nor worst: kept (keep_without_metric)"
        return out

    def warning(self, checkpoints: Sequence[CheckpointRecord]) -> str | None:
        """Why this rule keeps more (or less) than its ``n`` at this job, or None. Pure."""
        verified = _verified(checkpoints)
        without = sum(1 for c in verified if _finite(c.metric(self.metric)) is None)
        if not verified or not without:
            return None
        if self.keep_without_metric and without * 2 > len(verified):
            return (f"{self}: {without} of {len(verified)} verified checkpoints record no {self.metric}, and "
                    f"keep_without_metric keeps every one of them; record it (the job's metrics.jsonl, or the "
                    f"format's own metadata) or set keep_without_metric = false")
        if not self.keep_without_metric and without == len(verified):
            return (f"{self}: no verified checkpoint records {self.metric}, so this rule keeps nothing; "
                    f"check the metric's name (ckptier ls --json shows each checkpoint's metrics)")
        return None


@dataclass(frozen=True)
class Pinned:
    """Keep the checkpoints at these steps, whatever their state."""

    steps: tuple[int, ...]

    def __str__(self) -> str:
        return "pinned " + ", ".join(str(s) for s in sorted(self.steps))

    def keeps(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> dict[int, str]:
        return {c.id: f"pinned step {c.step}" for c in checkpoints if c.step in self.steps}


def _rule_is_empty(rule: Rule) -> bool:
    if isinstance(rule, _KeepN):
        return rule.n == 0
    if isinstance(rule, Pinned):
        return not rule.steps
    return False


def _rule_zone(rule: Rule) -> str | None:
    """The time zone a rule's decisions depend on, or None when they depend on none."""
    if isinstance(rule, _KeepBuckets):
        return rule.timezone
    if isinstance(rule, KeepWithin):
        return rule.timezone if Span.of(rule.duration).months else None
    if isinstance(rule, Milestones):
        return rule.timezone if rule.interval is not None else None
    return None


def best_ranked(policy: Policy, checkpoints: Sequence[CheckpointRecord]) -> set[int]:
    """Ids of ONE job's checkpoints that some ``keep_best`` rule of ``policy``
    ranks among its ``n`` best (the checkpoints a deletion of a worse one
    rests on, proven again before it). Pure."""
    return {c.id for r in policy.rules if isinstance(r, KeepBest) for c, _ in r.best(checkpoints)}


# -------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class Policy:
    """Rules plus the safety settings of one ``[[policy]]`` table.

    ``jobs``: glob of job names it applies to. ``grace``: how long an
    incomplete save counts as in flight. ``min_verified``: floor on verified
    checkpoints that keep a hot copy. ``archive``: URL milestones are promoted
    to (``None``: no archive tier, milestones stay hot). ``hot_after_archive``:
    ``"delete"`` lets a milestone's hot copy go once its archive copy is
    verified. ``max_missing_fraction``: shrink guard threshold (fraction of a
    job's live checkpoints missing from hot storage above which nothing is
    deleted). A policy whose rules keep nothing is refused.

    When a milestone is promoted (needs ``archive``): ``archive_after``
    (``None``: no wait) holds it in hot storage until it is older than that;
    ``archive_when = "leaving_hot"`` holds it until no other rule keeps it
    hot (keep_last, keep_within, keep_daily, keep_weekly, pinned, the newest
    verified, min_drilled), so it is never stored twice; ``"immediately"``
    (the default) promotes it as soon as it is verified, an early second
    copy. ``min_drilled``: the newest N checkpoints whose most recent
    restore drill passed keep their hot copy (0: no floor). ``timezone``:
    the IANA time zone whose calendar the calendar rules (``keep_hourly`` to
    ``keep_yearly``, ``keep_within`` in months, milestones ``every`` a
    duration) count in; every such rule of the policy must use it.
    """

    rules: tuple[Rule, ...]
    jobs: str = "*"
    grace: timedelta = timedelta(hours=2)
    min_verified: int = 2
    archive: str | None = None
    storage_class: str | None = None
    hot_after_archive: HotAfterArchive = "delete"
    max_missing_fraction: float = DEFAULT_MAX_MISSING_FRACTION
    delete_stale_incomplete: bool = False
    archive_tiers: tuple[ArchiveTier, ...] = ()
    archive_after: timedelta | Span | None = None
    archive_when: ArchiveWhen = "immediately"
    min_drilled: int = 0
    timezone: str = "UTC"

    def __post_init__(self) -> None:
        if not self.rules or all(_rule_is_empty(r) for r in self.rules):
            raise ConfigError(
                f"policy for jobs {self.jobs!r} keeps nothing: set one of {', '.join(RULE_NAMES)}"
            )
        zone(self.timezone)
        for r in self.rules:
            if (tz := _rule_zone(r)) is not None and tz != self.timezone:
                raise ConfigError(f"policy for jobs {self.jobs!r}: rule {r} counts in {tz}, the policy in "
                                  f"timezone {self.timezone}; give the rule the policy's timezone")
        if self.min_verified < 0:
            raise ConfigError(f"min_verified = {self.min_verified}: must be ≥ 0, e.g. 2")
        if self.grace < timedelta(0):
            raise ConfigError(f"grace = {self.grace}: must be ≥ 0, e.g. '2h'")
        if not 0.0 <= self.max_missing_fraction <= 1.0:
            raise ConfigError(
                f"max_missing_fraction = {self.max_missing_fraction}: must be between 0 and 1, e.g. 0.5"
            )
        if self.hot_after_archive not in ("delete", "keep"):
            raise ConfigError(
                f"hot_after_archive = {self.hot_after_archive!r}: must be 'delete' or 'keep'"
            )
        if self.min_drilled < 0:
            raise ConfigError(f"min_drilled = {self.min_drilled}: must be ≥ 0, e.g. 1")
        if self.archive_after is not None and not Span.of(self.archive_after).is_positive():
            raise ConfigError(
                f"archive_after = {format_duration(self.archive_after)!r}: must be longer than zero, e.g. '14d'"
            )
        if self.archive_when not in ARCHIVE_WHENS:
            raise ConfigError(
                f"archive_when = {self.archive_when!r}: must be 'immediately' or 'leaving_hot'"
            )

    def __str__(self) -> str:
        parts = [str(r) for r in self.rules]
        if self.timezone != "UTC" or any(_rule_zone(r) is not None for r in self.rules):
            parts.append(f"timezone {self.timezone}")
        parts.append(f"grace {format_duration(self.grace)}")
        parts.append(f"min_verified {self.min_verified}")
        if self.min_drilled:
            parts.append(f"min_drilled {self.min_drilled}")
        if self.archive:
            parts.append(f"archive {self.archive} (hot after archive: {self.hot_after_archive})")
            if self.archive_after is not None:
                parts.append(f"archive_after {format_duration(self.archive_after)}")
            if self.archive_when != "immediately":
                parts.append(f"archive_when {self.archive_when}")
        return ", ".join(parts)

    @property
    def milestones(self) -> tuple[Milestones, ...]:
        return tuple(r for r in self.rules if isinstance(r, Milestones))

    def is_milestone(self, step: int) -> bool:
        """True when ``step`` is itself a milestone step of some rule (:meth:`Milestones.is_milestone`);
        which checkpoint *holds* a milestone is :meth:`Milestones.keeps`, as planning asks it."""
        return any(m.is_milestone(step) for m in self.milestones)

    def are_milestones(self, steps: Iterable[int]) -> list[bool]:
        """:meth:`is_milestone` of each of ``steps``, in order (:attr:`milestones`, a new tuple per
        call, read once)."""
        rules = self.milestones
        return [any(m.is_milestone(step) for m in rules) for step in steps]


# ---------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class PlanItem:
    """The decision for one checkpoint.

    ``action``: ``keep`` (hot copy stays), ``promote`` (stays hot until a
    verified archive copy exists) or ``delete``. ``scope`` says what a delete
    removes: ``"checkpoint"`` (its hot copy, and it was the only copy) or
    ``"hot-copy"`` (the hot copy only; an archive copy remains). For keep and
    promote ``scope`` is ``"checkpoint"``. ``bytes``: the checkpoint's size in
    bytes (uncompressed). ``reasons``: never empty, most important first.
    """

    job: str
    step: int
    checkpoint_id: int
    action: Action
    reasons: tuple[str, ...]
    bytes: int
    scope: Scope = "checkpoint"
    state: str = ""


@dataclass(frozen=True)
class Plan:
    """A retention plan: one item per live input checkpoint, ordered by (job, step, id).

    ``refused`` is ``None`` or one line per job (joined by ``"; "``) saying
    why deletion was suspended; ``refused_jobs`` has the same by job.
    ``excluded`` lists ids of input checkpoints already ``deleted``;
    ``missing`` ids of those a scan found missing from the hot store
    (``missing_since`` set: to report); ``stale`` ids of incomplete saves
    past their grace (candidates for review). ``warnings``: one line per
    job and milestone rule that can never (or only rarely) hold a
    milestone at the job's save cadence, ordered by job.
    """

    items: list[PlanItem]
    refused: str | None = None
    refused_jobs: dict[str, str] = field(default_factory=dict)
    excluded: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()
    stale: tuple[int, ...] = ()
    warnings: tuple[str, ...] = ()

    def _bytes(self, action: Action) -> int:
        return sum(i.bytes for i in self.items if i.action == action)

    @property
    def bytes_kept(self) -> int:
        return self._bytes("keep")

    @property
    def bytes_promoted(self) -> int:
        return self._bytes("promote")

    @property
    def bytes_deleted(self) -> int:
        """Hot bytes the deletions free (both scopes)."""
        return self._bytes("delete")

    def by_action(self, action: Action) -> list[PlanItem]:
        return [i for i in self.items if i.action == action]

    def summary(self) -> dict[str, int]:
        return {
            "keep": len(self.by_action("keep")),
            "promote": len(self.by_action("promote")),
            "delete": len(self.by_action("delete")),
            "bytes_kept": self.bytes_kept,
            "bytes_promoted": self.bytes_promoted,
            "bytes_deleted": self.bytes_deleted,
        }


def hot_present(c: CheckpointRecord) -> bool:
    """True unless a scan found it missing or the catalog records its hot copy gone."""
    if c.missing_since is not None:
        return False
    return not any(c_.tier == Tier.HOT and c_.state in (CopyState.MISSING, CopyState.DELETED) for c_ in c.copies)


def _has_archive_copy(c: CheckpointRecord) -> bool:
    return c.archive_copy() is not None


def _archive_verified_at(c: CheckpointRecord) -> str:
    times = [
        x.verified_at
        for x in c.copies
        if x.tier == Tier.ARCHIVE and x.state == CopyState.PRESENT and x.verified_at is not None
    ]
    return max(times).isoformat() if times else "?"


def shrink_guard(checkpoints: Sequence[CheckpointRecord], max_missing_fraction: float) -> str | None:
    """Why deletion must be suspended for one job's live checkpoints, or None.

    Suspended when every checkpoint is missing from hot storage, or when the
    fraction missing exceeds ``max_missing_fraction``.
    """
    live = [c for c in checkpoints if c.state != State.DELETED]
    if not live:
        return None
    gone = sum(1 for c in live if c.missing_since is not None)
    frac = gone / len(live)
    if gone == len(live) or frac > max_missing_fraction:
        return (
            f"deletion suspended for job {live[0].job!r}: {gone} of {len(live)} checkpoints "
            f"missing from hot storage ({frac:.0%} > max_missing_fraction {max_missing_fraction:.0%}); "
            f"check the scanned URL and credentials, then rescan; if the trainer rotates its own "
            f"checkpoints, 'ckptier forget --job {live[0].job} --missing' tombstones those gone from every tier"
        )
    return None


def newest_drilled(
    checkpoints: Sequence[CheckpointRecord], drill_passed: Mapping[int, datetime], n: int
) -> list[CheckpointRecord]:
    """The ``n`` highest-step live checkpoints of ONE job whose most recent drill passed, newest first."""
    passed = [c for c in checkpoints if c.id in drill_passed and c.state != State.DELETED]
    return _newest_first(passed)[:n] if n > 0 else []


def _promotion_wait(c: CheckpointRecord, policy: Policy, held_hot: set[int], now: datetime) -> str | None:
    """Why a milestone without a verified archive copy is not promoted yet, or None."""
    if policy.archive_after is not None:
        age = now - _time_of(c)
        if _time_of(c) > Span.of(policy.archive_after).before(now, zone(policy.timezone)):
            return (f"archive_after {format_duration(policy.archive_after)}: promoted once older "
                    f"(saved {format_duration(_whole_seconds(age))} ago)")
    if policy.archive_when == "leaving_hot" and c.id in held_hot:
        return "archive_when leaving_hot: promoted when no other rule keeps it in hot storage"
    return None


def _whole_seconds(d: timedelta) -> timedelta:
    return timedelta(seconds=max(int(d.total_seconds()), 0))


# ------------------------------------------------------------------- stages
#
# One job is planned by a short list of small named stages applied in order,
# as Orbax composes its preservation policies: first the policy's rules vote
# (kept if any rule keeps it), then the floors no policy can switch off each
# add their own reason or turn a deletion into a keep. Each stage is a frozen
# dataclass holding only its settings; the working state of the job it acts
# on (:class:`_Job`) lives for one call of :func:`_plan_job`, so planning as
# a whole stays pure.


@dataclass
class _Decision:
    """The decision for one checkpoint while the stages run."""

    action: Action
    reasons: list[str]
    scope: Scope = "checkpoint"


@dataclass
class _Job:
    """The working plan of ONE job: its live checkpoints ``cs`` (by step, id),
    its tombstones, and what the stages decided so far."""

    cs: Sequence[CheckpointRecord]
    tombstones: Sequence[CheckpointRecord]
    policy: Policy
    now: datetime
    drill_passed: Mapping[int, datetime]
    #: Reasons the rules (and the keeping floors) give each checkpoint, in order.
    kept_by: dict[int, list[str]] = field(default_factory=dict)
    #: Ids something other than a milestone keeps: those need their hot copy.
    held_hot: set[int] = field(default_factory=set)
    #: Ids holding (or, committed, pending) a milestone.
    milestone_ids: set[int] = field(default_factory=set)
    decided: dict[int, _Decision] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)
    refused: str | None = None

    def __post_init__(self) -> None:
        self.kept_by = {c.id: [] for c in self.cs}

    @property
    def verified(self) -> list[CheckpointRecord]:
        """The job's verified checkpoints, newest first."""
        return _newest_first(_verified(self.cs))


class Stage(Protocol):
    """One step of planning a job: reads and refines the job's working plan."""

    def apply(self, job: _Job) -> None: ...


@dataclass(frozen=True)
class RulesVote:
    """The policy's rules: a checkpoint is kept when any rule keeps it, with
    every rule's reason. Milestone rules also see the job's tombstones, so
    that a milestone passed on from one says so."""

    rules: tuple[Rule, ...]

    def __str__(self) -> str:
        return "rules: " + "; ".join(str(r) for r in self.rules)

    def apply(self, job: _Job) -> None:
        for rule in self.rules:
            milestone = isinstance(rule, Milestones)
            kept = rule.keeps([*job.cs, *job.tombstones] if milestone else job.cs, job.now)
            (job.milestone_ids if milestone else job.held_hot).update(kept)
            for cid, why in kept.items():
                job.kept_by[cid].append(why)


@dataclass(frozen=True)
class DrilledFloor:
    """``min_drilled``: the ``n`` newest checkpoints whose most recent drill
    passed keep their hot copy, like a rule (0: no floor)."""

    n: int

    def __str__(self) -> str:
        return f"min_drilled {self.n}: the {self.n} newest drill-passed checkpoints keep their hot copy"

    def apply(self, job: _Job) -> None:
        for i, c in enumerate(newest_drilled(job.cs, job.drill_passed, self.n)):
            rank = "newest" if i == 0 else f"#{i + 1} newest"
            job.kept_by[c.id].append(
                f"min_drilled {self.n}: {rank} drill-passed recovery point "
                f"(drill passed {job.drill_passed[c.id].isoformat()})"
            )
            job.held_hot.add(c.id)


@dataclass(frozen=True)
class NewestVerifiedFloor:
    """The newest verified checkpoint of a job (highest step) is never deleted,
    not even its hot copy; its reason comes first."""

    def __str__(self) -> str:
        return "the newest verified checkpoint is never deleted"

    def apply(self, job: _Job) -> None:
        verified = job.verified
        if verified:
            job.kept_by[verified[0].id].insert(0, "newest verified checkpoint of the job")
            job.held_hot.add(verified[0].id)


@dataclass(frozen=True)
class InFlightFloor:
    """Incomplete saves: kept while younger than ``grace`` (in flight, never
    counted); past it they are stale, kept for review unless
    ``delete_stale`` is set and nothing else keeps them."""

    grace: timedelta
    delete_stale: bool = False

    def __str__(self) -> str:
        stale = "deleted (delete_stale_incomplete)" if self.delete_stale else "kept for review"
        return f"incomplete saves in flight for up to grace {format_duration(self.grace)}; stale ones {stale}"

    def apply(self, job: _Job) -> None:
        for c in job.cs:
            if c.state != State.INCOMPLETE:
                continue
            reasons = job.kept_by[c.id]
            age = job.now - _time_of(c)
            if age < self.grace:
                job.decided[c.id] = _Decision("keep", [f"in flight: incomplete for {format_duration(age)} "
                                                       f"< grace {format_duration(self.grace)}", *reasons])
                continue
            job.stale.append(c.id)
            note = f"stale incomplete: past grace {format_duration(self.grace)}"
            if self.delete_stale and hot_present(c) and not reasons:
                job.decided[c.id] = _Decision("delete", [f"{note}; delete_stale_incomplete is set"])
            else:
                job.decided[c.id] = _Decision("keep", [f"{note}: candidate for review", *reasons])


@dataclass(frozen=True)
class EvidenceFloor:
    """Corrupt checkpoints are kept as evidence, never deleted automatically."""

    def __str__(self) -> str:
        return "corrupt checkpoints are kept as evidence"

    def apply(self, job: _Job) -> None:
        for c in job.cs:
            if c.state == State.CORRUPT:
                detail = f" ({c.state_reason})" if c.state_reason else ""
                job.decided[c.id] = _Decision(
                    "keep", [f"corrupt{detail}: kept as evidence, never auto-deleted", *job.kept_by[c.id]])


@dataclass(frozen=True)
class UnverifiedFloor:
    """Committed checkpoints are kept until verification proves their bytes."""

    def __str__(self) -> str:
        return "committed checkpoints are kept until verified"

    def apply(self, job: _Job) -> None:
        for c in job.cs:
            if c.state == State.COMMITTED:
                job.decided[c.id] = _Decision(
                    "keep", ["committed, not yet verified: kept until verify proves its bytes", *job.kept_by[c.id]])


@dataclass(frozen=True)
class VerifiedDecision:
    """Verified checkpoints: kept when something keeps them, else deleted; a
    milestone with an ``archive`` is promoted until it has a verified archive
    copy, after which its hot copy goes unless something else holds it hot
    (or ``hot_after_archive = "keep"``)."""

    policy: Policy

    def __str__(self) -> str:
        p = self.policy
        if not p.archive:
            return "verified checkpoints no rule keeps are deleted; milestones stay hot (no archive)"
        return (f"verified checkpoints no rule keeps are deleted; milestones are promoted to {p.archive} "
                f"(hot after archive: {p.hot_after_archive})")

    def apply(self, job: _Job) -> None:
        unkept = f"not kept by any rule ({'; '.join(str(r) for r in self.policy.rules)})"  # once, not per checkpoint
        for c in job.cs:
            if c.state == State.VERIFIED:
                job.decided[c.id] = self._decide(c, job, unkept)

    def _decide(self, c: CheckpointRecord, job: _Job, unkept: str) -> _Decision:
        policy = self.policy
        reasons = list(job.kept_by[c.id])
        present = hot_present(c)
        if c.id in job.milestone_ids and policy.archive:
            if not c.has_verified_archive():
                reasons.append(f"no verified archive copy yet: promote to {policy.archive}")
                if not present:
                    return _Decision("keep", [*reasons, "cannot promote while missing from hot storage"])
                if (wait := _promotion_wait(c, policy, job.held_hot, job.now)) is not None:
                    reasons[-1] = f"no verified archive copy yet: {wait}"
                    return _Decision("keep", reasons)
                return _Decision("promote", reasons)
            if c.id in job.held_hot or policy.hot_after_archive == "keep" or not present:
                return _Decision("keep", [*reasons, f"archived copy verified at {_archive_verified_at(c)}"])
            return _Decision("delete", [*reasons, f"archived copy verified at {_archive_verified_at(c)}; "
                                                  "hot copy not needed"], "hot-copy")
        if reasons:
            if c.id in job.milestone_ids:
                reasons.append("no archive configured: milestone stays in hot storage")
            return _Decision("keep", reasons)
        if not present:
            return _Decision("keep", ["not kept by any rule"])
        return _Decision("delete", [unkept])


@dataclass(frozen=True)
class ArchiveCopyFloor:
    """Archive copies are never deleted by retention: deleting a checkpoint
    that has one deletes its hot copy only."""

    def __str__(self) -> str:
        return "archive copies are never deleted by retention"

    def apply(self, job: _Job) -> None:
        for c in job.cs:
            d = job.decided[c.id]
            if d.action == "delete" and d.scope == "checkpoint" and _has_archive_copy(c):
                d.scope = "hot-copy"
                d.reasons.append("archive copy retained: retention never deletes archive copies")


@dataclass(frozen=True)
class AbsentFloor:
    """A checkpoint missing from hot storage (or whose hot copy is gone) has
    nothing to delete: it is kept, and reported."""

    def __str__(self) -> str:
        return "checkpoints missing from hot storage are never planned for deletion"

    def apply(self, job: _Job) -> None:
        for c in job.cs:
            if c.missing_since is not None:
                job.missing.append(c.id)
                note = f"missing from hot storage since {c.missing_since.isoformat()}: nothing to delete"
            elif not hot_present(c):
                note = "hot copy already deleted: nothing to delete"
            else:
                continue
            d = job.decided[c.id]
            if d.action == "delete":  # unreachable by construction; belt and braces
                d.action = "keep"
            d.reasons.append(note)
            if _has_archive_copy(c):
                d.reasons.append("an archive copy remains")


@dataclass(frozen=True)
class MinVerifiedFloor:
    """``min_verified``: at least ``n`` verified checkpoints keep a hot copy
    (the newest ones the plan would delete are kept instead)."""

    n: int

    def __str__(self) -> str:
        return f"min_verified {self.n}: at least {self.n} verified checkpoints keep a hot copy"

    def apply(self, job: _Job) -> None:
        verified = job.verified

        def hot_kept() -> int:
            return sum(1 for c in verified if job.decided[c.id].action != "delete" and hot_present(c))

        for c in verified:
            if hot_kept() >= self.n:
                break
            d = job.decided[c.id]
            if d.action == "delete":
                job.decided[c.id] = _Decision(
                    "keep",
                    [f"min_verified {self.n}: keep at least {self.n} verified checkpoints in hot storage",
                     *(f"otherwise: {r}" for r in d.reasons)],
                )


@dataclass(frozen=True)
class ShrinkGuard:
    """When more than ``max_missing_fraction`` of a job's checkpoints (or all
    of them) are missing from hot storage, every deletion of the job is
    suspended (see :func:`shrink_guard`)."""

    max_missing_fraction: float

    def __str__(self) -> str:
        return f"deletions suspended when over {self.max_missing_fraction:.0%} of a job is missing from hot storage"

    def apply(self, job: _Job) -> None:
        job.refused = shrink_guard(job.cs, self.max_missing_fraction)
        if job.refused is None:
            return
        for cid, d in list(job.decided.items()):
            if d.action == "delete":
                job.decided[cid] = _Decision("keep", [job.refused, *(f"would delete: {r}" for r in d.reasons)])


def stages(policy: Policy) -> tuple[Stage, ...]:
    """The stages that plan each job under ``policy``, in the order they apply:
    the rules' votes, the floors that keep (``min_drilled``, the newest
    verified), the decision by state, then the floors that turn a deletion
    into a keep or a smaller one (archive copies, absent hot copies,
    ``min_verified``, the shrink guard)."""
    out: list[Stage] = [RulesVote(policy.rules)]
    if policy.min_drilled:
        out.append(DrilledFloor(policy.min_drilled))
    out += [
        NewestVerifiedFloor(),
        InFlightFloor(policy.grace, policy.delete_stale_incomplete),
        EvidenceFloor(),
        UnverifiedFloor(),
        VerifiedDecision(policy),
        ArchiveCopyFloor(),
        AbsentFloor(),
        MinVerifiedFloor(policy.min_verified),
        ShrinkGuard(policy.max_missing_fraction),
    ]
    return tuple(out)


def floors(policy: Policy) -> tuple[Stage, ...]:
    """The stages of :func:`stages` that no policy can switch off (all but the
    rules' vote and the decision itself), in order: what ``plan`` prints
    under each policy, so that nothing it keeps is a hidden rule."""
    return tuple(s for s in stages(policy) if not isinstance(s, (RulesVote, VerifiedDecision)))


@dataclass(frozen=True)
class _JobPlan:
    items: list[PlanItem]
    refused: str | None
    missing: list[int]
    stale: list[int]


def _plan_job(
    cs: Sequence[CheckpointRecord],
    policy: Policy,
    now: datetime,
    drill_passed: Mapping[int, datetime],
    tombstones: Sequence[CheckpointRecord] = (),
) -> _JobPlan:
    """Plan ONE job: its live checkpoints ``cs`` (ordered by step, id) run
    through :func:`stages`; items in the order of ``cs``."""
    job = _Job(cs, tombstones, policy, now, drill_passed)
    for stage in stages(policy):
        stage.apply(job)
    items = [
        PlanItem(
            job=c.job,
            step=c.step,
            checkpoint_id=c.id,
            action=job.decided[c.id].action,
            reasons=tuple(job.decided[c.id].reasons),
            bytes=c.bytes,
            scope=job.decided[c.id].scope,
            state=c.state.value,
        )
        for c in cs
    ]
    return _JobPlan(items, job.refused, job.missing, job.stale)


def plan_retention(
    checkpoints: Sequence[CheckpointRecord],
    policy: Policy,
    *,
    now: datetime,
    drill_passed: Mapping[int, datetime] | None = None,
) -> Plan:
    """Decide keep / promote / delete for every live checkpoint, with reasons.

    ``checkpoints`` may hold several jobs in any order; each job is planned
    separately under the same ``policy``. ``now`` is timezone-aware and is the
    only time used (grace, keep_within, archive_after). ``drill_passed`` maps
    a checkpoint id to when its most recent restore drill passed (only
    checkpoints whose most recent drill passed; see :func:`drill_passed`);
    it matters only with ``min_drilled``. Pure and deterministic: the same
    input in any order gives the same plan. Items cover every input
    checkpoint not in state ``deleted``, exactly once, ordered by
    (job, step, id). Raises :class:`ConfigError` when ``now`` is naive.
    """
    if now.tzinfo is None:
        raise ConfigError(f"now = {now.isoformat()} has no timezone: pass an aware UTC datetime")
    by_job: dict[str, list[CheckpointRecord]] = {}
    dead_by_job: dict[str, list[CheckpointRecord]] = {}
    excluded: list[int] = []
    for c in checkpoints:
        if c.state == State.DELETED:
            excluded.append(c.id)
            dead_by_job.setdefault(c.job, []).append(c)
            continue
        by_job.setdefault(c.job, []).append(c)
    items: list[PlanItem] = []
    refused_jobs: dict[str, str] = {}
    missing: list[int] = []
    stale: list[int] = []
    warnings: list[str] = []
    for job in sorted(by_job):
        cs = sorted(by_job[job], key=lambda c: (c.step, c.id))
        dead = sorted(dead_by_job.get(job, []), key=lambda c: (c.step, c.id))
        done = _plan_job(cs, policy, now, drill_passed or {}, dead)
        items.extend(done.items)
        missing.extend(done.missing)
        stale.extend(done.stale)
        if done.refused:
            refused_jobs[job] = done.refused
        warnings.extend(f"job {job!r}: {w}" for r in policy.rules if isinstance(r, Warns) and (w := r.warning(cs)))
    return Plan(
        items=items,
        refused="; ".join(refused_jobs.values()) or None,
        refused_jobs=refused_jobs,
        excluded=tuple(sorted(excluded)),
        missing=tuple(sorted(missing)),
        stale=tuple(sorted(stale)),
        warnings=tuple(warnings),
    )


def drill_passed(drills: Iterable[DrillLike]) -> dict[int, datetime]:
    """Checkpoint id -> when its most recent drill passed, for checkpoints whose most
    recent drill (:func:`ckptier.storage.transitions.latest_drill`, the catalog's own
    definition) passed. Pure; order-independent."""
    return {cid: d.finished_at or d.started_at for cid, d in latest_drills(drills).items() if d.ok}


def keepers(
    records: Sequence[CheckpointRecord], policy: Policy | None, items: Sequence[PlanItem]
) -> list[CheckpointRecord]:
    """The checkpoints of one job whose soundness the plan's deletions rest on, newest first. Pure.

    With a ``policy``: the newest verified checkpoint, the ``keep_last``
    newest verified ones, the ``keep_best`` best-ranked ones, and the
    ``min_verified`` newest verified ones that keep a hot copy (the floor)
    — every checkpoint a deletion is justified by. Without one: every verified checkpoint the plan (``items``)
    does not delete. ``records`` are the job's current records; tombstones
    and checkpoints in other states never count.
    """
    deleting = {i.checkpoint_id for i in items if i.action == "delete"}
    verified = sorted((c for c in records if c.state == State.VERIFIED), key=lambda c: (c.step, c.id), reverse=True)
    if policy is None:
        chosen = [c for c in verified if c.id not in deleting]
    else:
        last = max([1] + [r.n for r in policy.rules if isinstance(r, KeepLast)])
        floor = [c for c in verified if hot_present(c) and c.id not in deleting][: policy.min_verified]
        best = best_ranked(policy, records)
        chosen = verified[:last] + [c for c in verified if c.id in best] + floor
    unique: dict[int, CheckpointRecord] = {}
    for c in chosen:
        unique.setdefault(c.id, c)
    return list(unique.values())


def render_plan_table(plan: Plan) -> list[dict[str, Any]]:
    """The plan as JSON-ready rows: job, step, checkpoint_id, state, action, scope, reasons, bytes."""
    return [
        {
            "job": i.job,
            "step": i.step,
            "checkpoint_id": i.checkpoint_id,
            "state": i.state,
            "action": i.action,
            "scope": i.scope,
            "reasons": list(i.reasons),
            "bytes": i.bytes,
        }
        for i in plan.items
    ]
