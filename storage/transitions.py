"""The rules that move a checkpoint between states: one pure module, no I/O.

Everything that decides a checkpoint's state lives here, as functions of
plain values with the time passed in (they never read the clock); the
catalog loads rows, calls these, and stores what they return. Each returns
a :class:`Transition`: the new state, its reason (one line), the times to
store and the events to log. Three kinds of input move a checkpoint:

* a scan finding (:func:`on_scan`, :func:`on_vanished`): new, files changed,
  commit evidence appeared or lost, vanished, reappeared, a tombstone
  resurrected, and completeness (:func:`completeness`);
* a verification result (:func:`on_verification`): per file ``ok`` /
  ``corrupt`` / ``missing`` / ``error``, files a manifest lists that are
  absent or short, extra files;
* a look at the files now (:func:`file_change`, :func:`on_files_changed`): a
  ``stat`` or a HEAD before an answer that matters (``latest``, ``fetch``,
  ``drill``, a delete) trusts the catalog's verdict, which re-opens
  verification when a file's size, mtime, ETag or link is not what the
  verdict was about;
* drills, which do not change the state but the proof
  (:func:`proof_of`, :func:`pick_latest`).

States (see :class:`~ckptier.storage.records.State`)::

    (new) ──> incomplete <──> committed ──> verified
                  │              │  ^          │
                  └──> corrupt <─┘  └──────────┘ (files changed)
                          └───────────────^ (files changed since found corrupt)
    deleted ──> (reappears) committed / incomplete / corrupt

Complete means complete: a checkpoint whose commit evidence is present but
whose own manifest lists files that are absent (or have fewer bytes than it
requires) is ``incomplete`` while younger than the job's ``grace`` (its save
may still be in flight; the deadline is in the reason) and ``corrupt``
after, naming the files. Age is measured from ``saved_at`` (the newest file's
mtime), else from when the catalog first saw the checkpoint.

Proof, weakest to strongest: ``committed`` (commit evidence seen) <
``verified`` (every byte proven) < ``drilled`` (verified, and its most recent
restore drill passed). A failed drill never lowers the state, but
:func:`pick_latest` passes over the checkpoint, saying why.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from .base import ObjectInfo
from .records import CheckpointRecord, CopyState, FileCheck, FileRecord, Shortfall, State

__all__ = [
    "DEFAULT_GRACE",
    "MTIME_TOLERANCE",
    "Change",
    "Event",
    "FileVerdict",
    "Latest",
    "Proof",
    "Row",
    "Seen",
    "Transition",
    "Verification",
    "completeness",
    "discovered",
    "file_change",
    "mtime_tells",
    "on_files_changed",
    "on_scan",
    "on_vanished",
    "on_verification",
    "pick_latest",
    "proof_of",
]

#: How long a save whose manifest lists absent files may still be in flight
#: (the policy's ``grace`` when a job has one).
DEFAULT_GRACE = timedelta(hours=2)

#: Statuses a file's verification result may have.
FILE_STATUSES = ("ok", "corrupt", "missing", "error")

#: How many names a reason lists before "(+N more)".
_NAMES_SHOWN = 3

#: mtimes closer than this (seconds) count as equal: catalogs round-trip them
#: through datetimes and databases that keep microseconds at best.
MTIME_TOLERANCE = 1e-3


@dataclass(frozen=True, slots=True)
class Event:
    """An event to log with a transition: ``kind`` (``committed``,
    ``corrupt``, ``vanished``...), a one-line ``message`` and optional data."""

    kind: str
    message: str
    data: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Row:
    """What the catalog holds of a checkpoint, as far as the rules need it.
    Times are aware UTC."""

    state: State
    reason: str | None
    first_seen: datetime
    saved_at: datetime | None = None
    verified_at: datetime | None = None
    missing_since: datetime | None = None


@dataclass(frozen=True, slots=True)
class Seen:
    """What one scan found of a checkpoint.

    ``committed``/``reason``/``shortfalls``/``saved_at`` come from format
    recognition (:class:`~ckptier.storage.records.Found`). Against the row's
    files: ``changed`` are relpaths that are new or whose size, mtime, etag
    or expected hash changed; ``gone`` are relpaths no longer listed that
    were present; ``still_gone`` are relpaths no longer listed that the
    catalog already records as missing.
    """

    committed: bool
    reason: str
    saved_at: datetime | None = None
    shortfalls: tuple[Shortfall, ...] = ()
    changed: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()
    still_gone: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Transition:
    """A checkpoint's state after one input, and what to record.

    ``verified_at`` and ``missing_since`` are the values to store (kept,
    set or cleared). ``counts`` names the scan counters (``new``,
    ``committed``, ``changed``, ``vanished``, ``reappeared``,
    ``resurrected``) this input adds one to. ``forget_gone_files``: rows of
    files no longer listed are dropped (a save in flight still changes its
    file set) instead of kept as ``missing``.
    """

    state: State
    reason: str | None
    verified_at: datetime | None = None
    missing_since: datetime | None = None
    events: tuple[Event, ...] = ()
    counts: frozenset[str] = frozenset()
    forget_gone_files: bool = False


# -- completeness ------------------------------------------------------------------


def completeness(
    shortfalls: Sequence[Shortfall], *, saved_at: datetime | None, first_seen: datetime, now: datetime,
    grace: timedelta,
) -> tuple[State, str] | None:
    """The verdict on a checkpoint whose manifest requires ``shortfalls``, or
    ``None`` when there are none (it is complete).

    ``incomplete`` while ``now - (saved_at or first_seen) < grace``, with the
    deadline in the reason; ``corrupt`` after, naming the files. The reason
    does not depend on ``now`` while the verdict stands, so rescans that find
    the same thing write nothing.
    """
    if not shortfalls:
        return None
    since = saved_at or first_seen
    names = _names([str(s) for s in shortfalls])
    manifests = ", ".join(sorted({s.manifest for s in shortfalls}))
    if now - since < grace:
        return State.INCOMPLETE, (
            f"{len(shortfalls)} file(s) that {manifests} requires not present yet: {names}; "
            f"a save in flight? corrupt if still so at {(since + grace).isoformat(timespec='seconds')} "
            f"(grace {_duration(grace)})"
        )
    return State.CORRUPT, f"incomplete: {len(shortfalls)} file(s) that {manifests} requires are missing or short: {names}"


# -- scans ------------------------------------------------------------------------


def on_scan(old: Row | None, seen: Seen, *, label: str, location: str, now: datetime, grace: timedelta) -> Transition:
    """What one scan finding does to a checkpoint row (``old``; ``None`` for a new checkpoint).

    ``label`` names the checkpoint in event messages (``"job step N"``).

    * New: ``committed`` when commit evidence is present, else
      ``incomplete``; then the completeness rule (:func:`completeness`).
    * A ``deleted`` tombstone that is listed again is revived to the state
      the listing implies (``resurrected`` event).
    * Evidence gone: ``incomplete`` (``uncommitted`` event).
    * Evidence present with shortfalls: the completeness rule, except that a
      ``corrupt`` checkpoint stays corrupt with its reason (evidence).
    * Evidence present, complete: ``incomplete`` -> ``committed``
      (``committed`` event); ``verified`` with changed or vanished files ->
      ``committed`` and ``verified_at`` cleared (``changed`` event: it needs
      re-verification); ``corrupt`` with changed files (new bytes, not only
      files gone) -> ``committed``: what was judged is no longer there, so it
      is verified again (a save that completed after it was caught half-way);
      otherwise the state is kept (``corrupt`` stays corrupt: evidence), with
      a ``changed`` event when files changed.
    * ``missing_since`` is cleared when it was set (``reappeared``).
    """
    evidence = State.COMMITTED if seen.committed else State.INCOMPLETE
    reason: str | None
    if old is None:
        state, reason = evidence, seen.reason
        verdict = completeness(seen.shortfalls, saved_at=seen.saved_at, first_seen=now, now=now, grace=grace) \
            if seen.committed else None
        events: list[Event] = []
        if verdict is not None:
            state, reason = verdict
            if state == State.CORRUPT:
                events.append(Event("corrupt", f"{label}: {reason}", {"files": _shortfall_names(seen)}))
        return Transition(state, reason, events=tuple(events), counts=frozenset({"new"}),
                          forget_gone_files=state == State.INCOMPLETE)

    verdict = completeness(seen.shortfalls, saved_at=seen.saved_at, first_seen=old.first_seen, now=now, grace=grace) \
        if seen.committed else None
    events = []
    counts: set[str] = set()
    reason = old.reason
    verified_at = old.verified_at
    touched = sorted(set(seen.changed) | set(seen.gone) | set(seen.still_gone))

    if old.state == State.DELETED:
        state, reason = verdict if verdict is not None else (evidence, seen.reason)
        verified_at = None
        counts.add("resurrected")
        events.append(Event("resurrected", f"{label}: deleted checkpoint reappeared at {location}; "
                                           f"now {state.value} ({reason})", {"state": state.value}))
    elif not seen.committed:
        state = State.INCOMPLETE
        if old.state != State.INCOMPLETE:
            reason, verified_at = seen.reason, None
            events.append(Event("uncommitted", f"{label}: commit evidence gone ({seen.reason})"))
    elif verdict is not None:
        state = old.state if old.state == State.CORRUPT else verdict[0]
        if state != old.state or (state == State.INCOMPLETE and reason != verdict[1]):
            reason, verified_at = verdict[1], None
            if state != old.state:
                events.append(Event(state.value, f"{label}: {old.state.value} -> {state.value}: {reason}",
                                    {"from": old.state.value, "to": state.value, "files": _shortfall_names(seen)}))
    elif old.state == State.INCOMPLETE:
        state, reason = State.COMMITTED, seen.reason
        counts.add("committed")
        events.append(Event("committed", f"{label}: committed ({seen.reason})"))
    elif old.state == State.VERIFIED and (seen.changed or seen.gone or seen.still_gone):
        state, verified_at = State.COMMITTED, None
        reason = f"files changed since verification: {_names(touched)}"
        events.append(Event("changed", f"{label}: {reason}; needs re-verification", {"files": touched[:100]}))
    elif old.state == State.CORRUPT and seen.changed:
        # The bytes judged are gone: a save that completed after it was caught
        # half-way, a file put back. Judge what is there now.
        state, verified_at = State.COMMITTED, None
        reason = f"files changed since it was found corrupt: {_names(sorted(seen.changed))}; verifying again"
        events.append(Event("changed", f"{label}: {reason}", {"files": sorted(seen.changed)[:100],
                                                               "was": old.reason}))
    else:
        state = old.state
        if (seen.changed or seen.gone) and state in (State.COMMITTED, State.CORRUPT):
            events.append(Event("changed", f"{label}: files changed: {_names(touched)}", {"files": touched[:100]}))

    forget = state == State.INCOMPLETE
    if seen.changed or seen.gone or (forget and seen.still_gone):
        counts.add("changed")
    if old.missing_since is not None:
        counts.add("reappeared")
        if old.state != State.DELETED:
            events.append(Event("reappeared", f"{label}: listed again at {location}"))
    return Transition(state, reason, verified_at=verified_at, missing_since=None, events=tuple(events),
                      counts=frozenset(counts), forget_gone_files=forget)


def on_vanished(old: Row, *, label: str, location: str, now: datetime) -> Transition:
    """A checkpoint the scan of its store no longer lists: state kept,
    ``missing_since = now`` (a ``vanished`` event). Call it only for rows not
    already missing, not deleted, and whose hot copy ckptier did not delete."""
    return Transition(
        old.state, old.reason, verified_at=old.verified_at, missing_since=now,
        events=(Event("vanished", f"{label}: no longer listed at {location}", {"state": old.state.value}),),
        counts=frozenset({"vanished"}),
    )


def discovered(job: str, steps: Sequence[int]) -> Event:
    """The one event logged for the new checkpoints a scan found in ``job``."""
    return Event("discovered", f"{job}: {len(steps)} new checkpoint(s), steps {_names([str(s) for s in steps])}",
                 {"steps": list(steps)[:1000]})


def _shortfall_names(seen: Seen) -> list[str]:
    return [s.relpath for s in seen.shortfalls][:100]


# -- a look at the files now ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Change:
    """One cataloged file that a ``stat`` or HEAD shows is not what the catalog
    holds: ``relpath``, why (one line), and what is there now (``None``: the
    file is gone)."""

    relpath: str
    why: str
    now: ObjectInfo | None = None


def mtime_tells(old_etag: str | None, new_etag: str | None) -> bool:
    """Whether an mtime that moved means other bytes: only where no ETag tells.

    An object's ETag (with its size) names its bytes; its ``Last-Modified`` is
    metadata that some S3 servers move without a write (Ceph RGW does on
    PutObjectTagging, so ckptier's own delete tag would make every object it
    proved look replaced). Where both sides have an ETag, the ETag decides; a
    local file has none, and its mtime counts.
    """
    return old_etag is None or new_etag is None


def file_change(f: FileRecord, info: ObjectInfo | None) -> str | None:
    """Why ``info`` (a fresh ``stat`` or HEAD of ``f``'s key; ``None``: not there)
    contradicts the catalog's ``f``, or ``None`` when it is the same file as far
    as its metadata tells: size, ETag (where both have one), mtime (within
    :data:`MTIME_TOLERANCE`, where no ETag tells: :func:`mtime_tells`) and what
    it is (a plain file, or a link to the same key). A file the catalog holds
    as missing that is there again is a change too."""
    if info is None:
        return None if f.status == "missing" else f"{f.relpath} is gone"
    if f.status == "missing":
        return f"{f.relpath} is back"
    if info.link != f.link:
        now = f"a symlink to {info.link}" if info.link else "a plain file"
        return f"{f.relpath} is now {now}"
    if info.size != f.size:
        return f"{f.relpath} size {f.size} -> {info.size} bytes"
    if f.etag is not None and info.etag is not None and f.etag != info.etag:
        return f"{f.relpath} etag {f.etag} -> {info.etag}"
    if (f.mtime is not None and info.mtime is not None and abs(f.mtime - info.mtime) > MTIME_TOLERANCE
            and mtime_tells(f.etag, info.etag)):
        return f"{f.relpath} mtime {f.mtime:.3f} -> {info.mtime:.3f}"
    return None


def on_files_changed(old: Row, changes: Sequence[Change], *, label: str) -> Transition:
    """What a look at the files now does to a checkpoint whose files ``changes``
    are not what the catalog holds. Table (``tests/test_transitions.py``):

    ============  ===========================  =============================================
    state         changes                      new state
    ============  ===========================  =============================================
    any           none                         unchanged
    incomplete    any                          incomplete (a save in flight is never judged)
    deleted       any                          deleted
    verified      any                          committed, ``verified_at`` cleared: verify
                                               again (a torn file is never ``verified``)
    corrupt       some file changed or back    committed: the bytes judged are gone, verify
                                               what is there now
    corrupt       files gone only              corrupt (losing more bytes proves nothing new)
    committed     any                          committed (still to verify)
    ============  ===========================  =============================================

    The reason names the changed files; a state change logs a ``changed``
    event. The file rows themselves are the caller's: each changed file takes
    what is there now (no status: never verified), a gone one is missing.
    """
    keep = Transition(old.state, old.reason, verified_at=old.verified_at, missing_since=old.missing_since)
    if not changes or old.state in (State.INCOMPLETE, State.DELETED):
        return keep
    names = _names([c.why for c in changes])
    files = [c.relpath for c in changes][:100]
    if old.state == State.VERIFIED:
        reason = f"files changed since verification: {names}"
    elif old.state == State.CORRUPT:
        if all(c.now is None for c in changes):
            return keep
        reason = f"files changed since it was found corrupt: {names}; verifying again"
    else:
        return Transition(State.COMMITTED, f"files changed: {names}", missing_since=old.missing_since)
    return Transition(State.COMMITTED, reason, missing_since=old.missing_since,
                      events=(Event("changed", f"{label}: {old.state.value} -> committed: {reason}",
                                    {"from": old.state.value, "files": files}),))


# -- verification -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FileVerdict:
    """What to record of one cataloged file after verification: its status,
    detail, the CRC64NVME baseline to keep (the first ``ok`` read sets it and
    later reads never replace it) and the SHA-256 observed (``None``: not
    computed, keep what is recorded)."""

    relpath: str
    status: str
    detail: str | None
    crc64nvme: str | None
    sha256: str | None


@dataclass(frozen=True, slots=True)
class Verification:
    """:func:`on_verification`'s answer: per cataloged file what to record,
    the files a manifest lists that the catalog does not hold (absent), and
    the checkpoint's transition."""

    files: tuple[FileVerdict, ...]
    absent: tuple[str, ...]
    transition: Transition
    bad: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()


def on_verification(
    old: Row,
    files: Sequence[FileRecord],
    results: Sequence[FileCheck],
    *,
    label: str,
    now: datetime,
    grace: timedelta,
    extra: Sequence[str] = (),
) -> Verification:
    """What per-file read-back ``results`` mean for a checkpoint whose
    cataloged files are ``files``.

    Per file: a result ``ok`` whose size, SHA-256 (against the format's
    expected hash) or CRC64NVME (against the recorded baseline) contradicts
    the catalog is ``corrupt``, naming expected and actual. Then, in order:

    * ``incomplete`` and ``deleted`` checkpoints keep their state (a save in
      flight is never judged); the file results are still recorded;
    * any file ``corrupt`` or ``missing`` (not for a shortfall) ->
      ``corrupt``, the reason naming the first file and counting the rest;
    * any shortfall (a manifest of the checkpoint requires a file that is
      absent or too short; results for files the catalog does not hold must
      be such ``missing`` ones) -> the completeness rule: ``incomplete``
      within ``grace`` of the save, ``corrupt`` after;
    * any file ``error`` (unreadable: proves nothing) -> state unchanged;
    * every cataloged file ``ok`` -> ``verified`` (``verified_at = now``);
      ``extra`` files (present, not cataloged) are named in the reason but
      change nothing: a rescan adds them;
    * otherwise (files without a result) -> state unchanged.

    An event (kind = the new state) is logged for every state change.
    Raises ``ValueError`` for an unknown status, or a result naming a file
    the catalog does not hold that is not a missing shortfall.
    """
    rows = {f.relpath: f for f in files}
    verdicts: list[FileVerdict] = []
    bad: list[str] = []
    errors: list[str] = []
    short: list[Shortfall] = []
    absent: list[str] = []
    ok: set[str] = set()
    for res in results:
        if res.status not in FILE_STATUSES:
            raise ValueError(f"{res.relpath}: status {res.status!r}; use one of {', '.join(FILE_STATUSES)}")
        row = rows.get(res.relpath)
        if row is None:
            if res.status == "missing" and res.shortfall is not None:
                short.append(res.shortfall)
                absent.append(res.relpath)
                continue
            raise ValueError(f"{label}: no file {res.relpath!r} in the catalog; rescan before verifying")
        status: str = res.status
        detail = res.detail
        if status == "ok":
            mismatch = _mismatch(row, res)
            if mismatch:
                status, detail = "corrupt", mismatch
        elif status in ("corrupt", "missing") and not detail:
            detail = status
        crc = row.crc64nvme if row.crc64nvme is not None else (res.crc64nvme if status == "ok" else None)
        verdicts.append(FileVerdict(res.relpath, status, detail, crc, res.sha256))
        if status in ("corrupt", "missing") and res.shortfall is not None:
            short.append(res.shortfall)
        elif status in ("corrupt", "missing"):
            bad.append(f"{res.relpath}: {detail}")
        elif status == "error":
            errors.append(res.relpath)
        else:
            ok.add(res.relpath)

    state, reason, verified_at = old.state, old.reason, old.verified_at
    if old.state in (State.INCOMPLETE, State.DELETED):
        pass
    elif bad:
        state = State.CORRUPT
        reason = bad[0] + (f" (+{len(bad) - 1} more bad files)" if len(bad) > 1 else "")
    elif short:
        verdict = completeness(short, saved_at=old.saved_at, first_seen=old.first_seen, now=now, grace=grace)
        assert verdict is not None
        state, reason = verdict
    elif errors:
        pass
    elif rows and ok >= set(rows):
        state, reason, verified_at = State.VERIFIED, f"{len(rows)} files verified", now
        if extra:
            reason += f"; {len(extra)} extra file(s) not cataloged: {_names(sorted(extra))} (rescan to add them)"
    events: tuple[Event, ...] = ()
    if state != old.state:
        events = (Event(state.value, f"{label}: {old.state.value} -> {state.value}: {reason}",
                        {"from": old.state.value, "to": state.value, "bad": bad[:100], "errors": errors[:100],
                         "absent": [s.relpath for s in short][:100]}),)
    return Verification(
        files=tuple(verdicts),
        absent=tuple(absent),
        transition=Transition(state, reason, verified_at=verified_at, missing_since=old.missing_since, events=events),
        bad=tuple(bad),
        errors=tuple(errors),
    )


def _mismatch(row: FileRecord, res: FileCheck) -> str | None:
    """Why an ``ok`` read-back still contradicts the catalog, or None."""
    if res.size is not None and res.size != row.size:
        return f"size expected {row.size}, got {res.size}"
    if res.sha256 and row.sha256_expected and res.sha256.lower() != row.sha256_expected.lower():
        return f"sha256 expected {row.sha256_expected}, got {res.sha256}"
    if res.crc64nvme and row.crc64nvme and res.crc64nvme != row.crc64nvme:
        return f"crc64nvme expected {row.crc64nvme}, got {res.crc64nvme}"
    return None


# -- the most recent drill ------------------------------------------------------------


class DrillLike(Protocol):
    """What the rules read of a restore drill (the catalog's ``DrillRecord`` fits)."""

    @property
    def checkpoint_id(self) -> int | None: ...
    @property
    def ok(self) -> bool: ...
    @property
    def started_at(self) -> datetime: ...
    @property
    def finished_at(self) -> datetime | None: ...
    @property
    def judged(self) -> bool:
        """False for a drill that stopped for a reason not the checkpoint's (``not judged``)."""
        ...


DrillT = TypeVar("DrillT", bound=DrillLike)


def drill_order(drill: DrillLike) -> tuple[datetime, datetime, bool]:
    """How drills of one checkpoint are ordered in time, oldest first (pure): by start; at
    the same start by finish (a drill that never finished counts at its start); at the
    very same instant a failure comes after a pass, so that a tie is never read as a
    pass."""
    return drill.started_at, drill.finished_at or drill.started_at, not drill.ok


def latest_drill(drills: Iterable[DrillT]) -> DrillT | None:
    """The most recent of ``drills`` by :func:`drill_order` (None when there are none),
    counting only drills that judged the checkpoint: one that was ``not judged``
    (no model, a factory that does not load, an unsupported variant...) is
    history only, never a checkpoint's most recent drill.

    The one definition every reader uses: the catalog's last drill of a
    checkpoint (its proof, ``latest --drilled``), the retention floor
    ``min_drilled``, the dashboard and the cost tables' recovery point.
    Drills equal by :func:`drill_order` (the same verdict at the same
    instant) are equivalent: the first of them given is returned."""
    best: DrillT | None = None
    for drill in drills:
        if drill.judged and (best is None or drill_order(drill) > drill_order(best)):
            best = drill
    return best


def latest_drills(drills: Iterable[DrillT]) -> dict[int, DrillT]:
    """Checkpoint id -> its most recent drill (:func:`latest_drill`); drills of no
    checkpoint (its row is gone), and checkpoints none of whose drills judged
    them, are left out. Pure."""
    by_checkpoint: dict[int, list[DrillT]] = {}
    for drill in drills:
        if drill.checkpoint_id is not None:
            by_checkpoint.setdefault(drill.checkpoint_id, []).append(drill)
    return {cid: latest for cid, ds in by_checkpoint.items() if (latest := latest_drill(ds)) is not None}


# -- proof ------------------------------------------------------------------------


class Proof(enum.StrEnum):
    """How much is proven about a checkpoint, weakest first."""

    COMMITTED = "committed"  # commit evidence seen; bytes not proven
    VERIFIED = "verified"  # every byte proven
    DRILLED = "drilled"  # verified, and its most recent restore drill passed

    @property
    def rank(self) -> int:
        return list(Proof).index(self)


def proof_of(record: CheckpointRecord) -> tuple[Proof | None, datetime | None]:
    """The proof ``record`` has and when it was obtained (``None, None`` for
    incomplete, corrupt and deleted checkpoints).

    ``committed``: since ``saved_at`` (else ``first_seen``); ``verified``:
    ``verified_at``; ``drilled``: verified and its most recent drill passed,
    at that drill's time. A drill proves the bytes it restored: a checkpoint
    whose files changed is back to ``committed`` until verification proves
    the same bytes (the CRC64NVME baseline is never replaced).
    """
    if record.state == State.COMMITTED:
        return Proof.COMMITTED, record.saved_at or record.first_seen
    if record.state != State.VERIFIED:
        return None, None
    drill = record.last_drill
    if drill is not None and drill.ok:
        return Proof.DRILLED, drill.at
    return Proof.VERIFIED, record.verified_at


@dataclass(frozen=True)
class Latest:
    """:func:`pick_latest`'s answer: the checkpoint to resume from (or
    ``None``), its proof and when it was obtained, and the newer verified
    checkpoints passed over with why (``(step, reason)``, newest first)."""

    record: CheckpointRecord | None
    proof: Proof | None = None
    proven_at: datetime | None = None
    passed_over: tuple[tuple[int, str], ...] = field(default_factory=tuple)


def pick_latest(records: Iterable[CheckpointRecord], *, drilled: bool = False) -> Latest:
    """The newest checkpoint safe to resume from.

    Candidates are ``verified`` checkpoints with a ``present`` copy in some
    tier, newest step first. One whose most recent drill failed is passed
    over (named with the drill's reason); with ``drilled``, only a checkpoint
    whose most recent drill passed qualifies. Pure: ``records`` carry their
    copies and last drill.
    """
    passed: list[tuple[int, str]] = []
    candidates = sorted(
        (r for r in records if r.state == State.VERIFIED and any(c.state == CopyState.PRESENT for c in r.copies)),
        key=lambda r: r.step, reverse=True,
    )
    for r in candidates:
        drill = r.last_drill
        if drill is not None and not drill.ok:
            passed.append((r.step, f"its drill failed at {drill.at.isoformat(timespec='seconds')}: "
                                   f"{drill.detail or 'no reason recorded'}"))
            continue
        if drilled and drill is None:
            continue
        proof, at = proof_of(r)
        return Latest(r, proof, at, tuple(passed))
    return Latest(None, None, None, tuple(passed))


# -- helpers ----------------------------------------------------------------------


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_NAMES_SHOWN])
    more = len(items) - _NAMES_SHOWN
    return f"{shown} (+{more} more)" if more > 0 else shown


def _duration(d: timedelta) -> str:
    seconds = int(d.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
