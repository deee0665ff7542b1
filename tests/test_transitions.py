"""The state-transition rules (storage/transitions.py): table tests, no database."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ckptier.storage.records import (
    CheckpointRecord,
    CopyRecord,
    DrillOutcome,
    FileCheck,
    FileRecord,
    Format,
    Shortfall,
    State,
    Tier,
)
from ckptier.storage.base import ObjectInfo
from ckptier.storage.transitions import (
    DEFAULT_GRACE,
    MTIME_TOLERANCE,
    Change,
    Proof,
    Row,
    Seen,
    Transition,
    completeness,
    discovered,
    file_change,
    on_files_changed,
    on_scan,
    on_vanished,
    on_verification,
    pick_latest,
    proof_of,
)

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
GRACE = timedelta(hours=2)
OLD = NOW - timedelta(days=1)  # saved long before the grace period
YOUNG = NOW - timedelta(minutes=10)
ABSENT = Shortfall("rank-0001/optimizer.pt", "metadata.json")
SHORT = Shortfall("__1_0.distcp", ".metadata", have=100, need=4096)


def row(state: State, reason: str | None = "r", *, saved: datetime | None = OLD, missing: datetime | None = None,
        verified: datetime | None = None) -> Row:
    return Row(state, reason, first_seen=OLD, saved_at=saved, verified_at=verified, missing_since=missing)


def seen(committed: bool = True, *, short: tuple[Shortfall, ...] = (), saved: datetime | None = OLD,
         changed: tuple[str, ...] = (), gone: tuple[str, ...] = (), still_gone: tuple[str, ...] = ()) -> Seen:
    return Seen(committed, "evidence" if committed else "no evidence", saved, short, changed, gone, still_gone)


def scan_t(old: Row | None, s: Seen) -> Transition:
    return on_scan(old, s, label="j step 1", location="file:///x/j/step-1", now=NOW, grace=GRACE)


def scan(old: Row | None, s: Seen) -> tuple[State, str | None, list[str], frozenset[str]]:
    t = on_scan(old, s, label="j step 1", location="file:///x/j/step-1", now=NOW, grace=GRACE)
    return t.state, t.reason, [e.kind for e in t.events], t.counts


# -- scans -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "s", "state", "events", "counts"),
    [
        # new checkpoints
        (None, seen(), State.COMMITTED, [], {"new"}),
        (None, seen(False), State.INCOMPLETE, [], {"new"}),
        (None, seen(short=(ABSENT,), saved=YOUNG), State.INCOMPLETE, [], {"new"}),
        (None, seen(short=(ABSENT,)), State.CORRUPT, ["corrupt"], {"new"}),
        (None, seen(False, short=(ABSENT,)), State.INCOMPLETE, [], {"new"}),  # no evidence: no verdict yet
        # commit evidence appears / is lost
        (row(State.INCOMPLETE), seen(), State.COMMITTED, ["committed"], {"committed"}),
        (row(State.COMMITTED), seen(False), State.INCOMPLETE, ["uncommitted"], set()),
        (row(State.VERIFIED, verified=OLD), seen(False), State.INCOMPLETE, ["uncommitted"], set()),
        (row(State.INCOMPLETE), seen(False), State.INCOMPLETE, [], set()),
        # unchanged
        (row(State.COMMITTED), seen(), State.COMMITTED, [], set()),
        (row(State.VERIFIED, verified=OLD), seen(), State.VERIFIED, [], set()),
        (row(State.CORRUPT), seen(), State.CORRUPT, [], set()),
        # files changed
        (row(State.VERIFIED, verified=OLD), seen(changed=("a",)), State.COMMITTED, ["changed"], {"changed"}),
        (row(State.VERIFIED, verified=OLD), seen(gone=("a",)), State.COMMITTED, ["changed"], {"changed"}),
        (row(State.COMMITTED), seen(changed=("a",)), State.COMMITTED, ["changed"], {"changed"}),
        # a file of a corrupt checkpoint has new bytes (a save completed after it was caught half-way):
        # what was judged is gone, so it is verified again; files only gone keep the verdict (evidence)
        (row(State.CORRUPT), seen(changed=("a",)), State.COMMITTED, ["changed"], {"changed"}),
        (row(State.CORRUPT), seen(gone=("a",)), State.CORRUPT, ["changed"], {"changed"}),
        (row(State.COMMITTED), seen(still_gone=("a",)), State.COMMITTED, [], set()),
        (row(State.INCOMPLETE), seen(False, still_gone=("a",)), State.INCOMPLETE, [], {"changed"}),  # row dropped
        # complete means complete
        (row(State.COMMITTED), seen(short=(ABSENT,), saved=YOUNG), State.INCOMPLETE, ["incomplete"], set()),
        (row(State.COMMITTED), seen(short=(ABSENT,)), State.CORRUPT, ["corrupt"], set()),
        (row(State.VERIFIED, verified=OLD), seen(short=(SHORT,)), State.CORRUPT, ["corrupt"], set()),
        (row(State.INCOMPLETE, saved=YOUNG), seen(short=(ABSENT,), saved=YOUNG), State.INCOMPLETE, [], set()),
        (row(State.INCOMPLETE, saved=YOUNG), seen(short=(ABSENT,)), State.CORRUPT, ["corrupt"], set()),  # grace over
        (row(State.CORRUPT, "bytes"), seen(short=(ABSENT,)), State.CORRUPT, [], set()),
        # vanished and reappeared, tombstones
        (row(State.COMMITTED, missing=OLD), seen(), State.COMMITTED, ["reappeared"], {"reappeared"}),
        (row(State.DELETED), seen(), State.COMMITTED, ["resurrected"], {"resurrected"}),
        (row(State.DELETED), seen(False), State.INCOMPLETE, ["resurrected"], {"resurrected"}),
        (row(State.DELETED), seen(short=(ABSENT,)), State.CORRUPT, ["resurrected"], {"resurrected"}),
        (row(State.DELETED, missing=OLD), seen(), State.COMMITTED, ["resurrected"], {"resurrected", "reappeared"}),
    ],
)
def test_scan_findings(old: Row | None, s: Seen, state: State, events: list[str], counts: set[str]) -> None:
    got_state, reason, got_events, got_counts = scan(old, s)
    assert (got_state, got_events, set(got_counts)) == (state, events, counts)
    assert reason and "\n" not in reason


def test_scan_reasons_name_the_missing_files_and_the_deadline() -> None:
    _, reason, _, _ = scan(row(State.COMMITTED), seen(short=(ABSENT,)))
    assert reason == ("incomplete: 1 file(s) that metadata.json requires are missing or short: "
                      "rank-0001/optimizer.pt (absent, listed in metadata.json)")
    _, reason, _, _ = scan(row(State.COMMITTED), seen(short=(SHORT,), saved=YOUNG))
    assert "__1_0.distcp (100 bytes, .metadata needs at least 4096)" in (reason or "")
    assert "corrupt if still so at 2026-03-01T13:50:00+00:00 (grace 2h)" in (reason or "")


def _young_reason(*short: Shortfall) -> str:
    verdict = completeness(short, saved_at=YOUNG, first_seen=OLD, now=NOW, grace=GRACE)
    assert verdict is not None and verdict[0] == State.INCOMPLETE
    return verdict[1]


#: The reason a rescan writes for a young save that lacks ABSENT and SHORT.
BOTH_YOUNG = _young_reason(ABSENT, SHORT)


@pytest.mark.parametrize(
    ("old", "s", "state", "reason"),
    [
        # a corrupt checkpoint keeps its evidence: a shortfall found now does not replace why it is corrupt
        pytest.param(row(State.CORRUPT, "rank-0000/model.pt: sha256 mismatch"), seen(short=(ABSENT,)),
                     State.CORRUPT, "rank-0000/model.pt: sha256 mismatch", id="corrupt-keeps-evidence"),
        pytest.param(row(State.CORRUPT, "rank-0000/model.pt: sha256 mismatch", saved=YOUNG),
                     seen(short=(ABSENT,), saved=YOUNG), State.CORRUPT, "rank-0000/model.pt: sha256 mismatch",
                     id="corrupt-young-shortfall-keeps-evidence"),
        # an incomplete one's reason follows what is still short
        pytest.param(row(State.INCOMPLETE, "1 file(s) that metadata.json requires not present yet: an older list",
                         saved=YOUNG), seen(short=(ABSENT, SHORT), saved=YOUNG),
                     State.INCOMPLETE, BOTH_YOUNG, id="incomplete-refreshes-shortfalls"),
        pytest.param(row(State.INCOMPLETE, BOTH_YOUNG, saved=YOUNG),
                     seen(short=(ABSENT, SHORT), saved=YOUNG), State.INCOMPLETE,
                     BOTH_YOUNG, id="incomplete-same-shortfalls"),
        # committed with a young shortfall: incomplete, naming it
        pytest.param(row(State.COMMITTED, "evidence"), seen(short=(ABSENT, SHORT), saved=YOUNG), State.INCOMPLETE,
                     BOTH_YOUNG, id="committed-to-incomplete"),
    ],
)
def test_scan_reasons_kept_or_refreshed(old: Row, s: Seen, state: State, reason: str | None) -> None:
    assert "2 file(s)" in BOTH_YOUNG
    got = on_scan(old, s, label="j step 1", location="file:///x/j/step-1", now=NOW, grace=GRACE)
    assert (got.state, got.reason) == (state, reason)


def test_a_young_shortfall_rescanned_writes_the_same_reason() -> None:
    """The reason does not move with the clock, so an unchanged rescan changes nothing."""
    first = on_scan(row(State.COMMITTED), seen(short=(ABSENT,), saved=YOUNG), label="j", location="x", now=NOW,
                    grace=GRACE)
    later = on_scan(row(State.INCOMPLETE, first.reason, saved=YOUNG), seen(short=(ABSENT,), saved=YOUNG), label="j",
                    location="x", now=NOW + timedelta(minutes=30), grace=GRACE)
    assert later.state == State.INCOMPLETE and later.reason == first.reason and later.events == ()


@pytest.mark.parametrize(
    ("grace", "shown"),
    [
        pytest.param(timedelta(days=1), "1d", id="days"),
        pytest.param(timedelta(hours=2), "2h", id="hours"),
        pytest.param(timedelta(minutes=2), "2m", id="minutes"),
        pytest.param(timedelta(seconds=90), "90s", id="seconds"),
        pytest.param(timedelta(hours=25), "25h", id="hours-past-a-day"),
    ],
)
def test_the_reason_names_the_grace_in_its_largest_whole_unit(grace: timedelta, shown: str) -> None:
    verdict = completeness((ABSENT,), saved_at=NOW, first_seen=OLD, now=NOW, grace=grace)
    assert verdict is not None and verdict[1].endswith(f"(grace {shown})")


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        pytest.param([7], "j: 1 new checkpoint(s), steps 7", id="one"),
        pytest.param([1, 2, 3], "j: 3 new checkpoint(s), steps 1, 2, 3", id="three-named-none-more"),
        pytest.param([1, 2, 3, 4, 5], "j: 5 new checkpoint(s), steps 1, 2, 3 (+2 more)", id="five"),
    ],
)
def test_messages_name_three_and_count_the_rest(steps: list[int], message: str) -> None:
    assert discovered("j", steps).message == message


@pytest.mark.parametrize(
    ("old", "s"),
    [
        pytest.param(row(State.INCOMPLETE, BOTH_YOUNG, saved=YOUNG, verified=OLD), seen(short=(ABSENT, SHORT), saved=YOUNG),
                     id="incomplete-same-shortfalls"),
        pytest.param(row(State.CORRUPT, "bytes", verified=OLD), seen(short=(ABSENT,)), id="corrupt-shortfall"),
        pytest.param(row(State.VERIFIED, verified=OLD), seen(), id="verified"),
        pytest.param(row(State.COMMITTED), seen(), id="committed"),
    ],
)
def test_a_rescan_that_finds_the_same_thing_writes_nothing(old: Row, s: Seen) -> None:
    t = scan_t(old, s)
    assert (t.state, t.reason, t.verified_at, t.events) == (old.state, old.reason, old.verified_at, ())


def test_scan_times() -> None:
    changed = on_scan(row(State.VERIFIED, verified=OLD), seen(changed=("a",)), label="j", location="x", now=NOW,
                      grace=GRACE)
    assert changed.verified_at is None and changed.reason == "files changed since verification: a"
    kept = on_scan(row(State.VERIFIED, verified=OLD, missing=OLD), seen(), label="j", location="x", now=NOW,
                   grace=GRACE)
    assert kept.verified_at == OLD and kept.missing_since is None
    gone = on_vanished(row(State.VERIFIED, verified=OLD), label="j step 1", location="file:///x", now=NOW)
    assert (gone.state, gone.verified_at, gone.missing_since, gone.counts) == (
        State.VERIFIED, OLD, NOW, frozenset({"vanished"}))
    assert gone.events[0].message == "j step 1: no longer listed at file:///x"
    assert discovered("j", [1, 2, 3, 4]).message == "j: 4 new checkpoint(s), steps 1, 2, 3 (+1 more)"


@pytest.mark.parametrize(
    ("transition", "forget"),
    [
        pytest.param(lambda: scan_t(row(State.INCOMPLETE), seen(False, gone=("a",))), True, id="incomplete"),
        pytest.param(lambda: scan_t(row(State.VERIFIED), seen(gone=("a",))), False, id="verified"),
        pytest.param(lambda: scan_t(None, seen(False)), True, id="new-incomplete"),
        pytest.param(lambda: scan_t(None, seen()), False, id="new-committed"),
        pytest.param(lambda: scan_t(None, seen(short=(ABSENT,), saved=YOUNG)), True, id="new-in-flight"),
        pytest.param(lambda: on_vanished(row(State.COMMITTED), label="j", location="x", now=NOW), False,
                     id="vanished"),
        pytest.param(lambda: on_files_changed(row(State.VERIFIED, verified=OLD), [VANISHED], label="j"), False,
                     id="stat"),
    ],
)
def test_incomplete_saves_forget_files_that_went_away(transition: Callable[[], Transition], forget: bool) -> None:
    """A save in flight still changes its file set: its gone files are dropped, not kept as missing."""
    assert transition().forget_gone_files is forget


def test_the_default_grace_is_the_documented_one() -> None:
    """docs/retention.md: ``grace`` defaults to ``"2h"``."""
    assert DEFAULT_GRACE == timedelta(hours=2)


@pytest.mark.parametrize(
    ("saved", "first_seen", "expected"),
    [
        (YOUNG, OLD, State.INCOMPLETE),
        (OLD, NOW, State.CORRUPT),
        (None, YOUNG, State.INCOMPLETE),  # no mtime: age from when the catalog first saw it
        (None, OLD, State.CORRUPT),
        (NOW - GRACE, OLD, State.CORRUPT),  # the grace period is half-open
    ],
)
def test_completeness_age(saved: datetime | None, first_seen: datetime, expected: State) -> None:
    verdict = completeness((ABSENT,), saved_at=saved, first_seen=first_seen, now=NOW, grace=GRACE)
    assert verdict is not None and verdict[0] == expected
    assert completeness((), saved_at=saved, first_seen=first_seen, now=NOW, grace=GRACE) is None


# -- verification ------------------------------------------------------------------------


def fr(rel: str, *, crc: str | None = None, sha: str | None = None, size: int = 10) -> FileRecord:
    return FileRecord(rel, size, 1.0, None, crc, sha, None, None)


def fc(rel: str, status: str, detail: str | None = None, *, crc: str | None = "C", size: int = 10,
       short: Shortfall | None = None) -> FileCheck:
    return FileCheck(rel, status, size, crc, None, detail, short)  # type: ignore[arg-type]


FILES = (fr("a"), fr("b"))


def verify(state: State, results: list[FileCheck], *, files: tuple[FileRecord, ...] = FILES, saved: datetime = OLD,
           extra: tuple[str, ...] = ()) -> tuple[State, str | None, list[str]]:
    v = on_verification(row(state, "before", saved=saved), files, results, label="step 1", now=NOW, grace=GRACE,
                        extra=extra)
    return v.transition.state, v.transition.reason, [e.kind for e in v.transition.events]


@pytest.mark.parametrize(
    ("state", "results", "expected", "reason"),
    [
        (State.COMMITTED, [fc("a", "ok"), fc("b", "ok")], State.VERIFIED, "2 files verified"),
        (State.CORRUPT, [fc("a", "ok"), fc("b", "ok")], State.VERIFIED, "2 files verified"),
        (State.VERIFIED, [fc("a", "corrupt", "crc64nvme X, recorded Y"), fc("b", "ok")], State.CORRUPT,
         "a: crc64nvme X, recorded Y"),
        (State.VERIFIED, [fc("a", "missing"), fc("b", "corrupt", "truncated")], State.CORRUPT,
         "a: missing (+1 more bad files)"),
        (State.VERIFIED, [fc("a", "error", "AccessDenied: no"), fc("b", "corrupt", "x")], State.CORRUPT, "b: x"),
        (State.COMMITTED, [fc("a", "error", "Unavailable: down"), fc("b", "ok")], State.COMMITTED, "before"),
        (State.VERIFIED, [fc("a", "ok")], State.VERIFIED, "before"),  # b not checked: nothing proven
        (State.INCOMPLETE, [fc("a", "ok"), fc("b", "ok")], State.INCOMPLETE, "before"),  # in flight: never judged
        (State.DELETED, [fc("a", "corrupt", "x")], State.DELETED, "before"),
        (State.COMMITTED, [fc("a", "ok", size=11), fc("b", "ok")], State.CORRUPT, "a: size expected 10, got 11"),
        # listed in a manifest, absent: the completeness rule
        (State.COMMITTED, [fc("a", "ok"), fc("b", "ok"), fc("c", "missing", "listed", short=ABSENT)],
         State.CORRUPT, "incomplete: 1 file(s) that metadata.json requires are missing or short"),
        (State.COMMITTED, [fc("a", "ok"), fc("b", "corrupt", "short", short=SHORT)], State.CORRUPT,
         "__1_0.distcp (100 bytes, .metadata needs at least 4096)"),
        # byte corruption outranks a shortfall
        (State.COMMITTED, [fc("a", "corrupt", "bad crc"), fc("c", "missing", short=ABSENT)], State.CORRUPT, "a: bad crc"),
    ],
)
def test_verification_results(state: State, results: list[FileCheck], expected: State, reason: str) -> None:
    got, got_reason, events = verify(state, results)
    assert got == expected and reason in (got_reason or "")
    assert events == ([] if got == state else [expected.value])


@pytest.mark.parametrize(
    ("results", "reason"),
    [
        pytest.param([fc("a", "corrupt", "crc64nvme X, recorded Y"), fc("b", "ok")], "a: crc64nvme X, recorded Y",
                     id="one-bad"),
        pytest.param([fc("a", "missing"), fc("b", "corrupt", "truncated")], "a: missing (+1 more bad files)",
                     id="two-bad"),
        pytest.param([fc("b", "corrupt", "truncated"), fc("a", "missing")], "b: truncated (+1 more bad files)",
                     id="two-bad-the-first-named"),
    ],
)
def test_a_corrupt_verdict_names_the_first_bad_file_and_counts_the_rest(results: list[FileCheck], reason: str) -> None:
    assert verify(State.VERIFIED, results)[:2] == (State.CORRUPT, reason)


def test_a_young_checkpoint_with_absent_listed_files_is_incomplete_not_corrupt() -> None:
    results = [fc("a", "ok"), fc("b", "ok"), fc("c", "missing", "listed", short=ABSENT)]
    state, reason, events = verify(State.COMMITTED, results, saved=YOUNG)
    assert state == State.INCOMPLETE and "not present yet" in (reason or "") and events == ["incomplete"]


def test_verification_records_baselines_and_flags_contradictions() -> None:
    files = (fr("a", crc="OLD"), fr("b", sha="a" * 64), fr("c"))
    v = on_verification(row(State.VERIFIED), files, [fc("a", "ok", crc="NEW"), FileCheck("b", "ok", 10, "B", "b" * 64),
                                                     fc("c", "ok", crc="C1")],
                        label="step 1", now=NOW, grace=GRACE)
    by = {f.relpath: f for f in v.files}
    assert (by["a"].status, by["a"].detail, by["a"].crc64nvme) == ("corrupt", "crc64nvme expected OLD, got NEW", "OLD")
    assert by["b"].status == "corrupt" and by["b"].detail == f"sha256 expected {'a' * 64}, got {'b' * 64}"
    assert (by["c"].status, by["c"].crc64nvme) == ("ok", "C1")  # first ok read: the baseline
    assert v.transition.state == State.CORRUPT and v.transition.verified_at is None


def test_extra_files_are_named_but_change_nothing() -> None:
    state, reason, _ = verify(State.COMMITTED, [fc("a", "ok"), fc("b", "ok")], extra=("stray.tmp",))
    assert state == State.VERIFIED
    assert reason == "2 files verified; 1 extra file(s) not cataloged: stray.tmp (rescan to add them)"


def test_verification_refuses_unknown_files_and_statuses() -> None:
    with pytest.raises(ValueError, match="no file 'zzz'"):
        verify(State.COMMITTED, [fc("zzz", "ok")])
    with pytest.raises(ValueError, match="no file 'zzz'"):
        verify(State.COMMITTED, [fc("zzz", "missing")])  # not a manifest's shortfall
    with pytest.raises(ValueError, match="status 'fine'"):
        verify(State.COMMITTED, [fc("a", "fine")])


# -- proof and latest --------------------------------------------------------------------


def rec(step: int, state: State = State.VERIFIED, *, drill: DrillOutcome | None = None,
        copy_state: str = "present", saved: datetime | None = OLD, first_seen: datetime = OLD) -> CheckpointRecord:
    return CheckpointRecord(
        id=step, job="j", step=step, format=Format.GUIDE, state=state, location=f"file:///j/{step}", bytes=1,
        saved_at=saved, first_seen=first_seen, last_seen=OLD, missing_since=None,
        verified_at=NOW - timedelta(hours=step) if state == State.VERIFIED else None, state_reason=None,
        copies=(CopyRecord(Tier.HOT, f"file:///j/{step}", copy_state, 1, None),), last_drill=drill,
    )


PASSED = DrillOutcome(True, NOW - timedelta(minutes=5))
FAILED = DrillOutcome(False, NOW - timedelta(minutes=1), "load: unexpected key 'x'")


@pytest.mark.parametrize(
    ("record", "proof", "at"),
    [
        (rec(1, State.COMMITTED), Proof.COMMITTED, OLD),
        (rec(2), Proof.VERIFIED, NOW - timedelta(hours=2)),
        (rec(3, drill=PASSED), Proof.DRILLED, PASSED.at),
        (rec(4, drill=FAILED), Proof.VERIFIED, NOW - timedelta(hours=4)),
        (rec(5, State.COMMITTED, drill=PASSED), Proof.COMMITTED, OLD),  # files changed since the drill
        (rec(6, State.CORRUPT), None, None),
        (rec(7, State.INCOMPLETE), None, None),
        # committed since the save, not since the catalog first saw it (a first scan of old saves)
        pytest.param(rec(8, State.COMMITTED, saved=OLD, first_seen=YOUNG), Proof.COMMITTED, OLD,
                     id="committed-since-saved"),
        pytest.param(rec(9, State.COMMITTED, saved=None, first_seen=YOUNG), Proof.COMMITTED, YOUNG,
                     id="committed-since-first-seen-without-save-time"),
    ],
)
def test_proof_levels(record: CheckpointRecord, proof: Proof | None, at: datetime | None) -> None:
    assert proof_of(record) == (proof, at)


def test_proof_levels_are_ordered() -> None:
    assert Proof.COMMITTED.rank < Proof.VERIFIED.rank < Proof.DRILLED.rank


def test_latest_passes_over_a_failed_drill_and_says_why() -> None:
    records = [rec(1, drill=PASSED), rec(2), rec(3, drill=FAILED), rec(4, State.COMMITTED), rec(5, State.CORRUPT)]
    latest = pick_latest(records)
    assert latest.record is not None and latest.record.step == 2 and latest.proof == Proof.VERIFIED
    assert latest.passed_over == ((3, f"its drill failed at {FAILED.at.isoformat(timespec='seconds')}: "
                                      "load: unexpected key 'x'"),)
    drilled = pick_latest(records, drilled=True)
    assert drilled.record is not None and drilled.record.step == 1
    assert (drilled.proof, drilled.proven_at) == (Proof.DRILLED, PASSED.at)


def test_latest_needs_a_present_copy() -> None:
    assert pick_latest([rec(1, copy_state="missing")]).record is None
    assert pick_latest([rec(1, copy_state="degraded"), rec(0)]).record.step == 0  # type: ignore[union-attr]
    assert pick_latest([], drilled=True).record is None


# -- a look at the files now (stat / HEAD) -------------------------------------------------

CATALOGED = FileRecord("rank-0000/model.pt", 6000, 1_700_000_000.0, None, "crc", None, "ok", None)
LINKED = FileRecord("rank-0000/optimizer.pt", 6000, 1_700_000_000.0, None, "crc", None, "ok", None,
                    link="job/step-00000100/rank-0000/optimizer.pt")
ON_S3 = FileRecord("model.pt", 10, 1_700_000_000.0, '"e1"', None, None, "ok", None)
GONE = FileRecord("rank-0000/model.pt", 6000, 1_700_000_000.0, None, None, None, "missing", "not listed")


def info(size: int = 6000, mtime: float = 1_700_000_000.0, etag: str | None = None, link: str | None = None) -> ObjectInfo:
    return ObjectInfo("k", size, mtime, etag, link=link)


@pytest.mark.parametrize(
    ("f", "now", "why"),
    [
        (CATALOGED, info(), None),
        (CATALOGED, info(mtime=1_700_000_000.0004), None),  # within the catalog's precision
        # exactly the tolerance apart is still within it (files dated at the epoch, as reproducible builds do)
        pytest.param(dataclasses.replace(CATALOGED, mtime=0.0), info(mtime=MTIME_TOLERANCE), None,
                     id="at-the-tolerance"),
        pytest.param(dataclasses.replace(CATALOGED, mtime=0.0), info(mtime=2 * MTIME_TOLERANCE),
                     "rank-0000/model.pt mtime 0.000 -> 0.002", id="past-the-tolerance"),
        (CATALOGED, info(size=1000), "rank-0000/model.pt size 6000 -> 1000 bytes"),  # truncated in place
        (CATALOGED, info(mtime=1_700_003_600.0), "rank-0000/model.pt mtime 1700000000.000 -> 1700003600.000"),
        (CATALOGED, None, "rank-0000/model.pt is gone"),
        (CATALOGED, info(link="job/x"), "rank-0000/model.pt is now a symlink to job/x"),
        (LINKED, info(link="job/step-00000100/rank-0000/optimizer.pt"), None),
        (LINKED, info(), "rank-0000/optimizer.pt is now a plain file"),
        (LINKED, info(link="job/step-00000200/rank-0000/optimizer.pt"),
         "rank-0000/optimizer.pt is now a symlink to job/step-00000200/rank-0000/optimizer.pt"),
        (ON_S3, info(10, etag='"e1"'), None),
        (ON_S3, info(10, etag='"e2"'), 'model.pt etag "e1" -> "e2"'),  # same size, replaced
        # The same ETag and size with a later Last-Modified: the same bytes, its metadata touched
        # (Ceph RGW moves Last-Modified on PutObjectTagging, as ckptier's own delete tag does).
        (ON_S3, info(10, mtime=1_700_000_007.0, etag='"e1"'), None),
        (ON_S3, info(10, mtime=1_700_000_007.0, etag='"e2"'), 'model.pt etag "e1" -> "e2"'),
        (ON_S3, info(10, mtime=1_700_000_007.0), "model.pt mtime 1700000000.000 -> 1700000007.000"),  # no ETag now
        (GONE, None, None),  # already held as missing: nothing new
        (GONE, info(), "rank-0000/model.pt is back"),
    ],
)
def test_a_stat_tells_whether_a_file_is_the_one_cataloged(f: FileRecord, now: ObjectInfo | None,
                                                          why: str | None) -> None:
    assert file_change(f, now) == why


CHANGED = Change("rank-0000/model.pt", "rank-0000/model.pt size 6000 -> 1000 bytes", info(size=1000))
VANISHED = Change("rank-0000/model.pt", "rank-0000/model.pt is gone", None)


@pytest.mark.parametrize(
    ("old", "changes", "state", "events"),
    [
        # nothing changed: every verdict stands
        (row(State.VERIFIED, verified=OLD), [], State.VERIFIED, []),
        (row(State.CORRUPT), [], State.CORRUPT, []),
        # a torn file is never verified: verify again
        (row(State.VERIFIED, verified=OLD), [CHANGED], State.COMMITTED, ["changed"]),
        (row(State.VERIFIED, verified=OLD), [VANISHED], State.COMMITTED, ["changed"]),
        # bytes changed since they were found corrupt (a save that completed): verify again
        (row(State.CORRUPT), [CHANGED], State.COMMITTED, ["changed"]),
        (row(State.CORRUPT), [CHANGED, VANISHED], State.COMMITTED, ["changed"]),
        # losing more files proves nothing new: still corrupt (evidence)
        (row(State.CORRUPT), [VANISHED], State.CORRUPT, []),
        # still to verify
        (row(State.COMMITTED), [CHANGED], State.COMMITTED, []),
        # a save in flight is never judged; a tombstone stays one
        (row(State.INCOMPLETE), [CHANGED], State.INCOMPLETE, []),
        (row(State.DELETED), [CHANGED], State.DELETED, []),
    ],
)
def test_what_a_stat_mismatch_does_to_a_state(old: Row, changes: list[Change], state: State,
                                               events: list[str]) -> None:
    t = on_files_changed(old, changes, label="j step 1")
    assert (t.state, [e.kind for e in t.events]) == (state, events)
    if state == State.COMMITTED and old.state != State.COMMITTED:
        assert t.verified_at is None and "rank-0000/model.pt" in (t.reason or "")
    if state == old.state and old.state != State.COMMITTED:
        assert (t.reason, t.verified_at) == (old.reason, old.verified_at)


# -- how much an event's data names -------------------------------------------------------

MANY = tuple(f"rank-{i:04d}/model.pt" for i in range(150))
MANY_SHORT = tuple(Shortfall(name, "metadata.json") for name in MANY)
MANY_FILES = tuple(fr(name) for name in MANY)


def _scan_data(old: Row | None, s: Seen) -> dict[str, Any]:
    t = on_scan(old, s, label="j step 1", location="file:///x", now=NOW, grace=GRACE)
    return dict(t.events[0].data or {})


def _verify_data(results: list[FileCheck]) -> dict[str, Any]:
    t = on_verification(row(State.COMMITTED), MANY_FILES, results, label="j", now=NOW, grace=GRACE).transition
    return dict(t.events[0].data or {})


@pytest.mark.parametrize(
    ("data", "key", "count"),
    [
        pytest.param(lambda: _scan_data(None, seen(short=MANY_SHORT)), "files", 100, id="new-corrupt"),
        pytest.param(lambda: _scan_data(row(State.COMMITTED), seen(short=MANY_SHORT)), "files", 100,
                     id="committed-to-corrupt"),
        pytest.param(lambda: _scan_data(row(State.VERIFIED, verified=OLD), seen(changed=MANY)), "files", 100,
                     id="verified-changed"),
        pytest.param(lambda: _scan_data(row(State.CORRUPT), seen(changed=MANY)), "files", 100, id="corrupt-changed"),
        pytest.param(lambda: _scan_data(row(State.COMMITTED), seen(changed=MANY)), "files", 100,
                     id="committed-changed"),
        pytest.param(lambda: dict(on_files_changed(row(State.VERIFIED, verified=OLD),
                                                   [Change(n, f"{n} is gone") for n in MANY], label="j")
                                  .events[0].data or {}), "files", 100, id="stat-changed"),
        pytest.param(lambda: _verify_data([fc(n, "corrupt") for n in MANY]), "bad", 100, id="verify-bad"),
        pytest.param(lambda: _verify_data([fc(MANY[0], "corrupt"), *(fc(n, "error") for n in MANY[1:])]), "errors",
                     100, id="verify-errors"),
        pytest.param(lambda: _verify_data([fc(f"x{n}", "missing", short=Shortfall(f"x{n}", "metadata.json"))
                                           for n in MANY]), "absent", 100, id="verify-absent"),
        pytest.param(lambda: dict(discovered("j", list(range(1500))).data or {}), "steps", 1000, id="discovered"),
    ],
)
def test_event_data_names_at_most_a_hundred_files(data: Callable[[], dict[str, Any]], key: str, count: int) -> None:
    """Events name the first 100 files (1,000 steps), whatever the size of the checkpoint."""
    assert len(data()[key]) == count
