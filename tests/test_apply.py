"""Carrying out a retention plan against a real catalog and local stores.

Each test builds a small cataloged job (10 verified checkpoints of a few KB
in a local hot directory), plans with the real planner and applies it.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from ckptier.storage.base import DeleteResult, ObjectInfo, Store
from ckptier.storage.catalog.api import Catalog, DeleteIntent, FileCheck, LinkedFile
from ckptier.storage.hashing import hash_bytes
from ckptier.storage.local import LocalStore
from ckptier.storage.records import (CheckpointRecord, CopyRecord, CopyState, FileRef, Format, Found, Recognition,
                                     State, Tier)
from ckptier.tasks.apply import (ApplyContext, ApplyReport, _batches, apply_plan, delete_refusal, intent_progress,
                                 link_refusal)
from ckptier.tasks.archive import manifest_key, prefix_from_location
from ckptier.tasks.reports import ItemResult, Proof
from ckptier.tasks.retention import KeepLast, Milestones, Plan, PlanItem, Policy, plan_retention

T0 = datetime(2026, 3, 1, 0, 0, tzinfo=UTC)
STEPS = tuple(range(100, 1100, 100))  # 10 checkpoints
JOB = "llm"


class Clock:
    """A controllable clock: ``now()`` returns the current fake time."""

    def __init__(self, t: datetime) -> None:
        self.t = t

    def __call__(self) -> datetime:
        return self.t

    def advance(self, delta: timedelta) -> None:
        self.t += delta


def files_for(step: int) -> dict[str, bytes]:
    rnd = random.Random(step)
    return {
        "rank-0000/model.pt": rnd.randbytes(4096),
        "rank-0000/optimizer.pt": bytes(rnd.randrange(4) for _ in range(6000)),
        "metadata.json": f'{{"step": {step}}}'.encode(),
    }


def recognition(root: Path, steps: Sequence[int], job: str = JOB) -> Recognition:
    found = []
    for step in steps:
        prefix = f"{job}/step-{step:08d}"
        refs = []
        for rel in sorted(files_for(step)):
            p = root / prefix / rel
            st = p.stat()
            refs.append(FileRef(key=f"{prefix}/{rel}", relpath=rel, size=st.st_size, mtime=st.st_mtime))
        found.append(Found(job=job, step=step, format=Format.GUIDE, prefix=prefix, files=tuple(refs),
                           committed=True, reason="metadata.json present"))
    return Recognition(checkpoints=tuple(found), unrecognised=(), objects=sum(len(f.files) for f in found))


@dataclass
class World:
    hot: LocalStore
    archive: LocalStore
    catalog: Catalog
    url: str
    clock: Clock
    policy: Policy

    def hot_for(self, record: CheckpointRecord) -> tuple[Store, str]:
        return self.hot, prefix_from_location(self.hot, record.location)

    def archive_for(self, job: str) -> Store | None:
        return self.archive

    def plan(self) -> Plan:
        return plan_retention(self.catalog.checkpoints(), self.policy, now=self.clock())

    def apply(self, plan: Plan | None = None, *, owner: str = "run-1", dry_run: bool = False,
              catalog: Catalog | None = None, hot: Store | None = None, archive: Store | None = None,
              ttl: timedelta = timedelta(minutes=30), replan: bool = False) -> Any:
        context = ApplyContext(
            catalog=catalog or self.catalog,
            hot_for=(lambda r: (hot, prefix_from_location(self.hot, r.location))) if hot else self.hot_for,
            archive_for=(lambda job: archive) if archive else self.archive_for,
            owner=owner,
            now=self.clock,
            lease_ttl=ttl,
            dry_run=dry_run,
            policy_for=(lambda job: self.policy) if replan else None,
        )
        return apply_plan(plan if plan is not None else self.plan(), context, policy=str(self.policy))

    def state(self, step: int) -> State:
        rec = self.catalog.get(JOB, step)
        assert rec is not None
        return rec.state

    def on_disk(self, step: int) -> bool:
        return (self.hot.root / f"{JOB}/step-{step:08d}").exists()


def build_world(tmp_path: Path, catalog_url: str, *, steps: Sequence[int] = STEPS,
                hot: LocalStore | None = None) -> World:
    hot = hot or LocalStore(tmp_path / "hot")
    for step in steps:
        for rel, data in files_for(step).items():
            p = hot.root / f"{JOB}/step-{step:08d}" / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
    catalog = Catalog.open(catalog_url)
    catalog.record_scan(hot.url, recognition(hot.root, steps), now=T0)
    for rec in catalog.checkpoints():
        checks = []
        for rel, data in files_for(rec.step).items():
            d = hash_bytes(data)
            checks.append(FileCheck(relpath=rel, status="ok", size=d.size, crc64nvme=d.crc64nvme))
        assert catalog.record_verification(rec.id, checks, now=T0) == State.VERIFIED
    policy = Policy(rules=(KeepLast(2), Milestones(steps=(100, 500))), archive=str(tmp_path / "archive"))
    return World(hot, LocalStore(tmp_path / "archive"), catalog, catalog_url, Clock(T0 + timedelta(days=1)), policy)


@pytest.fixture
def world(tmp_path: Path) -> Any:
    w = build_world(tmp_path, f"sqlite:///{tmp_path / 'catalog.db'}")
    yield w
    w.catalog.close()


DELETED_STEPS = [200, 300, 400, 600, 700, 800]


# ------------------------------------------------------------------------- happy path


def test_apply_promotes_milestones_then_deletes_rolling_checkpoints(world: World) -> None:
    plan = world.plan()
    assert [i.step for i in plan.by_action("promote")] == [100, 500]
    assert [i.step for i in plan.by_action("delete")] == DELETED_STEPS

    report = world.apply(plan)
    assert report.ok, report.summary()
    assert [r.step for r in report.promoted] == [100, 500]
    assert [r.step for r in report.deleted] == DELETED_STEPS
    assert report.bytes_freed == sum(sum(len(d) for d in files_for(s).values()) for s in DELETED_STEPS)
    for step in STEPS:
        gone = step in DELETED_STEPS
        assert world.state(step) == (State.DELETED if gone else State.VERIFIED)
        assert world.on_disk(step) is not gone
    for step in (100, 500):
        rec = world.catalog.get(JOB, step)
        assert rec is not None and rec.has_verified_archive()
        assert (world.archive.root / manifest_key(JOB, step)).exists()
    kinds = {e.kind for e in world.catalog.events(job=JOB, limit=1000)}
    assert {"promote.done", "deleted"} <= kinds
    assert world.catalog.events(kinds=["apply.finished"])

    # Next night: the archived milestones' hot copies go (only the hot copy), nothing else changes.
    world.clock.advance(timedelta(days=1))
    second = world.apply()
    assert second.ok, second.summary()
    assert [(r.step, r.scope) for r in second.deleted] == [(100, "hot-copy"), (500, "hot-copy")]
    for step in (100, 500):
        rec = world.catalog.get(JOB, step)
        assert rec is not None and rec.state == State.VERIFIED and rec.tiers == ("archive",)
        assert not world.on_disk(step)
    # And a third run has nothing left to do.
    world.clock.advance(timedelta(days=1))
    third = world.apply()
    assert third.ok and not third.promoted and not third.deleted


def test_dry_run_reports_the_same_work_and_changes_nothing(world: World, tmp_path: Path) -> None:
    before_files = sorted(p for p in world.hot.root.rglob("*") if p.is_file())
    before_events = len(world.catalog.events(limit=10_000))
    generations = {r.id: r.generation for r in world.catalog.checkpoints()}
    report = world.apply(dry_run=True)
    assert report.dry_run and report.ok
    assert [r.step for r in report.promoted] == [100, 500]
    assert [r.step for r in report.deleted] == DELETED_STEPS
    assert all(r.outcome == "would" for r in report.promoted + report.deleted)
    assert sorted(p for p in world.hot.root.rglob("*") if p.is_file()) == before_files
    assert not (tmp_path / "archive").exists()
    assert all(world.state(s) == State.VERIFIED for s in STEPS)
    assert len(world.catalog.events(limit=10_000)) == before_events
    assert {r.id: r.generation for r in world.catalog.checkpoints()} == generations  # nothing was claimed


# -------------------------------------------------------------------- stale plans


def test_listing_that_shrank_deletes_nothing_even_with_a_stale_plan(world: World) -> None:
    stale = world.plan()  # made while every checkpoint was listed
    assert len(stale.by_action("delete")) == 6
    # A scan of the wrong prefix comes back empty: everything is marked missing.
    world.catalog.record_scan(world.hot.url, Recognition((), (), 0), now=world.clock())
    assert all(r.missing_since is not None for r in world.catalog.checkpoints())

    fresh = world.plan()
    assert fresh.refused and not fresh.by_action("delete")
    report = world.apply(stale)
    assert not report.deleted
    assert all(world.on_disk(s) for s in STEPS)
    assert all(world.state(s) == State.VERIFIED for s in STEPS)
    refused = [r for r in report.items if r.action == "delete"]
    assert refused and all(r.outcome == "skipped" for r in refused)
    assert all("missing from hot storage" in r.detail or "listing shrank" in r.detail for r in refused)


def test_checkpoint_that_became_corrupt_after_planning_is_not_deleted(world: World) -> None:
    plan = world.plan()
    rec = world.catalog.get(JOB, 300)
    assert rec is not None
    world.catalog.record_verification(
        rec.id, [FileCheck(relpath="metadata.json", status="corrupt", detail="injected")], now=world.clock()
    )
    report = world.apply(plan)
    assert world.state(300) == State.CORRUPT and world.on_disk(300)
    [r300] = [r for r in report.items if r.step == 300]
    assert r300.outcome == "skipped" and "corrupt" in r300.detail


def test_recheck_refuses_newest_verified_and_unarchived_hot_copy_deletes(world: World) -> None:
    recs = world.catalog.checkpoints(job=JOB)
    newest = recs[-1]
    item = PlanItem(JOB, newest.step, newest.id, "delete", ("forged",), newest.bytes, "checkpoint", "verified")
    assert "newest verified" in (delete_refusal(item, newest, recs) or "")
    milestone = recs[0]
    hot_copy = PlanItem(JOB, milestone.step, milestone.id, "delete", ("forged",), 1, "hot-copy", "verified")
    assert "no verified archive copy" in (delete_refusal(hot_copy, milestone, recs) or "")
    plain = recs[2]
    ok = PlanItem(JOB, plain.step, plain.id, "delete", ("rolling",), 1, "checkpoint", "verified")
    assert delete_refusal(ok, plain, recs) is None

    # A forged plan that deletes everything: the newest survives, and so do milestone hot copies.
    forged = Plan(items=[PlanItem(JOB, r.step, r.id, "delete", ("forged",), r.bytes,
                                  "hot-copy" if r.step in (100, 500) else "checkpoint", "verified") for r in recs])
    world.apply(forged)
    assert world.on_disk(1000) and world.state(1000) == State.VERIFIED
    assert world.on_disk(100) and world.on_disk(500)


def test_with_the_policy_apply_replans_and_deletes_only_what_a_fresh_plan_deletes(world: World) -> None:
    recs = {r.step: r for r in world.catalog.checkpoints(job=JOB)}
    # A stale or forged plan: deletes milestone 100 whole (not just a hot copy) and keeper 900.
    forged = Plan(items=[PlanItem(JOB, s, recs[s].id, "delete", ("forged",), recs[s].bytes, "checkpoint", "verified")
                         for s in (100, 200, 900)])
    without = world.apply(forged, dry_run=True)
    assert [r.step for r in without.deleted] == [100, 200, 900]  # the cheap re-check cannot know milestones
    report = world.apply(forged, replan=True)
    assert [r.step for r in report.deleted] == [200]
    skipped = {r.step: r.detail for r in report.items if r.outcome == "skipped"}
    assert "milestone" in skipped[100] and "keep_last" in skipped[900]
    assert world.on_disk(100) and world.on_disk(900) and not world.on_disk(200)


def test_failed_promotion_defers_the_jobs_deletes_and_a_rerun_finishes(world: World) -> None:
    class BrokenArchive(LocalStore):
        def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
            from ckptier.storage.errors import Unavailable

            raise Unavailable(f"{self.url}/{key}: 503 SlowDown (injected)")

    report = world.apply(archive=BrokenArchive(world.archive.root))
    assert not report.ok
    assert [r.outcome for r in report.items if r.action == "promote"] == ["failed", "failed"]
    assert {r.outcome for r in report.items if r.action == "delete"} == {"deferred"}
    assert all(world.on_disk(s) for s in STEPS)
    assert [f.action for f in report.failures] == ["promote", "promote"]
    assert all("503 SlowDown (injected)" in f.detail for f in report.failures), report.failures
    # Every lease was given back despite the failures.
    assert all(world.catalog.claim(r.id, "probe", now=world.clock(), ttl=timedelta(seconds=1)) is not None
               for r in world.catalog.checkpoints())
    world.clock.advance(timedelta(seconds=2))

    rerun = world.apply()
    assert rerun.ok, rerun.summary()
    assert [r.step for r in rerun.promoted] == [100, 500]
    assert [r.step for r in rerun.deleted] == DELETED_STEPS


# ------------------------------------------------------------------- concurrency


class CountingArchive(LocalStore):
    """Counts data uploads and manifest commits per checkpoint directory (thread-safe)."""

    def __init__(self, root: Path, counts: dict[str, int], lock: threading.Lock) -> None:
        super().__init__(root)
        self.counts = counts
        self.lock = lock

    def write(self, key: str, data: bytes | BinaryIO, *, if_absent: bool = False) -> ObjectInfo:
        info = super().write(key, data, if_absent=if_absent)
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1
        return info


def test_two_applies_at_once_handle_each_checkpoint_once(tmp_path: Path, catalog_url: str) -> None:
    w = build_world(tmp_path, catalog_url)
    counts: dict[str, int] = {}
    lock = threading.Lock()
    deletes: list[str] = []

    class CountingHot(LocalStore):
        def delete_proven(self, proven: Sequence[ObjectInfo]) -> DeleteResult:
            with lock:
                deletes.extend(i.key for i in proven)
            return super().delete_proven(proven)

    plan = w.plan()
    barrier = threading.Barrier(2)
    reports: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(owner: str) -> None:
        try:
            cat = Catalog.open(catalog_url)  # each run has its own Catalog and connections
            try:
                barrier.wait()
                reports[owner] = w.apply(plan, owner=owner, catalog=cat,
                                         hot=CountingHot(w.hot.root), archive=CountingArchive(w.archive.root, counts, lock))
            finally:
                cat.close()
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(o,)) for o in ("run-a", "run-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    # Every promotion happened exactly once: each data object and manifest written once.
    assert counts and all(n == 1 for n in counts.values()), counts
    assert sum(1 for k in counts if k.endswith("ckptier-manifest.json")) == 2
    promoted = [r.step for rep in reports.values() for r in rep.promoted]
    assert sorted(promoted) == [100, 500]
    # Every delete happened once; no file was deleted twice.
    deleted = [r.step for rep in reports.values() for r in rep.deleted]
    assert sorted(deleted) == DELETED_STEPS
    assert len(deletes) == len(set(deletes)) == 3 * len(DELETED_STEPS)
    for step in STEPS:
        assert w.state(step) == (State.DELETED if step in DELETED_STEPS else State.VERIFIED)
    w.catalog.close()


def test_zombie_whose_lease_expired_cannot_tombstone(tmp_path: Path, catalog_url: str) -> None:
    w = build_world(tmp_path, catalog_url)
    ttl = timedelta(minutes=5)
    target = w.catalog.get(JOB, 200)
    assert target is not None
    rival = Catalog.open(catalog_url)
    taken: list[int | None] = []

    class StallingHot(LocalStore):
        """The zombie stalls inside its delete until its lease is long gone and another run took over."""

        def delete_proven(self, proven: Sequence[ObjectInfo]) -> DeleteResult:
            w.clock.advance(ttl * 3)
            taken.append(rival.claim(target.id, "run-new", now=w.clock(), ttl=ttl))
            return super().delete_proven(proven)

    only_200 = Plan(items=[i for i in w.plan().items if i.step == 200])
    report = w.apply(only_200, owner="run-zombie", hot=StallingHot(w.hot.root), ttl=ttl)
    assert taken and taken[0] is not None  # the new run got the lease (a higher generation)
    [item] = report.items
    assert item.outcome == "fenced"
    assert w.state(200) == State.VERIFIED  # the tombstone was refused
    assert any(e.kind == "delete.fenced" for e in w.catalog.events(job=JOB))
    # The new holder can still finish the work with its own generation.
    assert rival.mark_deleted(target.id, owner="run-new", generation=taken[0], now=w.clock(), reasons=["test"])
    rival.close()
    w.catalog.close()


# ------------------------------------------------------------ the pure decisions, as tables

def _rec(id: int, state: State = State.VERIFIED, *, missing: bool = False, hot: CopyState | None = None,
         archive: CopyState | None = None, archive_verified: bool = True) -> CheckpointRecord:
    """Checkpoint ``id`` of JOB at step 100 * id; ``hot``/``archive``: the state of a recorded copy in that tier."""
    copies = []
    if hot is not None:
        copies.append(CopyRecord(Tier.HOT, f"file:///hot/{JOB}/{id}", hot, 10, None))
    if archive is not None:
        copies.append(CopyRecord(Tier.ARCHIVE, f"s3://arch/{JOB}/{id}", archive, 8, T0 if archive_verified else None))
    return CheckpointRecord(
        id=id, job=JOB, step=100 * id, format=Format.GUIDE, state=state, location=f"file:///hot/{JOB}/{id}",
        bytes=10, saved_at=T0, first_seen=T0, last_seen=T0, missing_since=T0 if missing else None,
        verified_at=T0 if state == State.VERIFIED else None, state_reason=None, copies=tuple(copies),
    )


def _item(r: CheckpointRecord, scope: str = "checkpoint", state: str = "verified") -> PlanItem:
    return PlanItem(JOB, r.step, r.id, "delete", ("rolling",), r.bytes, scope, state)  # type: ignore[arg-type]


R1, R2, R3, R4 = (_rec(i) for i in (1, 2, 3, 4))  # R4: the newest verified


@pytest.mark.parametrize(
    ("item", "record", "job", "fraction", "refusal"),
    [
        pytest.param(_item(R1), None, [R2, R3, R4], 0.5, "no longer in the catalog", id="vanished-row"),
        pytest.param(_item(R1), _rec(1, State.DELETED), [R2, R3, R4], 0.5, "already deleted", id="deleted"),
        pytest.param(_item(R1), _rec(1, State.COMMITTED), [R2, R3, R4], 0.5,
                     "state is now committed (plan saw verified); not deleting", id="no-longer-verified"),
        pytest.param(_item(R1, state="incomplete"), _rec(1, State.INCOMPLETE), [R2, R3, R4], 0.5, None,
                     id="stale-incomplete-planned-as-such"),
        pytest.param(_item(R1), _rec(1, State.INCOMPLETE), [R2, R3, R4], 0.5,
                     "state is now incomplete (plan saw verified); not deleting", id="incomplete-planned-verified"),
        pytest.param(_item(R1), _rec(1, missing=True), [R2, R3, R4], 0.5,
                     f"missing from hot storage since {T0.isoformat()}; nothing to delete", id="missing"),
        pytest.param(_item(R1), _rec(1, hot=CopyState.MISSING), [R2, R3, R4], 0.5,
                     "the catalog records no present hot copy; nothing to delete", id="hot-copy-missing"),
        pytest.param(_item(R1), _rec(1, hot=CopyState.DELETED), [R2, R3, R4], 0.5,
                     "the catalog records no present hot copy; nothing to delete", id="hot-copy-deleted"),
        pytest.param(_item(R1), _rec(1, hot=CopyState.PRESENT, archive=CopyState.MISSING), [R2, R3, R4], 0.5, None,
                     id="only-an-archive-copy-missing"),
        # the shrink guard: more than the fraction missing, or every other checkpoint when the record is not listed
        pytest.param(_item(R1), R1, [R1, _rec(2, missing=True), _rec(3, missing=True), R4], 0.5, None,
                     id="half-missing-is-not-more-than-half"),
        pytest.param(_item(R1), R1, [R1, _rec(2, missing=True), _rec(3, missing=True), _rec(4, missing=True)], 0.5,
                     "listing shrank: 3 of 4 checkpoints of job 'llm' missing from hot storage (> 50%); check the "
                     "scanned URL, rescan, then apply", id="shrunk"),
        pytest.param(_item(R1), R1, [_rec(2, missing=True), _rec(3, missing=True)], 1.0,
                     "listing shrank: 2 of 2 checkpoints of job 'llm' missing from hot storage (> 100%); check the "
                     "scanned URL, rescan, then apply", id="all-others-missing"),
        pytest.param(_item(R1), R1, [R1, R4, *(_rec(i, State.DELETED, missing=True) for i in (2, 3))], 0.5, None,
                     id="tombstones-do-not-count"),
        pytest.param(_item(R1), R1, [], 0.5, None, id="no-job-records"),
        # the newest verified checkpoint
        pytest.param(_item(R4), R4, [R1, R2, R3, R4], 0.5, "newest verified checkpoint of the job; never deleted",
                     id="newest"),
        pytest.param(_item(R3), R3, [R1, R2, R3, _rec(4, State.COMMITTED)], 0.5,
                     "newest verified checkpoint of the job; never deleted", id="newest-verified-under-a-committed"),
        pytest.param(_item(R3), R3, [R4, R3, R2, R1], 0.5, None, id="not-newest"),
        pytest.param(_item(_rec(4, archive=CopyState.PRESENT), "hot-copy"), _rec(4, archive=CopyState.PRESENT),
                     [R1, R2, R3, _rec(4, archive=CopyState.PRESENT)], 0.5, None, id="newest-hot-copy-archived"),
        # hot-copy deletes need a verified archive copy now
        pytest.param(_item(R1, "hot-copy"), R1, [R1, R2, R3, R4], 0.5,
                     "hot-copy delete planned but no verified archive copy is recorded now", id="hot-copy-no-archive"),
        pytest.param(_item(R1, "hot-copy"), _rec(1, archive=CopyState.PRESENT, archive_verified=False),
                     [R1, R2, R3, R4], 0.5, "hot-copy delete planned but no verified archive copy is recorded now",
                     id="hot-copy-unverified-archive"),
        pytest.param(_item(R1, "hot-copy"), _rec(1, archive=CopyState.PRESENT), [R1, R2, R3, R4], 0.5, None,
                     id="hot-copy-archived"),
    ],
)
def test_delete_refusals(item: PlanItem, record: CheckpointRecord | None, job: list[CheckpointRecord],
                         fraction: float, refusal: str | None) -> None:
    assert delete_refusal(item, record, job, max_missing_fraction=fraction) == refusal


@pytest.mark.parametrize(
    ("files", "listed", "present", "progress"),
    [
        pytest.param(None, 3, 3, "not-started", id="count-unrecorded-all-present"),
        pytest.param(None, 3, 2, "started", id="count-unrecorded-one-gone"),
        pytest.param(3, 3, 3, "not-started", id="all-present"),
        pytest.param(3, 3, 2, "started", id="one-gone"),
        pytest.param(3, 2, 2, "started", id="a-rescan-dropped-one"),
        pytest.param(2, 3, 3, "not-started", id="more-listed-than-it-was-to-delete"),
    ],
)
def test_intent_progress(files: int | None, listed: int, present: int, progress: str) -> None:
    intent = DeleteIntent(1, JOB, 100, "checkpoint", T0, files)
    assert intent_progress(intent, listed, present) == progress


def _link(cid: int, link: str, *, location: str = "file:///hot/other/step-5", relpath: str = "model.pt") -> LinkedFile:
    return LinkedFile(cid, "other", 5 * cid, location, relpath, link)


TAIL = ("; a checkpoint another one links into is deleted only once that one no longer does")


@pytest.mark.parametrize(
    ("prefix", "links", "single", "refusal"),
    [
        pytest.param("llm/step-100", [], False, None, id="no-links"),
        pytest.param("llm/step-100", [_link(1, "llm/step-100/model.pt")], False, None, id="its-own-link"),
        pytest.param("llm/step-100", [_link(2, "llm/step-100/model.pt")], False,
                     "kept: other step 10's model.pt is a symlink to llm/step-100/model.pt" + TAIL, id="one"),
        pytest.param("llm/step-100/", [_link(2, "llm/step-100/a"), _link(3, "llm/step-100/b", relpath="b.pt")], False,
                     "kept: other step 10's model.pt is a symlink to llm/step-100/a (+1 more)" + TAIL, id="two"),
        pytest.param("llm/step-100", [_link(2, "llm/step-1000/model.pt")], False, None, id="a-longer-name"),
        pytest.param("llm/step-100", [_link(2, "llm/step-100/model.pt", location="file:///other/x")], False, None,
                     id="another-store"),
        pytest.param("llm/step-100", [_link(2, "llm/step-100/model.pt", location="file:///hotter/x")], False, None,
                     id="a-store-whose-name-starts-alike"),
        pytest.param("", [_link(2, "anything/at/all")], False,
                     "kept: other step 10's model.pt is a symlink to anything/at/all" + TAIL, id="the-store-root"),
        pytest.param("llm/model.pt", [_link(2, "llm/model.pt")], True,
                     "kept: other step 10's model.pt is a symlink to llm/model.pt" + TAIL, id="single-file"),
        pytest.param("llm/model.pt", [_link(2, "llm/model.pt.bak")], True, None, id="single-file-alike"),
    ],
)
def test_link_refusals(prefix: str, links: list[LinkedFile], single: bool, refusal: str | None) -> None:
    assert link_refusal(R1, "file:///hot/", prefix, links, single=single) == refusal


def test_deletes_go_in_batches_of_at_most_a_thousand_keys() -> None:
    keys = [f"k{i}" for i in range(2500)]
    batches = _batches(keys)
    assert [len(b) for b in batches] == [1000, 1000, 500]
    assert [k for b in batches for k in b] == keys
    assert _batches(["a", "b", "c"], 2) == [["a", "b"], ["c"]] and _batches([]) == []


def _result(action: str, outcome: str, freed: int = 0) -> ItemResult:
    return ItemResult(JOB, 1, 1, action, "checkpoint", outcome, "d", 10, freed)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("report", "summary", "ok"),
    [
        pytest.param(ApplyReport(False), "promote 0, delete 0 (0 bytes freed)", True, id="empty"),
        pytest.param(ApplyReport(True, [_result("promote", "would"), _result("delete", "would", 7)]),
                     "would promote 1, would delete 1 (7 bytes freed)", True, id="dry-run"),
        pytest.param(ApplyReport(False, [_result("promote", "done"), _result("promote", "held"),
                                         _result("delete", "done", 10), _result("delete", "done", 5),
                                         _result("delete", "skipped"), _result("delete", "deferred"),
                                         _result("delete", "deferred")],
                                 proofs=[Proof(JOB, 1, 1, "hot", True, "ok", 100, 20),
                                         Proof(JOB, 2, 2, "archive", True, "ok", 30)]),
                     "promote 1, delete 2 (15 bytes freed), skipped 1, held 1, deferred 2, proved 2 of 2 keepers "
                     "(130 bytes read, 20 by store checksum)", True, id="done"),
        pytest.param(ApplyReport(False, [_result("promote", "failed"), _result("delete", "partial", 3),
                                         _result("delete", "fenced")],
                                 proofs=[Proof(JOB, 1, 1, "hot", False, "bad", 4)]),
                     "promote 0, delete 0 (3 bytes freed), failed 1, partial 1, fenced 1, proved 0 of 1 keepers "
                     "(4 bytes read, 0 by store checksum)", False, id="failures"),
        pytest.param(ApplyReport(False, canary_failures={"s3://b": "put failed"}),
                     "promote 0, delete 0 (0 bytes freed), canary failed on 1 store(s)", False, id="canary"),
    ],
)
def test_apply_report_summary(report: ApplyReport, summary: str, ok: bool) -> None:
    assert report.summary() == summary
    assert report.ok is ok
    assert [i.outcome for i in report.held] == ["held"] * sum(1 for i in report.items if i.outcome == "held")
    assert {i.outcome for i in report.failures} <= {"failed", "partial", "fenced"}
    assert len(report.failures) == sum(1 for i in report.items if i.outcome in ("failed", "partial", "fenced"))
