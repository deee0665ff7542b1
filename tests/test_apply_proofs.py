"""Nothing is deleted on the strength of an old proof.

Before a milestone's hot copy goes, its archive copy is proven again in the
same run; before any deletion, the checkpoints that justify it (the newest
verified, keep_last, the min_verified floor) are proven again, and one that
fails turns corrupt and the plan is made anew. Each test is a reproduction:
a byte flipped where no scan can see it, then ``apply`` through the same
pipeline the command line runs, on local stores and on S3 (moto_server).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ckptier.storage.errors import Unavailable
from ckptier.storage.local import LocalStore
from ckptier.storage.records import State
from ckptier.storage.s3 import S3Store
from ckptier.tasks.retention import keepers
from ckptier.tasks.config import Config
from ckptier.tasks.pipeline import run_apply, run_fetch
from ckptier.tasks.reports import ApplyRunReport
from ckptier.tasks.run import Run
from ckptier.tasks.retention import KeepLast, Milestones, Policy, plan_retention
from tests.fixtures.s3 import S3Server
from tests.test_apply import JOB, STEPS, World, build_world, files_for, recognition
from tests.test_apply_faults import S3World, s3_world  # noqa: F401 - the fixture

MILESTONES = (100, 500)


def apply(world: World, policy: Policy, owner: str = "run-1") -> ApplyRunReport:
    world.clock.advance(timedelta(hours=1))
    return run_apply(Run.of(world.catalog, config=Config(policies=(policy,)), now=world.clock, owner=owner))


def flip_byte(path: Path, *, keep_mtime: bool = True) -> None:
    """Flip one bit in the middle of ``path``; keep its size and (by default) its mtime."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def flip_s3_byte(store: S3Store, key: str) -> None:
    """Replace an S3 object by one with a bit flipped (the store keeps its new CRC64NVME)."""
    data = bytearray(store.client.get_object(Bucket=store.bucket, Key=store._full_key(key))["Body"].read())
    data[len(data) // 2] ^= 0x01
    store.client.put_object(Bucket=store.bucket, Key=store._full_key(key), Body=bytes(data), ChecksumAlgorithm="CRC64NVME")


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = build_world(tmp_path, f"sqlite:///{tmp_path / 'catalog.db'}")
    yield w
    w.catalog.close()


# --------------------------------------------------------------- the archive copy, before a hot copy goes


def _keep_then_delete_hot(world: World, archive_url: str, flip: Any) -> ApplyRunReport:
    """The reproduction: apply with hot_after_archive = "keep"; damage the archive's
    model.pt.ckz of milestone 100; switch to "delete"; apply again."""
    keep = Policy(rules=(KeepLast(2), Milestones(steps=MILESTONES)), archive=archive_url, hot_after_archive="keep")
    first = apply(world, keep)
    assert not first.failed, first.lines
    for step in MILESTONES:
        rec = world.catalog.get(JOB, step)
        assert rec is not None and rec.has_verified_archive() and world.on_disk(step)
    flip(f"{JOB}/step-00000100/rank-0000/model.pt.ckz")
    return apply(world, replace(keep, hot_after_archive="delete"), owner="run-2")


def _assert_hot_copy_kept(world: World, report: ApplyRunReport, tmp_path: Path) -> None:
    by_step = {i.step: i for i in report.items if i.action == "delete"}
    assert world.on_disk(100), "the hot copy was deleted on the strength of an old archive proof"
    assert by_step[100].outcome == "failed" and "archive copy failed its proof" in by_step[100].detail
    assert not world.on_disk(500) and by_step[500].outcome == "done"  # an intact archive copy still lets it go
    rec = world.catalog.get(JOB, 100)
    assert rec is not None and rec.archive_copy() is not None
    assert rec.archive_copy().state == "degraded"  # type: ignore[union-attr]
    assert any(e.kind == "archive.degraded" for e in world.catalog.events(job=JOB, limit=1000))
    # The checkpoint is not lost: fetch restores it, bit-exact, from the hot copy.
    out = run_fetch(Run.of(world.catalog, config=Config(policies=())), job=JOB, step=100, dest=tmp_path / "restored")
    assert out.tier == "hot"
    for rel, data in files_for(100).items():
        assert (tmp_path / "restored" / rel).read_bytes() == data


def test_hot_copy_stays_when_the_archive_copy_fails_a_fresh_proof(world: World, tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    report = _keep_then_delete_hot(world, str(archive), lambda key: flip_byte(archive / key))
    _assert_hot_copy_kept(world, report, tmp_path)
    # The next run does not re-record the damaged copy as good: the promotion fails, the hot copy stays.
    again = apply(world, Policy(rules=(KeepLast(2), Milestones(steps=MILESTONES)), archive=str(archive)), owner="run-3")
    assert again.failed and world.on_disk(100)
    assert any("damaged" in i.detail for i in again.items if i.step == 100)


@pytest.mark.s3
@pytest.mark.s3_servers("moto", "rgw")
def test_hot_copy_stays_when_the_s3_archive_copy_fails_a_fresh_proof(
    world: World, tmp_path: Path, s3_env: str, s3_bucket: Any, s3_server: S3Server
) -> None:
    archive = S3Store(s3_bucket.name, "archive", client=s3_bucket.client)
    report = _keep_then_delete_hot(world, f"s3://{s3_bucket.name}/archive", lambda key: flip_s3_byte(archive, key))
    _assert_hot_copy_kept(world, report, tmp_path)
    # Milestone 500's archive copy was proven by S3's own full-object checksums, without a download
    # (or, where the server keeps no checksums, by reading it all).
    [p500] = [p for p in report.proofs if p.step == 500]
    assert p500.ok and p500.tier == "archive"
    if s3_server.capabilities.stored_checksums:
        assert p500.bytes_read == 0 and p500.bytes_skipped > 0
    else:
        assert p500.bytes_read > 0 and p500.bytes_skipped == 0


# ------------------------------------------------------------------- keepers, before anything they justify


def _keep_last_1(archive: str) -> Policy:
    return Policy(rules=(KeepLast(1), Milestones(steps=MILESTONES)), archive=archive, min_verified=1)


def _assert_fell_back_to_900(world: World, report: ApplyRunReport) -> None:
    assert world.state(1000) == State.CORRUPT  # the keeper failed its proof: kept as evidence
    assert world.on_disk(1000)
    assert world.on_disk(900), "the only good checkpoint after the corrupt newest one was deleted"
    latest = world.catalog.latest(JOB)
    assert latest is not None and latest.step == 900 and "hot" in latest.tiers
    deleted = sorted(i.step for i in report.items if i.action == "delete" and i.outcome == "done")
    assert deleted == [100, 200, 300, 400, 500, 600, 700, 800]  # milestones: hot copies only
    for step in MILESTONES:
        rec = world.catalog.get(JOB, step)
        assert rec is not None and rec.state == State.VERIFIED and rec.tiers == ("archive",)
    assert any(e.kind == "apply.keeper_failed" for e in world.catalog.events(job=JOB, limit=1000))
    assert not report.failed, report.lines


def test_a_keeper_that_fails_its_proof_turns_corrupt_and_the_plan_is_made_anew(world: World, tmp_path: Path) -> None:
    # The newest checkpoint rots in place: same size, same mtime, so no scan can see it.
    flip_byte(world.hot.root / f"{JOB}/step-00001000/rank-0000/model.pt")
    world.catalog.record_scan(world.hot.url, recognition(world.hot.root, STEPS), now=world.clock())
    assert world.state(1000) == State.VERIFIED  # the catalog still believes it

    report = apply(world, _keep_last_1(str(tmp_path / "archive")))
    _assert_fell_back_to_900(world, report)
    proofs = {(p.step, p.tier): p for p in report.proofs}
    assert not proofs[(1000, "hot")].ok and proofs[(900, "hot")].ok
    assert proofs[(900, "hot")].bytes_read == sum(len(d) for d in files_for(900).values())  # read, not assumed


def test_a_milestone_whose_hot_bytes_rotted_turns_corrupt_and_the_next_apply_moves_on(
    world: World, tmp_path: Path
) -> None:
    # The holder of milestone 500 rots before it is promoted; no scan can see it. The
    # promotion reads the bytes and finds them unlike the catalog's: that is proof enough.
    # Before, every apply failed the promotion ("run verify before promoting") and the
    # job's deletions waited until someone ran verify by hand.
    flip_byte(world.hot.root / f"{JOB}/step-00000500/rank-0000/model.pt")
    policy = Policy(rules=(KeepLast(2), Milestones(steps=MILESTONES)), archive=str(tmp_path / "archive"))
    first = apply(world, policy)
    assert first.failed
    assert world.state(500) == State.CORRUPT and world.on_disk(500)
    assert all(world.state(s) == State.VERIFIED for s in (200, 300, 400))  # the job's deletions waited

    second = apply(world, policy, owner="run-2")
    assert not second.failed, second.lines
    assert world.state(500) == State.CORRUPT and world.on_disk(500)  # kept as evidence
    holder = world.catalog.get(JOB, 600)  # milestone 500 passed on to the next save
    assert holder is not None and holder.has_verified_archive()
    assert all(world.state(s) == State.DELETED for s in (200, 300, 400, 700, 800))


@pytest.mark.s3
@pytest.mark.s3_servers("moto", "rgw")
def test_a_keeper_on_s3_is_proven_by_the_stores_checksums(request: pytest.FixtureRequest, tmp_path: Path,
                                                          s3_server: S3Server) -> None:
    w: S3World = request.getfixturevalue("s3_world")
    flip_s3_byte(w.hot, f"{JOB}/step-00001000/rank-0000/model.pt")  # no rescan: the catalog still says verified

    report = apply(w, _keep_last_1(str(tmp_path / "archive")))
    _assert_fell_back_to_900(w, report)
    proofs = {(p.step, p.tier): p for p in report.proofs}
    size_900 = sum(len(d) for d in files_for(900).values())
    if s3_server.capabilities.stored_checksums:  # both proven by S3's full-object CRC64NVME: nothing downloaded
        assert proofs[(1000, "hot")].bytes_read == 0 and proofs[(900, "hot")].bytes_read == 0
        assert proofs[(900, "hot")].bytes_skipped == size_900
    else:  # no stored checksums: proven by reading every byte
        assert proofs[(1000, "hot")].bytes_read > 0 and proofs[(900, "hot")].bytes_read == size_900
        assert proofs[(900, "hot")].bytes_skipped == 0


def test_a_keeper_held_only_in_the_archive_is_proven_from_the_archive(world: World, tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    # Milestone 1000 is archived (its hot copy kept), then its hot copy is lost by hand.
    first = apply(world, Policy(rules=(KeepLast(10), Milestones(steps=(1000,))), archive=str(archive)))
    assert not first.failed and world.catalog.get(JOB, 1000).has_verified_archive()  # type: ignore[union-attr]
    for p in sorted((world.hot.root / f"{JOB}/step-00001000").rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    (world.hot.root / f"{JOB}/step-00001000").rmdir()
    world.catalog.record_scan(world.hot.url, recognition(world.hot.root, STEPS[:-1]), now=world.clock())
    # ... and its archive copy rots. keep_last 2 would rest on it (and on 900) to delete 100-800.
    flip_byte(archive / f"{JOB}/step-00001000/rank-0000/model.pt.ckz")
    policy = Policy(rules=(KeepLast(2), Milestones(steps=(1000,))), archive=str(archive), min_verified=1)
    records = world.catalog.checkpoints(job=JOB)
    assert [k.step for k in keepers(records, policy, plan_retention(records, policy, now=world.clock()).items)] == [1000, 900]

    report = apply(world, policy, owner="run-2")
    assert world.state(1000) == State.CORRUPT  # its only copy is damaged: no longer a keeper
    rec = world.catalog.get(JOB, 1000)
    assert rec is not None and rec.archive_copy() is not None and rec.archive_copy().state == "degraded"  # type: ignore[union-attr]
    assert world.on_disk(900) and world.on_disk(800), "keep_last 2 now rests on 900 and 800"
    assert not world.on_disk(700) and world.state(700) == State.DELETED
    assert {(p.step, p.tier, p.ok) for p in report.proofs} >= {(1000, "archive", False), (800, "hot", True)}
    assert not report.failed, report.lines


class _Unreachable(LocalStore):
    """An archive whose every read fails as an unreachable store's would (after its retries)."""

    def stat(self, key: str) -> Any:
        raise Unavailable(f"{self.url}/{key}: endpoint unreachable")

    def open_read(self, key: str) -> Any:
        raise Unavailable(f"{self.url}/{key}: endpoint unreachable")


def test_a_keeper_whose_archive_copy_cannot_be_read_defers_the_deletions_and_learns_nothing(
    world: World, tmp_path: Path
) -> None:
    archive = tmp_path / "archive"
    policy = Policy(rules=(KeepLast(10), Milestones(steps=(1000,))), archive=str(archive))
    assert not apply(world, policy).failed
    for p in sorted((world.hot.root / f"{JOB}/step-00001000").rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    world.catalog.record_scan(world.hot.url, recognition(world.hot.root, STEPS[:-1]), now=world.clock())
    world.policy = Policy(rules=(KeepLast(2), Milestones(steps=(1000,))), archive=str(archive), min_verified=1)
    world.clock.advance(timedelta(hours=1))

    report = world.apply(archive=_Unreachable(archive), owner="run-2", replan=True)
    assert world.state(1000) == State.VERIFIED  # an unreadable copy proves nothing either way
    rec = world.catalog.get(JOB, 1000)
    assert rec is not None and rec.archive_copy() is not None and rec.archive_copy().state == "present"  # type: ignore[union-attr]
    deletes = [r for r in report.items if r.action == "delete"]
    assert deletes and {r.outcome for r in deletes} == {"deferred"}
    assert all("keeper step 1000: cannot read the archive copy back" in r.detail for r in deletes)
    assert all(world.on_disk(s) for s in STEPS[:-1])


# ------------------------------------------------------------------------------------- pure: who keeps


def test_keepers_are_the_newest_verified_keep_last_and_the_floor(world: World) -> None:
    records = world.catalog.checkpoints(job=JOB)
    policy = Policy(rules=(KeepLast(2), Milestones(steps=MILESTONES)), min_verified=3)
    plan = plan_retention(records, policy, now=world.clock())
    # keep_last 2 → 1000, 900; the floor of 3 hot verified checkpoints the plan keeps → 1000, 900, 500.
    assert [k.step for k in keepers(records, policy, plan.items)] == [1000, 900, 500]
    lone = Policy(rules=(Milestones(steps=MILESTONES),), min_verified=0)
    assert [k.step for k in keepers(records, lone, plan_retention(records, lone, now=world.clock()).items)] == [1000]
    # A corrupt or unverified checkpoint is never a keeper.
    rec = world.catalog.get(JOB, 1000)
    assert rec is not None
    broken = [replace(r, state=State.CORRUPT) if r.id == rec.id else r for r in records]
    assert [k.step for k in keepers(broken, policy, plan_retention(broken, policy, now=world.clock()).items)] == [900, 800, 500]
    # Without a policy every verified checkpoint the plan keeps is a keeper.
    assert [k.step for k in keepers(records, None, plan.items)] == [1000, 900, 500, 100]


def test_dry_run_proves_nothing_and_changes_nothing(world: World, tmp_path: Path) -> None:
    flip_byte(world.hot.root / f"{JOB}/step-00001000/rank-0000/model.pt")
    policy = _keep_last_1(str(tmp_path / "archive"))
    report = run_apply(Run.of(world.catalog, config=Config(policies=(policy,)), now=world.clock, owner="dry", dry_run=True))
    assert report.proofs == () and world.state(1000) == State.VERIFIED
    assert all(world.on_disk(s) for s in STEPS)
