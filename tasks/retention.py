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

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, UTC
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from ckptier.storage.errors import ConfigError
from ckptier.storage.records import CheckpointRecord, CopyState, State, Tier
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

_UNIT_SECONDS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}
_DURATION_RE = re.compile(r"^(?:\d+[wdhms])+$")
_DURATION_PART_RE = re.compile(r"(\d+)([wdhms])")


def parse_duration(text: str) -> timedelta:
    """Parse ``"36h"``, ``"7d"``, ``"2w"``, ``"1d12h"``, ``"90s"`` into a timedelta.

    Units: ``w`` weeks, ``d`` days, ``h`` hours, ``m`` minutes, ``s`` seconds;
    parts may be combined, largest first or not. Raises :class:`ConfigError`
    (a ``ValueError``) on anything else.
    """
    s = text.strip().lower() if isinstance(text, str) else ""
    if not s or not _DURATION_RE.match(s):
        raise ConfigError(
            f"duration {text!r} is not understood: write a number and a unit "
            f"(s, m, h, d, w), e.g. '36h', '7d' or '1d12h'"
        )
    seconds = sum(int(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART_RE.findall(s))
    return timedelta(seconds=seconds)


def format_duration(delta: timedelta) -> str:
    """The shortest exact spelling of ``delta`` in the units of :func:`parse_duration`."""
    total = int(delta.total_seconds())
    if total == 0:
        return "0s"
    parts = []
    for unit, size in _UNIT_SECONDS.items():
        n, total = divmod(total, size)
        if n:
            parts.append(f"{n}{unit}")
    return "".join(parts)


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


@runtime_checkable
class Rule(Protocol):
    """One retention rule.

    ``keeps`` receives the live (not ``deleted``) checkpoints of ONE job in
    any order and returns ``{checkpoint id: reason}`` for those it keeps. It
    is pure: same input, same answer; ``now`` is the only notion of time.
    """

    def keeps(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> dict[int, str]: ...


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
    ``every`` (steps that are positive multiples of ``every``) or ``steps``
    (an explicit set). Milestones are what gets promoted to the archive.

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
    """

    steps: tuple[int, ...] = ()
    log: bool = False
    every: int | None = None
    match: MilestoneMatch = "at_or_after"

    def __post_init__(self) -> None:
        given = sum([bool(self.steps), self.log, self.every is not None])
        if given != 1:
            raise ConfigError(
                f"milestones: give exactly one of log, every or steps (got {given}); "
                f"e.g. milestones = \"log\""
            )
        if self.every is not None and self.every <= 0:
            raise ConfigError(f"milestones every_n_steps = {self.every}: must be > 0, e.g. 10000")
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
        else:
            text = "milestones at steps " + ", ".join(str(s) for s in sorted(set(self.steps)))
        return text + (" (exact match)" if self.match == "exact" else "")

    def is_milestone(self, step: int) -> bool:
        """True when ``step`` is one of the milestone steps themselves."""
        if self.log:
            return is_log_milestone(step)
        if self.every is not None:
            return step > 0 and step % self.every == 0
        return step in self.steps

    def between(self, lo: int, hi: int) -> tuple[int, int, int] | None:
        """The milestone steps M with ``lo < M <= hi``: ``(smallest, largest, count)``, or None."""
        if hi <= lo or hi < 0:
            return None
        if self.every is not None:
            n = self.every
            first = (max(lo, 0) // n + 1) * n
            last = hi // n * n
            return (first, last, (last - first) // n + 1) if first <= last else None
        found = [m for m in (_log_series(hi) if self.log else sorted(set(self.steps))) if lo < m <= hi]
        return (found[0], found[-1], len(found)) if found else None

    def keeps(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> dict[int, str]:
        """As :class:`Rule`; ``checkpoints`` may also hold the job's tombstones, which
        never hold a milestone but are named when a milestone passes over them."""
        if self.match == "exact":
            return {
                c.id: f"{self}: step {c.step} is a milestone"
                for c in _verified(checkpoints)
                if self.is_milestone(c.step)
            }
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
            first = next((m for m in _log_series(10**18) if m % d == r), None)
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


def _log_series(upto: int) -> list[int]:
    """The 1-2-5 series up to ``upto``, ascending."""
    out: list[int] = []
    scale = 1
    while scale <= upto:
        out.extend(m for m in (scale, 2 * scale, 5 * scale) if m <= upto)
        scale *= 10
    return out


@dataclass(frozen=True)
class KeepWithin:
    """Keep every verified checkpoint saved within ``duration`` before ``now``."""

    duration: timedelta

    def __post_init__(self) -> None:
        if self.duration <= timedelta(0):
            raise ConfigError(f"keep_within = {format_duration(self.duration)!r}: must be > 0, e.g. '36h'")

    def __str__(self) -> str:
        return f"keep_within {format_duration(self.duration)}"

    def keeps(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> dict[int, str]:
        cutoff = now - self.duration
        return {
            c.id: f"{self}: saved {_time_of(c).isoformat()}"
            for c in _verified(checkpoints)
            if _time_of(c) >= cutoff
        }


def _keep_buckets(
    checkpoints: Sequence[CheckpointRecord], n: int, label: str, bucket: Any
) -> dict[int, str]:
    """Newest verified checkpoint of each of the newest ``n`` buckets that have one."""
    out: dict[int, str] = {}
    seen: list[str] = []
    ordered = sorted(_verified(checkpoints), key=lambda c: (_time_of(c), c.step, c.id), reverse=True)
    for c in ordered:
        b = bucket(_time_of(c).astimezone(UTC))
        if b in seen:
            continue
        if len(seen) >= n:
            break
        seen.append(b)
        out[c.id] = f"{label} {n}: newest of {b}"
    return out


@dataclass(frozen=True)
class KeepDaily(_KeepN):
    """Keep the newest verified checkpoint of each of the last ``n`` UTC days that have one."""

    key = "keep_daily"
    example = 7

    def keeps(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> dict[int, str]:
        return _keep_buckets(checkpoints, self.n, "keep_daily", lambda t: t.strftime("%Y-%m-%d"))


@dataclass(frozen=True)
class KeepWeekly(_KeepN):
    """Keep the newest verified checkpoint of each of the last ``n`` ISO weeks (UTC) that have one."""

    key = "keep_weekly"
    example = 4

    def keeps(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> dict[int, str]:
        def week(t: datetime) -> str:
            y, w, _ = t.isocalendar()
            return f"{y}-W{w:02d}"

        return _keep_buckets(checkpoints, self.n, "keep_weekly", week)


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
    restore drill passed keep their hot copy (0: no floor).
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
    archive_after: timedelta | None = None
    archive_when: ArchiveWhen = "immediately"
    min_drilled: int = 0

    def __post_init__(self) -> None:
        if not self.rules or all(_rule_is_empty(r) for r in self.rules):
            raise ConfigError(
                f"policy for jobs {self.jobs!r} keeps nothing: set keep_last, milestones, "
                f"keep_within, keep_daily, keep_weekly or pinned"
            )
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
        if self.archive_after is not None and self.archive_after <= timedelta(0):
            raise ConfigError(
                f"archive_after = {format_duration(self.archive_after)!r}: must be longer than zero, e.g. '14d'"
            )
        if self.archive_when not in ARCHIVE_WHENS:
            raise ConfigError(
                f"archive_when = {self.archive_when!r}: must be 'immediately' or 'leaving_hot'"
            )

    def __str__(self) -> str:
        parts = [str(r) for r in self.rules]
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
        """True when ``step`` is itself a milestone step of some rule (see :meth:`milestone_holders`)."""
        return any(m.is_milestone(step) for m in self.milestones)

    def milestone_holders(self, checkpoints: Sequence[CheckpointRecord], now: datetime) -> set[int]:
        """Ids of the checkpoints of ONE job that hold (or, committed, will hold) a milestone."""
        live = [c for c in checkpoints if c.state != State.DELETED]
        return {cid for m in self.milestones for cid in m.keeps(live, now)}


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
        if age < policy.archive_after:
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
        for c in job.cs:
            if c.state == State.VERIFIED:
                job.decided[c.id] = self._decide(c, job)

    def _decide(self, c: CheckpointRecord, job: _Job) -> _Decision:
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
        return _Decision("delete", [f"not kept by any rule ({'; '.join(str(r) for r in policy.rules)})"])


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
        warnings.extend(f"job {job!r}: {w}" for m in policy.milestones if (w := m.cadence_warning(cs)))
    return Plan(
        items=items,
        refused="; ".join(refused_jobs.values()) or None,
        refused_jobs=refused_jobs,
        excluded=tuple(sorted(excluded)),
        missing=tuple(sorted(missing)),
        stale=tuple(sorted(stale)),
        warnings=tuple(warnings),
    )


class DrillOutcome(Protocol):
    """What :func:`drill_passed` reads of a drill record (the catalog's ``DrillRecord`` fits)."""

    @property
    def checkpoint_id(self) -> int | None: ...
    @property
    def ok(self) -> bool: ...
    @property
    def started_at(self) -> datetime: ...
    @property
    def finished_at(self) -> datetime | None: ...


def drill_passed(drills: Iterable[DrillOutcome]) -> dict[int, datetime]:
    """Checkpoint id -> when its most recent drill passed, for checkpoints whose most
    recent drill (by start time, then finish time) passed. Pure; order-independent."""
    latest: dict[int, DrillOutcome] = {}
    for d in drills:
        if d.checkpoint_id is None:
            continue
        seen = latest.get(d.checkpoint_id)
        if seen is None or _drill_order(d) > _drill_order(seen):
            latest[d.checkpoint_id] = d
    return {cid: d.finished_at or d.started_at for cid, d in latest.items() if d.ok}


def _drill_order(d: DrillOutcome) -> tuple[datetime, datetime, bool]:
    # A failure outranks a pass at the very same instant: never trust the tie.
    return (d.started_at, d.finished_at or d.started_at, not d.ok)


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
